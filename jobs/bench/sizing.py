"""Adaptive tree sizing (sizing.TreeSizer) against pruning to a fixed budget, on the embedded pair, side by side.

For every prompt (the first question of each benchmark, chat-formatted, `--new-tokens` tokens) the variants
decode in turn, in an order that alternates between prompts: `ar`, the schedule at each fixed budget
(pruned by score), and the schedule sized per round with each maximum size. One sizer per variant learns
across the prompts (as a server's would); an untimed request on a prompt outside the measured ones warms
everything up first. Prints per benchmark the tokens/s ratio over `ar`, the accepted tokens per round and
the mean tree size, then the mean over benchmarks; every output is checked against `ar`'s.

    python -m jobs.bench.sizing                                # all-small: budgets 8,16 vs sized up to 32,64
    python -m jobs.bench.sizing --method 01000 --fixed 16 --sized 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from jobs.bench.common import embedded_paths
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import latency_profile
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.sizing import TreeSizer
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from treegraft_dist.models.loading import load_model
from treegraft_dist.models.paths import cache_root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="all-small")
    ap.add_argument("--fixed", default="8,16", help="fixed budgets, pruned by score")
    ap.add_argument("--sized", default="32,64", help="largest sizes of the sized variants")
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    target_dir, middle_dir = embedded_paths()
    target = load_model(str(target_dir), "cpu", args.dtype)
    middle = load_model(str(middle_dir), "cpu", args.dtype, target.tokenizer, drafter=True) if "1" in args.method or \
        args.method in ("all-mid", "treegraft") else None
    costs = latency_profile(target.lm, target.source, cache_root())
    print("verification ms by tree size: " + ", ".join(f"{s}: {ms:.0f}" for s, ms in costs.items()))
    mid = middle.lm if middle else None
    variants = {"ar": (Decoder(target.lm), "ar")}
    for b in map(int, args.fixed.split(",")):
        variants[f"budget {b}"] = (Decoder(target.lm, mid, TreeConfig(budget=b)), args.method)
    for m in map(int, args.sized.split(",")):
        variants[f"sized <= {m}"] = (Decoder(target.lm, mid, TreeConfig(budget=m),
                                             sizer=TreeSizer(costs, max_size=m)), args.method)
    benches = args.benchmarks.split(",")
    prompt = {b: chat_prompt(target.tokenizer, [builtin(b)[0].turns[0]], []) for b in benches}
    warm = chat_prompt(target.tokenizer, [builtin(benches[0])[-1].turns[0]], [])
    for dec, method in variants.values():
        dec.generate(warm, 16, method, target.eos_ids)
    rows = {}
    for i, b in enumerate(benches):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in order:
            dec, method = variants[name]
            rows[name, b] = dec.generate(prompt[b], args.new_tokens, method, target.eos_ids)
        ref = rows["ar", b]
        print(f"\n{b} ({len(prompt[b])} prompt tokens)")
        for name in variants:
            g = rows[name, b]
            s = g.stats
            print(f"  {name:<12} {s.tokens_per_s / ref.stats.tokens_per_s:6.2f}x  {s.tokens_per_s:6.2f} tok/s  "
                  f"{s.mean_accepted:5.2f} acc/round  tree {statistics.mean(s.tree_sizes or [1]):5.1f}  "
                  f"{'same' if g.tokens == ref.tokens else 'DIFFERS'}")
        sys.stdout.flush()
    print(f"\n== mean over {len(benches)} benchmarks ({args.method}, {args.dtype}, {args.new_tokens} tokens)")
    for name in variants:
        ratio = statistics.mean(rows[name, b].stats.tokens_per_s / rows["ar", b].stats.tokens_per_s for b in benches)
        acc = statistics.mean(rows[name, b].stats.mean_accepted for b in benches)
        print(f"  {name:<12} {ratio:6.2f}x  {acc:5.2f} acc/round")


if __name__ == "__main__":
    main()
