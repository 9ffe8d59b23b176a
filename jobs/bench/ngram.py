"""Time one n-gram drafting step at a long context, the way the engine drafts an all-small round.

By default the context is natural text from the benchmark prompt sets, one id per whitespace-separated
word, so repeated phrases are as frequent as in real prompts; `--source zipf` is a harder case (Zipf ids
with repeated spans: many matches per lookup). The target's prefill top-10 is synthetic. Each round runs `engine.draft_tree` under the
all-small schedule (grafting and `next_frontier` exactly as the engine does), prunes to the verification
budget, and accepts the longest prefix of the true continuation that is a path in the pruned tree plus
one bonus token, so the index grows as it does while decoding. Only `NGramDrafter.step` is timed.

    python -m jobs.bench.ngram --context 2048 --rounds 200 --top-k 10 --depth 5 [--source zipf] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import glob
import json
import os
import pstats
import statistics
import time

import numpy as np

from jobs.bench.common import PREFILL_TOP_K, synthetic_prefill
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import draft_tree
from treegraft_dist.decoding.ngram import NGramDrafter, PrefillCache
from treegraft_dist.decoding.schedule import fixed_schedule
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import DraftTree

DEFAULT_DATA = "/work/shared/data/benchmarks"
WARMUP_ROUNDS = 10
BUILD_REPEATS = 5


def build_ms(fn) -> tuple[float, float]:
    """(first, median of BUILD_REPEATS) wall ms of fn(). A full collection runs first: with torch imported
    the heap is large, and a pending generation-2 collection would otherwise land inside the first build."""
    times = []
    for _ in range(BUILD_REPEATS):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times[0], statistics.median(times)


def word_stream(data_dir: str, sets: str) -> np.ndarray:
    """[n_words] ids of every prompt turn and reference of the chosen sets, in file order."""
    vocab: dict[str, int] = {}
    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(data_dir, f"{sets}.jsonl"))):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                for text in row.get("turns", []) + row.get("reference", []):
                    ids.extend(vocab.setdefault(w, len(vocab)) for w in str(text).split())
    if not ids:
        raise SystemExit(f"no text found in {data_dir}/{sets}.jsonl: pass --data DIR or --sets NAME")
    return np.asarray(ids, np.int64)


def zipf_stream(n: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[n] Zipf-distributed ids where, a third of the time, a span of 4-32 earlier tokens repeats."""
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 1 / 3:
            length = int(rng.integers(4, 33))
            start = int(rng.integers(0, len(out) - length))
            out.extend(out[start : start + length])
        else:
            out.extend((np.minimum(rng.zipf(1.2, size=8), vocab) - 1).tolist())
    return np.asarray(out[:n], np.int64)


class TimedDrafter:
    """The n-gram drafter with each `step` timed (or profiled); everything else passes through."""

    def __init__(self, inner: NGramDrafter, profiler: cProfile.Profile | None = None):
        self.inner = inner
        self.origin = inner.origin
        self.profiler = profiler
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.record = False

    def start(self, prompt, prefill):
        self.inner.start(prompt, prefill)

    def accept(self, path, tokens):
        self.inner.accept(path, tokens)

    def step(self, tree, frontier, layer):
        profiling = self.profiler is not None and self.record
        if profiling:
            self.profiler.enable()
        t = time.perf_counter()
        proposal = self.inner.step(tree, frontier, layer)
        dt = time.perf_counter() - t
        if profiling:
            self.profiler.disable()
        if self.record:
            self.times.append(dt)
            self.sizes.append(len(proposal))
        return proposal


def accepted_path(tree: DraftTree, truth: np.ndarray) -> list[int]:
    """Node ids (root first) of the longest prefix of `truth` that is a path in `tree`."""
    path = [0]
    for tok in truth:
        node = tree.child(path[-1], int(tok))
        if node is None:
            break
        path.append(node)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048, help="prompt length in tokens (words)")
    ap.add_argument("--rounds", type=int, default=200, help="measured drafting rounds (after warm-up)")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--source", choices=("text", "zipf"), default="text",
                    help="text: words of the benchmark prompts; zipf: Zipf ids with repeated spans")
    ap.add_argument("--data", default=DEFAULT_DATA, help="folder of the benchmark *.jsonl files")
    ap.add_argument("--sets", default="*", help="which sets, a glob on the file name: *, sum, humaneval, ...")
    ap.add_argument("--offset", type=int, default=0, help="skip this many words of the stream first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="then cProfile the steps of a second identical run")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    max_gain = TreeConfig(depth=args.depth).max_tree_depth + 1
    need = args.context + 1 + (args.rounds + WARMUP_ROUNDS) * max_gain
    if args.source == "zipf":
        stream = zipf_stream(need, 32_000, rng)
    else:
        stream = word_stream(args.data, args.sets)[args.offset:]
    vocab = int(stream.max()) + 1
    if len(stream) < args.context + 2:
        raise SystemExit(f"the text has {len(stream)} words, fewer than --context {args.context} + 2")
    if len(stream) < need:  # repeat the text rather than run out of continuation
        stream = np.tile(stream, -(-need // len(stream)))
    prompt, first, truth = stream[: args.context], int(stream[args.context]), stream[args.context + 1 :]

    cfg = TreeConfig(depth=args.depth, top_k=args.top_k)
    top_tokens, top_logprobs = synthetic_prefill(prompt, vocab, rng)
    prefill = PrefillCache(top_tokens, top_logprobs)
    prefill_ms = build_ms(lambda: PrefillCache(top_tokens, top_logprobs))

    prompt_list = prompt.tolist()
    index_ms = build_ms(lambda: NGramDrafter.from_config(cfg).start(prompt_list, prefill))

    def run(profiler=None) -> tuple[TimedDrafter, list[int], list[int]]:
        """Warm-up plus measured rounds from the same prompt; returns the drafter, tree sizes, accepted."""
        drafter = TimedDrafter(NGramDrafter.from_config(cfg), profiler)
        drafter.start(prompt_list, prefill)
        drafter.accept([], [first])
        policy = fixed_schedule("all-small", cfg.depth)
        timer = PhaseTimer(RequestStats(policy.name))
        root, pos = first, 0
        tree_sizes, accepted = [], []
        for r in range(WARMUP_ROUNDS + args.rounds):
            drafter.record = r >= WARMUP_ROUNDS
            tree, _ = draft_tree(root, cfg, policy, drafter, None, timer, None)
            pruned, kept = tree.prune(cfg.budget)
            path = accepted_path(pruned, truth[pos:])
            gained = [int(x) for x in truth[pos : pos + len(path)]]  # accepted drafts, then the bonus token
            drafter.accept([int(kept[i]) for i in path], gained)
            pos += len(gained)
            root = gained[-1]
            if drafter.record:
                tree_sizes.append(tree.size)
                accepted.append(len(gained))
        return drafter, tree_sizes, accepted

    gc.collect()
    drafter, tree_sizes, accepted = run()

    ms = np.asarray(drafter.times) * 1e3
    median, p90, mean = float(np.median(ms)), float(np.percentile(ms, 90)), float(ms.mean())
    source = f"benchmark words, sets {args.sets!r}" if args.source == "text" else "Zipf ids with repeated spans"
    print(f"stream: {len(stream)} tokens ({source}), vocabulary {vocab}")
    print(f"prefill cache build (PrefillCache): first {prefill_ms[0]:.2f} ms, median {prefill_ms[1]:.2f} ms "
          f"for {args.context} positions x top-{PREFILL_TOP_K}")
    print(f"index build (NGramDrafter.start): first {index_ms[0]:.2f} ms, median {index_ms[1]:.2f} ms "
          f"for {args.context} tokens")
    print(f"context: {args.context + 1} tokens at the first round, {len(drafter.inner.index.tokens)} at the end")
    print(f"rounds measured: {args.rounds} (+{WARMUP_ROUNDS} warm-up), depth {cfg.depth}, top-k {cfg.top_k}")
    print(f"steps measured: {len(ms)}")
    print(f"step time: median {median:.3f} ms, p90 {p90:.3f} ms, mean {mean:.3f} ms, max {ms.max():.3f} ms")
    print(f"nodes proposed per step: mean {statistics.fmean(drafter.sizes):.1f}, max {max(drafter.sizes)}")
    print(f"tree size per round before pruning: mean {statistics.fmean(tree_sizes):.1f}; "
          f"accepted per round (bonus included): mean {statistics.fmean(accepted):.2f}")
    if args.profile:  # a second, identical run: the profiler's overhead stays out of the times above
        profiler = cProfile.Profile()
        run(profiler)
        print("cProfile of NGramDrafter.step over a second identical run (times inflated by the profiler):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    print(f"ngram step median {median:.2f} ms (p90 {p90:.2f} ms) at context {args.context}")


if __name__ == "__main__":
    main()
