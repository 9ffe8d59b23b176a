"""The cheap drafting side (draft.py) against the full one, on the embedded pair, side by side in one process.

Two middle drafters are loaded: "full" (the model's own precision, every id of the vocabulary) and "cheap"
(int8 decoder linears where this CPU runs them faster, logits over the draft vocabulary); the target's
prefill cache follows the variant (the whole vocabulary, or the draft one). For every prompt (the first
question of each benchmark, chat-formatted) `ar` and each method under both variants decode in turn, the
order alternating between prompts, after one untimed warm-up request each. Prints per benchmark and method
the tokens/s ratio over `ar`, accepted tokens per round, ms per middle call and the per-phase seconds, then
the means; every output is checked against `ar`'s.

    python -m jobs.bench.draft --dtype float32 --methods all-small,all-mid --budgets all-small=8,all-mid=12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from jobs.bench.common import embedded_paths
from treegraft_dist.models import draft, kernels
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from treegraft_dist.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="all-small,all-mid")
    ap.add_argument("--budgets", default="all-small=8,all-mid=12", help="METHOD=N per method (others: 12)")
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    target_dir, middle_dir = embedded_paths()
    target = load_model(str(target_dir), "cpu", args.dtype)
    cheap_vocab = target.lm.draft_vocab.numpy() if target.lm.draft_vocab is not None else None
    os.environ[kernels.INT8_ENV] = "off"
    os.environ[draft.VOCAB_ENV] = "0"
    kernels.int8_choice.cache_clear()
    full = load_model(str(middle_dir), "cpu", args.dtype, target.tokenizer, drafter=True).lm
    for env in (kernels.INT8_ENV, draft.VOCAB_ENV):
        del os.environ[env]
    kernels.int8_choice.cache_clear()
    cheap = load_model(str(middle_dir), "cpu", args.dtype, target.tokenizer, drafter=True).lm
    print(f"full: {draft.describe(full)}; cheap: {draft.describe(cheap)} ({kernels.int8_choice(cheap.dtype).reason})")
    budgets = dict(kv.split("=") for kv in args.budgets.split(",") if kv)
    methods = args.methods.split(",")
    # (label, method) -> (decoder, target draft vocabulary for the prefill cache)
    variants = {("ar", "ar"): (Decoder(target.lm), None)}
    for m in methods:
        tree = TreeConfig(budget=int(budgets.get(m, 12)))
        variants["full", m] = (Decoder(target.lm, full, tree), None)
        variants["cheap", m] = (Decoder(target.lm, cheap, tree), cheap_vocab)

    def run(key, ids, n):
        dec, vocab = variants[key]
        draft.set_draft_vocabulary(target.lm, vocab)
        return dec.generate(ids, n, key[1], target.eos_ids)

    benches = args.benchmarks.split(",")
    prompt = {b: chat_prompt(target.tokenizer, [builtin(b)[0].turns[0]], []) for b in benches}
    warm = chat_prompt(target.tokenizer, [builtin(benches[0])[-1].turns[0]], [])
    for key in variants:
        run(key, warm, 8)
    rows = {}
    for i, b in enumerate(benches):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for key in order:
            rows[key, b] = run(key, prompt[b], args.new_tokens)
        ref = rows[("ar", "ar"), b]
        print(f"\n{b} ({len(prompt[b])} prompt tokens; ar {ref.stats.tokens_per_s:.2f} tok/s, "
              f"prefill {ref.stats.seconds['prefill']:.1f} s)")
        for key in variants:
            g = rows[key, b]
            s = g.stats
            calls = sum(s.middle_calls)
            phases = " ".join(f"{k} {v:.1f}" for k, v in s.seconds.items() if v >= 0.05)
            print(f"  {key[0]:<5} {key[1]:<10} {s.tokens_per_s / ref.stats.tokens_per_s:5.2f}x  "
                  f"{s.mean_accepted:5.2f} acc/round  "
                  f"{(1e3 * s.seconds['middle'] / calls if calls else 0):5.0f} ms/middle call  [{phases}]  "
                  f"{'same' if g.tokens == ref.tokens else 'DIFFERS'}")
        sys.stdout.flush()
    print(f"\n== mean over {len(benches)} benchmarks ({args.dtype}, {args.new_tokens} tokens)")
    for key in variants:
        ratio = statistics.mean(rows[key, b].stats.tokens_per_s / rows[("ar", "ar"), b].stats.tokens_per_s
                                for b in benches)
        acc = statistics.mean(rows[key, b].stats.mean_accepted for b in benches)
        mid = sum(rows[key, b].stats.seconds["middle"] for b in benches)
        calls = sum(sum(rows[key, b].stats.middle_calls) for b in benches)
        print(f"  {key[0]:<5} {key[1]:<10} {ratio:5.2f}x  {acc:5.2f} acc/round  "
              f"{(1e3 * mid / calls if calls else 0):5.0f} ms/middle call")


if __name__ == "__main__":
    main()
