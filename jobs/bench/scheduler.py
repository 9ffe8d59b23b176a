"""Time the scheduler's work before one drafting layer on this CPU, without any model:

  (a) compute_signals on a realistic tree
  (b) LearnedScheduler.decide
  (c) both together: one scheduler call as the engine makes it (target: median within 0.35 ms)
  (d) ValuePlanner.decide: the value system used online instead

(c) is timed first at each state, right after the graft as in the engine; (a), (b) and (d) then run on
the same state, with the tree already in the CPU caches, so (a) + (b) can come out below (c).

Each request's context is 1,000 tokens of one random 200-token sequence over a 500-token vocabulary,
repeated with 10% of the tokens mutated (the target's prefill top-k is synthetic, as in ngram.py).
Rounds run `engine.draft_tree` over D = 5 layers, each layer calling the middle drafter with probability
1/2: the n-gram drafter is the real one; the middle drafter is a stand-in that grafts what a call grafts
(K children of each of the top-K reselected nodes) with random tokens and log-probs. A round accepts the
longest path of the true continuation in the pruned tree plus a bonus token, so the index grows as while
decoding. The timed calls run inside the drafters' `step`, on the tree, frontier and call prefix the
engine's scheduler saw before that layer. The scheduler and the value heads are randomly initialised
(the time does not depend on the weights), z-scored on the signals of the warm-up rounds.

    python -m jobs.bench.scheduler [--calls 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from jobs.bench.common import synthetic_prefill
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import draft_tree
from treegraft_dist.decoding.ngram import NGramDrafter, PrefillCache
from treegraft_dist.decoding.schedule import CallablePolicy
from treegraft_dist.decoding.scheduler import LearnedScheduler, SchedulerInfo, SchedulerMLP
from treegraft_dist.decoding.signals import SIGNAL_NAMES, Timings, compute_signals, context_signals
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, DraftTree, Proposal
from treegraft_dist.scheduling.value import ValueHeads, ValuePlanner

TARGET_MS = 0.35
CONTEXT = 1000
PERIOD = 200  # length of the repeated sequence
VOCAB = 500
MUTATION = 0.1  # share of the stream's tokens replaced at random
ROUNDS_PER_REQUEST = 20
WARMUP_ROUNDS = 20
TIMINGS = Timings(t_tgt_ms=30.0, t_mid_ms=4.0)
ROWS = {"signals": "(a) compute_signals", "decide": "(b) LearnedScheduler.decide",
        "call": "(c) one scheduler call, (a) + (b)", "planner": "(d) ValuePlanner.decide"}


def repeated_stream(n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] ids: one random PERIOD-token sequence repeated, a share MUTATION of the tokens replaced."""
    out = np.tile(rng.integers(0, VOCAB, PERIOD), -(-n // PERIOD))[:n]
    hit = rng.random(n) < MUTATION
    out[hit] = rng.integers(0, VOCAB, int(hit.sum()))
    return out


class StandInMiddle:
    """Grafts what a middle call grafts, without a model: K children of each of the top-K reselected
    nodes, with random tokens and log-probs."""

    origin = ORIGIN_MIDDLE

    def __init__(self, cfg: TreeConfig, rng: np.random.Generator):
        self.cfg = cfg
        self.rng = rng

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        k = self.cfg.top_k
        selected = tree.reselect(frontier, self.cfg.lookback, k, ORIGIN_MIDDLE)
        parents = np.repeat(selected, k)
        tokens = self.rng.integers(0, VOCAB, len(parents))
        scores = tree.scores[parents] - self.rng.exponential(2.0, len(parents))
        return Proposal(tree.size, parents, tokens, scores, ORIGIN_MIDDLE)


class Probe:
    """Runs the scheduler's work before each drafting layer; `wrap` puts it in front of a drafter's step,
    which sees the tree and frontier exactly as the engine's scheduler did."""

    def __init__(self, cfg: TreeConfig):
        self.cfg = cfg
        self.context = context_signals(CONTEXT, TIMINGS)
        self.calls: list[bool] = []
        self.scheduler: LearnedScheduler | None = None  # None during warm-up: only collect signals
        self.planner: ValuePlanner | None = None
        self.warmup_signals: list[np.ndarray] = []
        self.ms: dict[str, list[float]] = {name: [] for name in ROWS}
        self.tree_sizes: list[int] = []

    def wrap(self, drafter, call: bool) -> "Probed":
        return Probed(drafter, call, self)

    def before(self, tree: DraftTree, frontier: np.ndarray, layer: int, call: bool) -> None:
        if layer == 0:
            self.calls = []
        args = (tree, frontier, layer, self.calls, self.cfg.depth, self.cfg.lookback, self.cfg.top_k,
                self.context)
        if self.scheduler is None:
            self.warmup_signals.append(compute_signals(*args))
        else:
            # The engine's call comes first, right after the graft, as it does while decoding.
            clock = time.perf_counter
            t0 = clock()
            self.scheduler.decide(compute_signals(*args), layer)
            t1 = clock()
            signals = compute_signals(*args)
            t2 = clock()
            self.scheduler.decide(signals, layer)
            t3 = clock()
            self.planner.decide(signals, layer)
            t4 = clock()
            for name, dt in zip(("call", "signals", "decide", "planner"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                self.ms[name].append(dt * 1e3)
            self.tree_sizes.append(tree.size)
        self.calls.append(call)


class Probed:
    def __init__(self, inner, call: bool, probe: Probe):
        self.inner, self.call, self.probe = inner, call, probe

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:  # layer: 1-based
        self.probe.before(tree, frontier, layer - 1, self.call)
        return self.inner.step(tree, frontier, layer)


def random_models(signals: np.ndarray, seed: int) -> tuple[LearnedScheduler, ValuePlanner]:
    """A randomly initialised scheduler and value planner, z-scored on `signals` [n, 17]."""
    mean = signals.mean(0).astype(np.float32)
    std = np.maximum(signals.std(0), 1e-6).astype(np.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        scheduler = LearnedScheduler(SchedulerMLP(SIGNAL_NAMES, mean, std), SchedulerInfo(("none", "none")))
        planner = ValuePlanner(ValueHeads.untrained(SIGNAL_NAMES, mean, std))
    return scheduler, planner


def main(argv=None) -> dict[str, dict[str, float]]:
    """Run the benchmark and print its table; returns {row: {"median_ms", "p90_ms"}} for (a) .. (d)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="scheduler calls (drafting layers) measured")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.calls < 1:
        raise SystemExit(f"--calls must be at least 1, got {args.calls}")

    cfg = TreeConfig()
    rng = np.random.default_rng(args.seed)
    rounds = WARMUP_ROUNDS + -(-args.calls // cfg.depth)
    requests = -(-rounds // ROUNDS_PER_REQUEST)
    span = CONTEXT + 1 + ROUNDS_PER_REQUEST * (cfg.max_tree_depth + 1)  # the most tokens a request uses
    stream = repeated_stream(span * requests, rng)
    probe = Probe(cfg)
    policy = CallablePolicy(lambda signals, layer: bool(rng.random() < 0.5), "random-half", needs_signals=False)
    ngram = NGramDrafter.from_config(cfg)
    drafters = probe.wrap(ngram, False), probe.wrap(StandInMiddle(cfg, rng), True)
    timer = PhaseTimer(RequestStats(policy.name))

    for r in range(rounds):
        if r == WARMUP_ROUNDS:
            probe.scheduler, probe.planner = random_models(np.stack(probe.warmup_signals), args.seed)
            gc.collect()
        if r % ROUNDS_PER_REQUEST == 0:
            start = r // ROUNDS_PER_REQUEST * span
            prompt = stream[start : start + CONTEXT]
            truth = stream[start + CONTEXT : start + span]
            ngram.start(prompt.tolist(), PrefillCache(*synthetic_prefill(prompt, VOCAB, rng)))
            ngram.accept([], [int(truth[0])])
            pos = 1
        tree, _ = draft_tree(int(truth[pos - 1]), cfg, policy, *drafters, timer, None)
        pruned, kept = tree.prune(cfg.budget)
        hit = pruned.follow(truth[pos:])
        ngram.accept([0] + [int(kept[i]) for i in hit], truth[pos : pos + len(hit) + 1].tolist())
        pos += len(hit) + 1

    results = {}
    for name, ms in probe.ms.items():
        ms = np.asarray(ms[: args.calls])
        results[name] = {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90))}
    sizes = np.asarray(probe.tree_sizes[: args.calls])
    print(f"scheduler cost before one drafting layer, {args.calls} calls ({rounds - WARMUP_ROUNDS} rounds of "
          f"{cfg.depth} layers after {WARMUP_ROUNDS} warm-up), torch threads {torch.get_num_threads()}")
    print(f"context {CONTEXT}+ tokens, tree size at the decision: median {np.median(sizes):.0f}, "
          f"max {sizes.max()} nodes")
    print(f"{'':36s}{'median ms':>10s}{'p90 ms':>10s}")
    for name, label in ROWS.items():
        print(f"{label:36s}{results[name]['median_ms']:10.4f}{results[name]['p90_ms']:10.4f}")
    median = results["call"]["median_ms"]
    verdict = "within" if median <= TARGET_MS else "over"
    print(f"median of (c) {median:.4f} ms: {verdict} the {TARGET_MS} ms target")
    return results


if __name__ == "__main__":
    main()
