"""One speculative request's life: the state its rounds share, how it starts and how it ends.

`start_request` sets a request up (its round settings, stats, context signals, timer), runs the target's
prefill and hands it to the request's drafters; `finish_request` ends it (drafters released, round counts
and phase times closed, tokens cut as plain decoding stops). The rounds in between are `engine.speculate`'s.
The single-process `engine.Decoder` and the Ray coordinator (actors/coordinator.py) both go through here;
what differs between them is only where the prefill runs and which drafters a request gets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .config import TreeConfig
from .drafter import Drafter
from .ngram import PrefillCache
from .schedule import SchedulePolicy
from .signals import Timings, context_signals
from .sizing import CopyReach, Reading, TreeSizer
from .stats import PhaseTimer, RequestStats

# Pseudo-tokens at face value in the deepening calibration: a few verified deepening nodes already move it.
DEEPEN_PRIOR = 2.0
DEEPEN_MIN_CALIBRATION = 0.05


@dataclass
class Generation:
    tokens: list[int]  # generated ids only
    stats: RequestStats


class DeepeningCalibration:
    """How far the middle drafter's confidence past the depth holds, across an engine's requests: what the
    verified nodes of deepening layers were expected to give (their drafter path probabilities) against what the
    target accepted of them. A drafter's probabilities run high (it is sure of paths the target leaves), so
    deepening weighs its gain at this ratio (round_config prices a middle call the more, the lower it is)."""

    def __init__(self):
        self.expected = 0.0
        self.accepted = 0.0

    def observe(self, stats: RequestStats) -> None:
        self.expected += stats.deep_expected
        self.accepted += stats.deep_accepted

    @property
    def ratio(self) -> float:
        return max(DEEPEN_MIN_CALIBRATION, (self.accepted + DEEPEN_PRIOR) / (self.expected + DEEPEN_PRIOR))


@dataclass
class Request:
    """A speculative request from its prefill to its result: what every round reads and writes.

    `cfg` is the request's own tree settings (round_config: call budget and deepening cost filled in);
    `first` the token the prefill gave (None when no token was asked for: then there are no drafters either);
    `sizer`, `probe_budgets`, `reach`: as `engine.Decoder` takes them; `calibration`: the engine's deepening
    calibration, which learns from this request as it finishes."""

    prompt: list[int]
    max_new: int
    eos: set[int]
    cfg: TreeConfig
    policy: SchedulePolicy
    stats: RequestStats
    timer: PhaseTimer
    context: np.ndarray | None  # [4] context signals; set when the policy reads signals
    first: int | None = None
    ngram: Drafter | None = None
    middle: Drafter | None = None
    sizer: TreeSizer | None = None
    probe_budgets: tuple[int, ...] = ()
    calibration: DeepeningCalibration | None = None
    reach: CopyReach | None = None

    @property
    def drafters(self) -> list[Drafter]:
        return [d for d in (self.ngram, self.middle) if d is not None]

    @property
    def middle_fallback_steps(self) -> int:
        """Steps n-gram drafting answered in the middle drafter's place so far (0 without a middle drafter)."""
        return 0 if self.middle is None else self.middle.fallback_steps

    def reading(self, token_ms: float) -> Reading:
        """Where the request stands before a round, for pricing the middle drafter's read of the context it has
        not seen (the prompt as far as its window reaches, then every token so far); `token_ms`: a token's read."""
        done = 1 + sum(self.stats.accepted)
        return Reading(self.cfg.middle_reads(len(self.prompt)) + done, self.max_new - done, token_ms)

    def release(self) -> None:
        """Every drafter frees what it holds for this request (its state on an actor)."""
        for d in self.drafters:
            d.release()


def start_request(
    prompt: list[int], max_new: int, eos: set[int], policy: SchedulePolicy, cfg: TreeConfig, *,
    timings: Callable[[], Timings], prefill: Callable[[list[int]], tuple[int, PrefillCache | None]],
    drafters: Callable[[Request], tuple[Drafter, Drafter | None]],
    calibration: DeepeningCalibration | None = None, device: torch.device | None = None,
    sizer: TreeSizer | None = None, probe_budgets: tuple[int, ...] = (), reach: CopyReach | None = None,
) -> Request:
    """Set a request up under the engine's settings `cfg` and `timings()` (read only where the policy needs
    them) and, when it asks for tokens, run `prefill(prompt) -> (first token, prefill cache)` and give its
    result to the drafters `drafters(request)` makes (n-gram, middle or None): they read the prompt and the
    prefill cache, then accept the first token. `device`: the target's, when in this process (PhaseTimer)."""
    cfg = round_config(cfg, policy, timings, calibration)
    stats = RequestStats(policy.name, prompt_tokens=len(prompt))
    context = context_signals(len(prompt), timings()) if policy.needs_signals else None
    req = Request(prompt, max_new, eos, cfg, policy, stats, PhaseTimer(stats, device), context, sizer=sizer,
                  probe_budgets=probe_budgets, calibration=calibration, reach=reach)
    if max_new:
        with req.timer.phase("prefill"):
            req.first, cache = prefill(prompt)
        req.ngram, req.middle = drafters(req)
        try:
            for d in req.drafters:
                d.start(prompt, cache)
                d.accept([], [req.first])
        except BaseException:
            req.release()
            raise
    return req


def finish_request(req: Request, out: list[int]) -> Generation:
    """End `req` with the tokens its rounds gave (`out`, the first one included; [] without rounds): its
    drafters are released, the deepening calibration learns from it, and its result is closed (`finish`)."""
    req.release()
    if req.calibration is not None:
        req.calibration.observe(req.stats)
    return finish(out, req.stats, req.timer, req.max_new, req.eos)


def finish(out: list[int], stats: RequestStats, timer: PhaseTimer, max_new: int, eos: set[int]) -> Generation:
    """The request's tokens cut as plain decoding stops, with its round counts and phase times closed."""
    out = truncate(out, max_new, eos)
    stats.rounds = len(stats.accepted)
    stats.new_tokens = len(out)
    timer.finish()
    return Generation(out, stats)


def default_call_budget(timings: Timings) -> int:
    """b0 = floor(T_tgt / T_mid): middle calls that fit in one verification's time."""
    return max(0, int(timings.t_tgt_ms // timings.t_mid_ms))


def round_config(cfg: TreeConfig, policy: SchedulePolicy, timings: Callable[[], Timings],
                 calibration: DeepeningCalibration | None = None) -> TreeConfig:
    """The tree settings a request runs with: a policy marked `budgeted` (the learned scheduler, the value
    planner) gets a per-round call budget unless the config sets one: the cap it was fitted with at this
    budget (`policy.call_cap_at`), else b0 = floor(T_tgt / T_mid) from this engine's timings. A policy that
    may call the middle drafter deepens its rounds (cfg.deepen) at the cost of a middle call against a target
    pass measured here, over how far the middle drafter's confidence past the depth has held (`calibration`)."""
    if cfg.deepen and cfg.deepen_cost is None and may_call_middle(policy):
        t = timings()
        ratio = calibration.ratio if calibration else 1.0
        cfg = dataclasses.replace(cfg, deepen_cost=t.t_mid_ms / t.t_tgt_ms / ratio,
                                  deepen_row_cost=t.read_ms / t.t_tgt_ms / ratio)
    if cfg.call_budget is not None or not getattr(policy, "budgeted", False):
        return cfg
    fitted = policy.call_cap_at(cfg.budget) if hasattr(policy, "call_cap_at") else None
    return dataclasses.replace(cfg, call_budget=fitted if fitted is not None else default_call_budget(timings()))


def may_call_middle(policy: SchedulePolicy) -> bool:
    """False only for a fixed schedule without a middle layer: then the middle drafter can stay idle."""
    return "1" in getattr(policy, "pattern", "1")


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """`tokens` up to and including the first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def truncate(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Cut at max_new tokens and after the first end-of-sequence token, as plain decoding stops."""
    return until_eos(tokens[:max_new], eos)
