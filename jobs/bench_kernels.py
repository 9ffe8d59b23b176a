"""Stock against packed CPU linear layers (treegraft_dist/kernels.py) on the embedded target, side by side.

The target is loaded twice, once with PyTorch's stock `nn.Linear` and once packed for oneDNN, and both
are measured in turn in one process:
  1. verification ms by tree size (a chain of n nodes on a 256-token cache; best of repeats, interleaved);
  2. whole requests on benchmark prompts: our `ar`, `all-small` at fixed budgets and transformers' own
     greedy `generate`, each on both, the order alternating per repeat; tokens/s and whether the ids equal
     the stock `ar`'s.

    python jobs/bench_kernels.py                        # auto dtype, 48 new tokens, 2 repeats
    python jobs/bench_kernels.py --dtype float32 --budgets 8,16 --benchmarks humaneval,sum
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from treegraft_dist import kernels
from treegraft_dist.benchmarks import builtin, chat_prompt
from treegraft_dist.budget import forward_ms
from treegraft_dist.config import TreeConfig
from treegraft_dist.engine import Decoder
from treegraft_dist.models import load_model, pick_dtype
from treegraft_dist.precision import cpu_model
from treegraft_dist.prepare import DEFAULT_TARGET, prepare_model

SIZES = (1, 2, 4, 8, 16, 32, 64)


def generate(lm, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--benchmarks", default="humaneval,gsm8k,sum")
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    if kernels.unsupported(dtype):
        raise SystemExit(f"nothing to compare: {kernels.unsupported(dtype)}")
    folder = str(prepare_model(DEFAULT_TARGET))
    stock = load_model(folder, "cpu", args.dtype, pack=False)
    packed = load_model(folder, "cpu", args.dtype, pack=False)
    kernels.pack(packed.lm.model)
    packed.lm.packed = True
    lms = {"stock": stock.lm, "packed": packed.lm}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}")

    # 1. verification cost by tree size
    caches = {}
    for k, lm in lms.items():
        caches[k] = lm.new_cache()
        lm.hidden(caches[k], torch.zeros(256, dtype=torch.int64), torch.arange(256))
    ms: dict[tuple[str, int], float] = {}
    for rep in range(3):
        for k in (lms if rep % 2 == 0 else list(lms)[::-1]):
            for n in SIZES:
                ms[k, n] = min(ms.get((k, n), float("inf")), forward_ms(lms[k], n, repeats=2, cache=caches[k]))
    print("\n| tree size | " + " | ".join(map(str, SIZES)) + " |\n" + "|---" * (len(SIZES) + 1) + "|")
    for k in lms:
        print(f"| {k} ms | " + " | ".join(f"{ms[k, n]:.0f}" for n in SIZES) + " |")
    for k in lms:
        print(f"| {k} / its 1 node | " + " | ".join(f"{ms[k, n] / ms[k, 1]:.2f}" for n in SIZES) + " |")
    print("| stock / packed | " + " | ".join(f"{ms['stock', n] / ms['packed', n]:.2f}x" for n in SIZES) + " |")
    sys.stdout.flush()

    # 2. whole requests
    budgets = [int(b) for b in args.budgets.split(",") if b]
    methods = ["ar"] + [f"all-small@{b}" for b in budgets] + ["generate"]
    variants = [(k, m) for k in lms for m in methods]
    prompts = {b: chat_prompt(stock.tokenizer, [builtin(b)[0].turns[0]], []) for b in args.benchmarks.split(",")}

    def run(kernel: str, method: str, prompt: list[int], n: int) -> tuple[list[int], float]:
        lm = lms[kernel]
        if method == "generate":
            return generate(lm, prompt, n)
        name, _, budget = method.partition("@")
        gen = Decoder(lm, None, TreeConfig(budget=int(budget or 1))).generate(prompt, n, name)
        return gen.tokens, gen.stats.wall_s

    for k, m in variants:  # untimed warm-up
        run(k, m, next(iter(prompts.values())), 4)
    rows: dict[tuple[str, str, str], list[tuple[list[int], float]]] = {}
    for rep in range(args.repeats):
        for bench, prompt in prompts.items():
            for k, m in variants if rep % 2 == 0 else variants[::-1]:
                rows.setdefault((bench, k, m), []).append(run(k, m, prompt, args.new_tokens))
    print(f"\n{args.new_tokens} new tokens, median of {args.repeats} repeats; tok/s (same ids as stock ar?)")
    print("| benchmark | " + " | ".join(f"{k} {m}" for k, m in variants) + " | packed ar / stock ar |")
    print("|---" * (len(variants) + 2) + "|")
    for bench in prompts:
        ref = rows[bench, "stock", "ar"][0][0]
        tps = {(k, m): statistics.median(len(t) / s for t, s in rows[bench, k, m]) for k, m in variants}
        same = {v: all(t == ref for t, _ in rows[(bench, *v)]) for v in variants}
        print(f"| {bench} | " + " | ".join(f"{tps[v]:.2f}{'' if same[v] else ' (ids differ)'}" for v in variants)
              + f" | {tps['packed', 'ar'] / tps['stock', 'ar']:.2f}x |")


if __name__ == "__main__":
    main()
