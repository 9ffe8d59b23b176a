"""What each pass costs on this device: the one home of cost profiles.

  forward_ms        one forward of a model over a block of nodes, on a cache of typical length;
  latency_profile   target verification ms by tree size (CANDIDATES), measured once per (model, device),
                    cached as JSON and measured again when it was taken on a busy machine;
  swept_profile     the best of PROFILE_SWEEPS sweeps over the sizes, so that one burst of another process's
                    work does not stay in a profile (checked again at check_sizes when the cache is read);
  middle_profile    middle-drafter forward ms by tokens (MIDDLE_BLOCKS), likewise;
  cpu_step_costs    one n-gram step and one scheduler call, on trees grown from a real prompt;
  CostModel         all four for one pair on one device: what trajectories are priced with, what a scheduler
                    is fitted for (`device_costs` caches it under `profile_key`);
  choose_budget     the tree budget a fixed schedule verifies: a bigger tree is accepted deeper but costs more
                    to verify, and where that trade lands depends on the device (on a GPU a 64-node pass
                    costs about what a 1-token pass does; on a CPU several times more). `--budget auto`
                    observes acceptance at every candidate budget during a warm-up decode at the largest one
                    (a smaller, pruned tree's accepted length follows from the target's greedy continuation)
                    and picks the budget with the most expected tokens per second.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from ..files import write_json
from ..models import compact, kernels
from ..models.hf import CausalLM, compact_cache
from ..models.precision import cpu_model
from .config import TreeConfig
from .ngram import NGramDrafter
from .schedule import NUM_SCHEDULES, SCHEDULES
from .scheduler import LearnedScheduler, SchedulerInfo, SchedulerMLP
from .signals import MAX_LAYERS, READ_BLOCK, Timings, compute_signals, context_signals
from .stats import synchronize
from .tree import ORIGIN_NGRAM, DraftTree, Proposal, next_frontier
from .verify import tree_attention

CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # 1 = the root only: plain decoding
PROFILE_PAST = 256  # cached tokens behind the profiled block: a typical prompt length
MAX_COST_RATIO = 4.0
# A cached cost this many times a fresh pass's (at check_sizes), and at least STALE_MIN_MS more, was measured on a
# busy machine (another process's threads only ever slow a pass down): the profile is measured again. A fresh
# pass slower than the cache means the machine is busy now, and the cache is kept. A profile inflated by 17% at
# one node and 40% at 12 (121 and 221 ms against 103 and 158 measured later, 1.5B in bf16 on a Zen 4 EPYC)
# fitted budget 4 where the box's own costs fit 12; a sane profile is within a few percent of a fresh pass.
# The floor keeps sub-millisecond passes (tiny models) from being measured again for timer noise.
STALE_RATIO = 1.15
STALE_MIN_MS = 5.0
MIDDLE_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)  # forward sizes the middle drafter's cost is measured at
DRAFT_TOPK = 10  # children a drafting pass ranks (the published K)
PROFILE_SWEEPS = 2  # sweeps over the sizes a profile takes the best of


def forward_ms(lm: CausalLM, block: int, past: int = PROFILE_PAST, repeats: int = 3, cache=None,
               drafting: bool = False) -> float:
    """Best time of one forward over a `block`-node tree (a chain) on a `past`-token cache; `cache`, when
    given, already holds those `past` tokens and is restored after each timed pass. `drafting`: the pass
    ends as a drafter's does (top-k over the draft vocabulary, CausalLM.top_logprobs), not with the full
    logits verification takes."""
    tree = DraftTree(0)
    n = block - 1
    if n:
        chain = np.concatenate([[0], 1 + np.arange(n - 1)]).astype(np.int64)
        tree.graft(Proposal(1, chain, np.arange(1, n + 1) % lm.vocab_size, np.zeros(n), ORIGIN_NGRAM), 1)
    attend, positions = tree_attention(tree, past)
    ids = torch.from_numpy(tree.token_list().copy())
    cache = prefilled(lm, past) if cache is None else cache
    times = []
    for _ in range(repeats + 1):
        synchronize(lm.device)  # the cache's last compaction (or fill) is not this pass's work
        t = time.perf_counter()
        h = lm.hidden(cache, ids, positions, attend)
        lm.top_logprobs(h, DRAFT_TOPK) if drafting else lm.logits(h)
        synchronize(lm.device)
        times.append((time.perf_counter() - t) * 1e3)
        compact_cache(cache, past, torch.zeros(0, dtype=torch.int64))
    # The best repeat, not the median: another process's burst only ever slows a pass down, and a profile
    # measured on a busy machine is cached for good.
    return min(times[1:])


def prefilled(lm: CausalLM, past: int = PROFILE_PAST):
    """A cache holding `past` tokens, for forward_ms to time blocks on (it restores the cache after each)."""
    cache = lm.new_cache()
    lm.hidden(cache, torch.zeros(past, dtype=torch.int64), torch.arange(past))
    return cache


# Cached profiles (file, contents) this process has checked and kept: the main job reads one profile from
# several places (the device fit's costs, the evaluation's budgets), and one check each is enough.
_CHECKED: set[tuple[str, tuple]] = set()


def measured_when_busy(lm: CausalLM, cached: dict[int, float], path: Path, drafting: bool = False) -> bool:
    """Whether the cached profile `cached` (ms by size) was measured while something else used the device:
    at one of its check_sizes it is `slower_than_now`. Says so when it was. Checked once per process and contents."""
    key = (str(path), tuple(sorted(cached.items())))
    if key in _CHECKED:
        return False
    cache = prefilled(lm)
    for block in check_sizes(cached):
        fresh = forward_ms(lm, block, repeats=2, cache=cache, drafting=drafting)
        if slower_than_now(cached[block], fresh):
            print(f"treegraft: {path.name}: a {block}-token pass measured {cached[block]:.0f} ms there and "
                  f"{fresh:.0f} ms now: it was measured on a busy machine, measuring again", file=sys.stderr)
            return True
    _CHECKED.add(key)
    return False


def slower_than_now(cached_ms: float, fresh_ms: float) -> bool:
    """Whether a cached pass time was measured busier than a fresh one: STALE_RATIO times it and STALE_MIN_MS more."""
    return cached_ms > STALE_RATIO * fresh_ms and cached_ms - fresh_ms > STALE_MIN_MS


def check_sizes(profile: dict[int, float]) -> tuple[int, ...]:
    """The sizes a cached profile is checked at: the smallest and those that rounds use (8 and 16, else the
    largest). A burst of another process's work can hit any part of a sweep, not only its start, and the
    fitted budget follows how the cost grows with the tree, not its level alone."""
    sizes = sorted(profile)
    used = [s for s in (8, 16) if s in profile] or [sizes[-1]]
    return tuple(dict.fromkeys((sizes[0], *used)))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    # Costs differ between processors of one architecture (AMX or not, cache sizes): the model name is part of it.
    model = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model()).strip("-")
    return f"cpu-{model}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def model_key(lm: CausalLM, source: str) -> str:
    name = Path(source.rstrip("/")).name or "model"
    # Compact, packed or int8 linears and a drafting head over fewer ids cost differently: a profile is per kernel path
    # and draft vocabulary too.
    vocab = "" if lm.draft_vocab is None else f"-v{len(lm.draft_vocab)}"
    kernel = f"-compact{compact.KERNEL_VERSION}" if lm.compact else ""  # and per revision of the compact kernel
    pad = kernels.padding_of(lm.model) if lm.packed else 1  # and per row padding of its small products
    packed = f"-packed{f'-pad{pad}' if pad > 1 else ''}" if lm.packed else ""
    return (f"{name}-{lm.num_params}-{str(lm.dtype).removeprefix('torch.')}{kernel}"
            f"{packed}{'-int8' if lm.quantized else ''}{vocab}")


def latency_profile(lm: CausalLM, source: str, cache_dir: Path) -> dict[int, float]:
    """Verification ms per candidate tree size, measured once per (model, device) and cached as JSON.

    Sizes are measured smallest first and the profile stops at the first one costing more than
    MAX_COST_RATIO single-node passes: such a tree would need that many times the acceptance to pay."""
    path = cache_dir / "profiles" / f"{model_key(lm, source)}--{device_name(lm.device)}.json"
    if path.is_file():
        cached = {int(k): v for k, v in json.loads(path.read_text())["verify_ms"].items()}
        if not measured_when_busy(lm, cached, path):
            return cached
    cache = prefilled(lm)
    profile = swept_profile(lambda b: forward_ms(lm, b, repeats=2, cache=cache), CANDIDATES,
                            "profiling verification latency", stop_ratio=MAX_COST_RATIO)
    write_json(path, {"model": source, "device": device_name(lm.device), "past": PROFILE_PAST,
                      "verify_ms": {str(k): v for k, v in profile.items()}})
    return profile


def swept_profile(measure: Callable[[int], float], sizes: tuple[int, ...], desc: str,
                  stop_ratio: float | None = None) -> dict[int, float]:
    """ms by size: the best of PROFILE_SWEEPS sweeps over `sizes`, smallest first, so that a burst of another
    process's work during one sweep does not stay in the profile (it only ever slows a pass down). With
    `stop_ratio`, a sweep stops at the first size costing more than that many smallest-size passes, and the
    profile ends before it. A bigger block never costs less: a pass of fewer rows than the padded count runs
    as that count (kernels.row_padding), and any other dip is timing noise, so the lower envelope from above
    is taken."""
    best: dict[int, float] = {}
    with tqdm(total=PROFILE_SWEEPS * len(sizes), desc=desc, unit="pass", file=sys.stderr) as bar:
        for _ in range(PROFILE_SWEEPS):
            for i, b in enumerate(sizes):
                best[b] = min(best.get(b, float("inf")), measure(b))
                bar.update()
                if stop_ratio is not None and best[b] > stop_ratio * best[sizes[0]]:
                    bar.total -= len(sizes) - i - 1  # the sizes past it are not measured in this sweep
                    bar.refresh()
                    break
    kept = [b for b in sizes if b in best]
    if stop_ratio is not None:
        over = [b for b in kept if best[b] > stop_ratio * best[sizes[0]]]
        kept = [b for b in kept if not over or b < over[0]]
    profile, floor = {}, float("inf")
    for b in reversed(kept):
        floor = min(floor, best[b])
        profile[b] = floor
    return dict(sorted(profile.items()))


def choose_budget(verify_ms: dict[int, float], accepted_at: dict[int, list[int]], draft_ms: float) -> int:
    """The budget with the most expected tokens per round-second: mean accepted length at that budget
    over (drafting time per round + verification time at that budget)."""
    rate = {b: float(np.mean(accepted_at[b])) / (draft_ms + verify_ms[b]) for b in accepted_at if accepted_at[b]}
    if not rate:
        raise ValueError("no acceptance observed: run a warm-up decode with budget probes first")
    return max(rate, key=lambda b: (rate[b], -b))


# -- the cost model of a pair on a device -----------------------------------------------------------------------------------

def interp(table: dict[int, float], x: float) -> float:
    """Piecewise-linear in x through the measured points, extended linearly past the last two."""
    xs = np.array(sorted(table), np.float64)
    ys = np.array([table[int(k)] for k in xs], np.float64)
    if len(xs) == 1 or x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


@dataclass(frozen=True)
class CostModel:
    """Measured costs on one device, in milliseconds."""

    device: str
    ngram_ms: float  # one n-gram drafting step
    scheduler_ms: float  # one scheduler call (signals + decision), paid before every layer
    middle_ms: dict[int, float]  # tokens in one middle-drafter forward -> ms
    verify_ms: dict[int, float]  # pruned tree size -> ms of one target verification

    def middle(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else interp(self.middle_ms, tokens)

    def verify(self, size: int) -> float:
        return interp(self.verify_ms, size)

    def timings(self, budget: int) -> Timings:
        """T_tgt and T_mid as the engine measures them (one forward over a budget-sized block)."""
        return Timings(self.verify(budget), self.middle(budget), self.middle(READ_BLOCK) / READ_BLOCK)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["middle_ms"] = {str(k): v for k, v in self.middle_ms.items()}
        d["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        try:
            return cls(str(d["device"]), float(d["ngram_ms"]), float(d["scheduler_ms"]),
                       {int(k): float(v) for k, v in d["middle_ms"].items()},
                       {int(k): float(v) for k, v in d["verify_ms"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a cost model ({type(e).__name__}: {e}); expected the keys device, ngram_ms, "
                             "scheduler_ms, middle_ms, verify_ms as `treegraft collect` writes them") from e

    def schedule_latency(self, forwards: np.ndarray, sizes: np.ndarray, catch_up: int = 1) -> np.ndarray:
        """Latency (ms) of each complete schedule. forwards: [63, 2] middle forward sizes of the step into
        each prefix state (0 = none); sizes: [B, 32] pruned tree sizes -> [B, 32].

        `catch_up`: tokens the middle drafter has not seen when the round starts (the root and what the
        last round accepted before it). Trajectories run them before the round; at run time the first call
        of a round runs them in its first forward, so that is where they are priced."""
        draft = np.zeros(NUM_SCHEDULES)
        for s in range(NUM_SCHEDULES):
            state, called = 0, False
            for bit in SCHEDULES[s]:
                state = 2 * state + 1 + int(bit)
                if not bit:
                    draft[s] += self.ngram_ms
                    continue
                a, b = (int(x) for x in forwards[state])
                if not called:  # the catch-up joins the first forward that runs
                    a, b = (a + catch_up, b) if a else (0, b + catch_up)
                    called = True
                draft[s] += self.middle(a) + self.middle(b)
        draft += MAX_LAYERS * self.scheduler_ms
        verify = np.vectorize(self.verify, otypes=[np.float64])(sizes)
        return draft[None, :] + verify


def middle_profile(lm: CausalLM, source: str, cache_dir: Path) -> dict[int, float]:
    """ms of one middle-drafter forward per block size, measured once per (model, device), cached."""
    path = cache_dir / "profiles" / f"{model_key(lm, source)}--{device_name(lm.device)}--middle.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        cached = {int(k): v for k, v in saved["forward_ms"].items()}
        # Profiles from before drafting passes were timed as such ended with the full head: measure again.
        if saved.get("pass") == "drafting" and not measured_when_busy(lm, cached, path, drafting=True):
            return cached
    cache = prefilled(lm)
    profile = swept_profile(lambda b: forward_ms(lm, b, repeats=2, cache=cache, drafting=True), MIDDLE_BLOCKS,
                            "profiling middle-drafter latency")
    write_json(path, {"model": source, "device": device_name(lm.device), "pass": "drafting",
                      "forward_ms": {str(k): v for k, v in profile.items()}})
    return profile


def cpu_step_costs(context: list[int], cfg: TreeConfig, repeats: int = 200) -> tuple[float, float]:
    """Median ms of (one n-gram step, one scheduler call) over trees grown on `context` (a real prompt)."""
    ngram = NGramDrafter.from_config(cfg)
    ngram.start(list(context), None)
    policy = LearnedScheduler(SchedulerMLP(), SchedulerInfo(("", "")))
    ctx = context_signals(len(context), Timings(1.0, 1.0))
    step_ms, sched_ms = [], []
    for _ in range(max(1, repeats // cfg.depth)):
        tree, frontier, calls = DraftTree(int(context[-1])), np.zeros(1, np.int64), []
        for layer in range(cfg.depth):
            t0 = time.perf_counter()
            sig = compute_signals(tree, frontier, layer, calls, cfg.depth, cfg.lookback, cfg.top_k, ctx)
            policy.decide(sig, layer)
            t1 = time.perf_counter()
            proposal = ngram.step(tree, frontier, layer + 1)
            t2 = time.perf_counter()
            ids = tree.graft(proposal, layer + 1)
            if len(proposal):
                frontier = next_frontier(tree, proposal, ids, cfg.top_k)
            calls.append(False)
            sched_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
    return statistics.median(step_ms), statistics.median(sched_ms)


def measure_costs(target: CausalLM, target_source: str, middle: CausalLM, middle_source: str, cache_dir: Path,
                  context: list[int], cfg: TreeConfig) -> CostModel:
    verify = latency_profile(target, target_source, cache_dir)
    mid = middle_profile(middle, middle_source, cache_dir)
    ngram_ms, sched_ms = cpu_step_costs(context, cfg)
    return CostModel(device_name(target.device), ngram_ms, sched_ms, mid, verify)


def profile_key(target: CausalLM, target_source: str, middle: CausalLM, middle_source: str) -> str:
    """(model pair with its dtype, device with its threads) as one file-name-safe string."""
    return f"{model_key(target, target_source)}+{model_key(middle, middle_source)}--{device_name(target.device)}"


def device_costs(target: CausalLM, target_source: str, middle: CausalLM, middle_source: str, cache_dir: Path,
                 context: list[int], tree: TreeConfig) -> CostModel:
    """The cost profile of this pair on this device, measured on first use and cached as JSON."""
    key = profile_key(target, target_source, middle, middle_source)
    path = cache_dir / "profiles" / f"{key}--costs.json"
    if path.is_file():
        cost = CostModel.from_dict(json.loads(path.read_text()))
        # Its model costs must be those of the (self-checking) per-model profiles: one re-measured after a
        # busy first measurement makes this one stale too.
        if (cost.verify_ms == latency_profile(target, target_source, cache_dir)
                and cost.middle_ms == middle_profile(middle, middle_source, cache_dir)):
            return cost
    cost = measure_costs(target, target_source, middle, middle_source, cache_dir, context, tree)
    write_json(path, cost.to_dict())
    return cost
