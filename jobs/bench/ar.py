"""Our plain decoding (`ar`: engine.decode_plain through TargetVerifier.step) against transformers' own greedy
`model.generate(do_sample=False)` on the embedded target, side by side, in bf16 and fp32.

For every dtype, prompt and repeat the two run in turn (the order alternates), on the same loaded target
(each revision imported under its own name, see round.py). Prints tokens/s over the whole request, the
prefill (ours: the prefill phase; generate: a 1-token generate) and the decoding ms per token after it,
and whether both produced the same ids.

    python -m jobs.bench.ar                               # the working tree
    python -m jobs.bench.ar --revs HEAD~1 . --repeats 3   # ar of two revisions, generate in each
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from jobs.bench.common import GENERATE, load_revisions, per_round_ms

METHODS = ("ar", GENERATE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", default=["."], help="git revisions; `.` = the working tree")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--benchmarks", default="humaneval,gsm8k,sum")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        report(dtype, args, run_dtype(args, dtype))


def run_dtype(args, dtype: str) -> dict[tuple[str, str], list[dict]]:
    """(variant, benchmark) -> results, variant = "REV ar" or "REV generate"."""
    revisions = load_revisions(args.revs, dtype, with_middle=False)
    turns = [(r, m) for r in revisions for m in METHODS]
    for r, method in turns:  # untimed warm-up
        r.decode(args.benchmarks.split(",")[0], method, 1, 4)
    rows: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for bench in args.benchmarks.split(","):
            for r, method in turns if rep % 2 == 0 else turns[::-1]:
                rows.setdefault((f"{r.rev} {method}", bench), []).append(r.decode(bench, method, 1, args.new_tokens))
    return rows


def report(dtype: str, args, rows: dict) -> None:
    print(f"\n== {dtype}: {args.new_tokens} new tokens, median of {args.repeats} repeats")
    print(f"  {'benchmark':<10} {'variant':<22} {'tokens/s':>9} {'prefill ms':>11} {'ms/token':>9}  same ids")
    variants = [f"{rev} {m}" for rev in args.revs for m in METHODS]
    for bench in args.benchmarks.split(","):
        ref = rows[(f"{args.revs[0]} {GENERATE}", bench)][0]["tokens"]
        for v in variants:
            rs = rows[(v, bench)]
            tps = statistics.median(len(r["tokens"]) / r["wall_s"] for r in rs)
            pre = statistics.median(per_round_ms(r)["prefill"] for r in rs)
            tok = statistics.median(per_round_ms(r)["round"] for r in rs)
            same = all(r["tokens"] == ref for r in rs)
            print(f"  {bench:<10} {v:<22} {tps:>9.2f} {pre:>11.1f} {tok:>9.1f}  {'yes' if same else 'NO'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
