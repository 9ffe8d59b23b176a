"""Half-precision greedy decoding: how much pass shapes round apart, how often our outputs part from ar,
and whether computing the lm head in fp32 reduces that.

Two measurements:

  --rounding   the figures behind `treegraft_dist.evaluation.lossless.ROUNDING_FACTOR`. For each model and dtype, the
               target's greedy continuation of a prompt is computed three ways over the same positions:
               one token per pass (as `ar` decodes), blocks of 8 tokens per pass after the prefill (as a
               verification pass sees them), and one causal pass over everything (as `lossless.classify`
               does). For each pair of shapes and each position, the spread max(dl) - min(dl) over the
               vocabulary (dl = the per-token logit difference: the most the pair can move the gap between
               any two tokens) is divided by eps(dtype) * max|logit|. Tiny random models (tests/tiny.py)
               in bf16 and fp16, plus the embedded 1.5B target in bf16 with --real.

  (default)    flips: a few benchmark prompts (first question of each, chat-formatted) decoded in bf16 with
               `ar` and `all-small`, once with the lm head as `CausalLM.logits` runs it (bf16 matmul, then
               .float()) and once with the head in fp32 (hidden.float() @ weight.float().T; a wrapper here,
               CausalLM is unchanged). Per head: outputs that differ from ar and their verdicts
               (`lossless.classify`), and, teacher-forced on the bf16-head ar continuation with the SAME
               hidden states for both heads, the argmax disagreements between the one-token and the
               block-8 pass and the positions whose top-two gap is within the rounding tolerance.

Measured on the 2-core CPU (busy; Qwen2.5-Coder-1.5B-Instruct in bf16, first question of gsm8k, humaneval,
alpaca, qa, 48 tokens, all-small at budget 16; about 1 hour):

    lm head  all-small differing  exact/near-tie/mismatch  gap@token    one-token vs block-8 argmax   worst spread
    bf16     1/4 (alpaca)         3/1/0                    -0.125@11    2/192 positions differ        3.61
    fp32     1/4 (alpaca)         3/1/0                    -0.021@30    1/192                         3.58

The fp32 head does not measurably reduce flips: the spread comes from the bf16 hidden states (28 layers
of bf16 rounding), not from the head's final rounding; it moved the one flip, it did not remove it. 64 and
63 of the 192 positions had a top-two gap within the rounding tolerance (about 2 logits at this scale):
one gap alone is a weak test there, which is why `classify` also checks every later token.

    python -m jobs.bench.flips --rounding [--real] [--tokens 64]
    python -m jobs.bench.flips [--model PATH] [--benchmarks gsm8k,humaneval,alpaca,qa] [--tokens 48] [--budget 16]
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from jobs.bench.common import tests_on_path
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder, truncate
from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
from treegraft_dist.evaluation.lossless import classify, tolerance
from treegraft_dist.models.hf import CausalLM, cache_len

DEFAULT_MODEL = "~/.cache/treegraft/models/qwen2.5-coder-1.5b-instruct"


# -- pass shapes ------------------------------------------------------------------------------------------
def one_token_greedy(lm: CausalLM, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation as `ar` computes it (prefill, then one token a pass) and its hidden rows [n, hidden]."""
    cache = lm.new_cache()
    h = lm.hidden(cache, torch.tensor(prompt), torch.arange(len(prompt)))[-1:]
    rows, out = [h], [int(lm.logits(h)[0].argmax())]
    for _ in range(n - 1):
        h = lm.hidden(cache, torch.tensor(out[-1:]), torch.tensor([cache_len(cache)]))
        rows.append(h)
        out.append(int(lm.logits(h)[0].argmax()))
    return out, torch.cat(rows)


def block_hidden(lm: CausalLM, prompt: list[int], tokens: list[int], size: int) -> torch.Tensor:
    """[len(tokens), hidden]: rows predicting `tokens`, fed `size` tokens a pass after the prefill."""
    cache = lm.new_cache()
    rows = [lm.hidden(cache, torch.tensor(prompt), torch.arange(len(prompt)))[-1:]]
    rest = tokens[:-1]
    for s in range(0, len(rest), size):
        past = cache_len(cache)
        chunk = rest[s : s + size]
        rows.append(lm.hidden(cache, torch.tensor(chunk), torch.arange(past, past + len(chunk))))
    return torch.cat(rows)


def causal_hidden(lm: CausalLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), hidden]: the same rows from one causal pass over prompt + tokens[:-1]."""
    ids = prompt + tokens[:-1]
    return lm.hidden(lm.new_cache(), torch.tensor(ids), torch.arange(len(ids)))[len(prompt) - 1 :]


def spread_ratio(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [n, vocab] x2 -> [n]
    """Per position: how far the two can move the gap between any two tokens, in eps * max|logit|."""
    d = b - a
    return (d.max(-1).values - d.min(-1).values) / (torch.finfo(dtype).eps * a.abs().max(-1).values)


def fp32_head(lm: CausalLM) -> CausalLM:
    """The same model with logits computed from hidden.float() and an fp32 copy of the head."""
    w = lm.head_rows(torch.arange(lm.vocab_size)).detach().float()
    b = lm.head.bias.detach().float() if getattr(lm.head, "bias", None) is not None else None
    out = copy.copy(lm)

    @torch.inference_mode()
    def logits(hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        z = hidden.float() @ w.T
        return z if b is None else z + b

    out.logits = logits
    return out


# -- rounding -----------------------------------------------------------------------------------------------
def rounding_rows(name: str, lm: CausalLM, prompts: list[list[int]], n: int) -> list[tuple]:
    """(model, dtype, pair, positions, worst ratio, p99 ratio, worst spread in logits, max|logit|) per pair."""
    shapes: dict[str, list[torch.Tensor]] = {"one-token": [], "block-8": [], "causal": []}
    for prompt in prompts:
        tokens, one = one_token_greedy(lm, prompt, n)
        for key, h in (("one-token", one), ("block-8", block_hidden(lm, prompt, tokens, 8)),
                       ("causal", causal_hidden(lm, prompt, tokens))):
            shapes[key].append(lm.logits(h))
    logits = {k: torch.cat(v) for k, v in shapes.items()}
    out = []
    for a, b in (("one-token", "block-8"), ("one-token", "causal"), ("block-8", "causal")):
        r = spread_ratio(logits[a], logits[b], lm.dtype)
        d = logits[b] - logits[a]
        out.append((name, str(lm.dtype).removeprefix("torch."), f"{a} vs {b}", len(r), float(r.max()),
                    float(r.quantile(0.99)), float((d.max(-1).values - d.min(-1).values).max()),
                    float(logits[a].abs().max())))
    return out


def tiny_models(dtype: torch.dtype):
    tests_on_path()
    from tiny import tiny_model

    for arch in ("llama", "qwen3"):
        for init in (0.25, 0.4):
            for seed in (0, 1):
                yield f"tiny {arch} init {init} seed {seed}", CausalLM(tiny_model(arch, seed, init=init).to(dtype))


def run_rounding(args) -> None:
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for name, lm in tiny_models(dtype):
            g = torch.Generator().manual_seed(len(rows))
            prompts = [torch.randint(0, lm.vocab_size, (40,), generator=g).tolist() for _ in range(2)]
            rows += rounding_rows(name, lm, prompts, args.tokens)
            print(*_fmt(rows[-3:]), sep="\n", flush=True)
    if args.real:
        from treegraft_dist.models.loading import load_model

        target = load_model(os.path.expanduser(args.model), "cpu", "bfloat16")
        prompts = [chat_prompt(target.tokenizer, [builtin(b)[0].turns[0]], []) for b in args.benchmarks.split(",")]
        rows += rounding_rows("Qwen2.5-Coder-1.5B", target.lm, prompts, args.tokens)
        print(*_fmt(rows[-3:]), sep="\n", flush=True)
    print("\nworst spread / (eps * max|logit|) by model family and dtype:")
    groups: dict[tuple, float] = {}
    for r in rows:
        key = ("tiny" if r[0].startswith("tiny") else r[0], r[1])
        groups[key] = max(groups.get(key, 0.0), r[4])
    for (model, dtype), worst in groups.items():
        print(f"  {model:24s} {dtype:9s} {worst:.2f}")


def _fmt(rows):
    return [f"{m:28s} {d:9s} {p:22s} n={n:4d} worst {w:.2f} p99 {q:.2f} spread {s:.3f} logits (max|logit| {x:.1f})"
            for m, d, p, n, w, q, s, x in rows]


# -- flips ----------------------------------------------------------------------------------------------
def run_flips(args) -> None:
    from treegraft_dist.models.loading import load_model

    target = load_model(os.path.expanduser(args.model), "cpu", "bfloat16")
    eos = target.eos_ids
    prompts = {b: chat_prompt(target.tokenizer, [builtin(b)[0].turns[0]], []) for b in args.benchmarks.split(",")}
    heads = {"bf16 (CausalLM.logits)": target.lm, "fp32 (hidden.float() @ W.float().T)": fp32_head(target.lm)}
    table = {h: {"outputs": 0, "differ": 0, "exact": 0, "near-tie": 0, "mismatch": 0, "gaps": [], "positions": 0,
                 "disagree": 0, "at_risk": 0, "worst_ratio": 0.0} for h in heads}
    cfg = TreeConfig(budget=args.budget)
    for bench, prompt in prompts.items():
        # Teacher-forced: one-token and block-8 hidden states over the bf16 head's greedy continuation, then
        # both heads on the same hidden states, so only the head differs.
        t0 = time.time()
        tokens, one = one_token_greedy(target.lm, prompt, args.tokens)
        blk = block_hidden(target.lm, prompt, tokens, 8)
        for name, lm in heads.items():
            a, b = lm.logits(one), lm.logits(blk)
            row = table[name]
            row["positions"] += len(a)
            row["disagree"] += int((a.argmax(-1) != b.argmax(-1)).sum())
            top = a.topk(2, dim=-1).values
            row["at_risk"] += sum(float(t[0] - t[1]) <= tolerance(target.lm.dtype, r) for t, r in zip(top, a))
            row["worst_ratio"] = max(row["worst_ratio"], float(spread_ratio(a, b, target.lm.dtype).max()))
            if lm is target.lm:  # the same calls as Decoder's ar, already made above: reuse them
                ref = truncate(tokens, args.tokens, set(eos))
            else:
                ref = Decoder(lm, None, cfg).generate(prompt, args.tokens, "ar", eos).tokens
            out = Decoder(lm, None, cfg).generate(prompt, args.tokens, "all-small", eos).tokens
            check = classify(lm, prompt, ref, out)
            row["outputs"] += 1
            row[check.verdict] += 1
            if check.verdict != "exact":
                row["differ"] += 1
                row["gaps"].append(f"{check.logit_gap:.3f}@{check.diverge_at}" if check.logit_gap is not None
                                   else f"-@{check.diverge_at}")
                print(f"  {bench} [{name}]: {check.verdict}, {check.reason}", flush=True)
        print(f"{bench}: {len(prompt)} prompt tokens, {len(tokens)} new, {time.time() - t0:.0f} s", flush=True)
    print(f"\n{len(prompts)} prompts x {args.tokens} tokens, bf16 on CPU, all-small at budget {args.budget}\n")
    print("| lm head | all-small outputs differing from ar | exact/near-tie/mismatch | gap@position | "
          "teacher-forced positions | argmax one-token vs block-8 differs | top-2 gap within tolerance | "
          "worst spread (eps*max|logit|) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in table.items():
        print(f"| {name} | {r['differ']}/{r['outputs']} | {r['exact']}/{r['near-tie']}/{r['mismatch']} | "
              f"{', '.join(r['gaps']) or '-'} | {r['positions']} | {r['disagree']} | {r['at_risk']} | "
              f"{r['worst_ratio']:.2f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounding", action="store_true", help="measure pass-shape rounding (ROUNDING_FACTOR)")
    p.add_argument("--real", action="store_true", help="with --rounding: the embedded 1.5B target too")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target folder (prepared by `treegraft prepare-models`)")
    p.add_argument("--benchmarks", default="gsm8k,humaneval,alpaca,qa")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=16)
    args = p.parse_args(argv)
    if not args.rounding or args.real:
        if not os.path.isdir(os.path.expanduser(args.model)):
            raise SystemExit(f"{args.model} does not exist: run `treegraft prepare-models` or pass --model")
    torch.manual_seed(0)
    run_rounding(args) if args.rounding else run_flips(args)


if __name__ == "__main__":
    main()
