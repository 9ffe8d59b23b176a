"""Small passes on a CPU, their two speed-ups on and off side by side: products of a few rows padded to
the row count oneDNN streams fastest (models/kernels.row_padding) and single-request blocks of up to
models/hf.SMALL_BLOCK rows attending by grouped matmuls instead of torch's fused attention.

    python -m jobs.bench.passes --benchmarks humaneval,gsm8k,sum --new-tokens 64 --repeats 2

Loads the embedded pair once (bf16 where native) and decodes the first question of each benchmark with
every method under both settings, the settings alternating per (prompt, method, repeat), so background
load on the shared machine falls on both alike. Prints per phase ms a round and the tokens per second of
each setting, their ratio, and whether the tokens agree with the first setting's `ar` (bf16 rounding
differs between the two settings, so a near-tie can flip: judged by the target's logits).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jobs.bench.common import embedded_paths
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.evaluation import benchmarks, lossless
from treegraft_dist.models import hf, kernels
from treegraft_dist.models.loading import load_model

GENERATE = "generate"  # transformers' own greedy generate on the same model


def settings(pad: int) -> dict[str, tuple[int, int]]:
    """name -> (row padding, SMALL_BLOCK for single-request passes)."""
    return {"before": (1, 0), "after": (pad, hf.SMALL_BLOCK)}


def apply(models, pad_to: int, small_block: int) -> None:
    for model in models:
        for m in model.modules():
            if isinstance(m, kernels.PackedLinear):
                m.pad_to = pad_to
    hf.SMALL_BLOCK = small_block


def decode(target, middle, prompt, method: str, budget: int, n: int) -> tuple[list[int], float, dict, int]:
    if method == GENERATE:
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist(), time.perf_counter() - t, {}, n
    gen = Decoder(target, middle, TreeConfig(budget=budget)).generate(prompt, n, method)
    return gen.tokens, gen.stats.wall_s, dict(gen.stats.seconds), gen.stats.rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmarks", default="humaneval,gsm8k,sum")
    ap.add_argument("--methods", default="ar,generate,all-small,all-mid,01001")
    ap.add_argument("--budgets", default="all-small=8,all-mid=12,01001=16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    target_dir, middle_dir = embedded_paths()
    target = load_model(str(target_dir), "cpu", args.dtype)
    middle = load_model(str(middle_dir), "cpu", args.dtype, target.tokenizer, drafter=True)
    pad = kernels.padding_of(target.lm.model)
    print(f"{kernels.describe(target.lm.dtype, target.lm.model)}\nmiddle row padding: "
          f"{kernels.padding_of(middle.lm.model)}", flush=True)
    if pad == 1:
        print("row padding measured no faster here: 'after' pads nothing", flush=True)
    budgets = dict(kv.split("=") for kv in args.budgets.split(",") if kv)
    names = settings(pad)
    rows, prompt_of = [], {}
    for bench in args.benchmarks.split(","):
        q = benchmarks.builtin(bench)[0]
        prompt = prompt_of[bench] = benchmarks.chat_prompt(target.tokenizer, [q.turns[0]], [])
        for method in args.methods.split(","):
            for r in range(args.repeats):
                order = list(names) if r % 2 == 0 else list(reversed(names))
                for name in order:
                    apply([target.lm.model, middle.lm.model], *names[name])
                    tokens, wall, seconds, rounds = decode(target.lm, middle.lm, prompt, method,
                                                           int(budgets.get(method, 1)), args.new_tokens)
                    rows.append(dict(bench=bench, method=method, setting=name, tokens=tokens, wall=wall,
                                     seconds=seconds, rounds=rounds))
                    print(f"{bench:10s} {method:9s} {name:6s} {len(tokens) / wall:6.2f} tok/s "
                          f"{1e3 * wall / max(rounds, 1):7.1f} ms/round", flush=True)
    apply([target.lm.model, middle.lm.model], *names["after"])
    print(f"\n| benchmark | method | before tok/s | after tok/s | after/before | after phases ms/round "
          f"| against before's ar |\n|---|---|---|---|---|---|---|")
    for bench in args.benchmarks.split(","):
        ref = next(x["tokens"] for x in rows if x["bench"] == bench and x["method"] == "ar" and x["setting"] == "before")
        for method in args.methods.split(","):
            sub = {s: [x for x in rows if x["bench"] == bench and x["method"] == method and x["setting"] == s]
                   for s in names}
            rate = {s: statistics.median(len(x["tokens"]) / x["wall"] for x in xs) for s, xs in sub.items()}
            after = sub["after"][0]
            phases = ", ".join(f"{k} {1e3 * v / max(after['rounds'], 1):.0f}" for k, v in after["seconds"].items()
                               if v and k != "prefill")
            verdicts = sorted({lossless.classify(target.lm, prompt_of[bench], ref, x["tokens"]).verdict
                               for s in names for x in sub[s]})
            print(f"| {bench} | {method} | {rate['before']:.2f} | {rate['after']:.2f} | "
                  f"{rate['after'] / rate['before']:.2f}x | {phases} | {'/'.join(verdicts)} |")


if __name__ == "__main__":
    main()
