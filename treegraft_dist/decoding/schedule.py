"""Schedule policies: before each drafting layer, call the middle drafter or take an n-gram step.

A policy is any object with `needs_signals` and `decide(signals, layer) -> bool`; a plain callable
`f(signals, layer) -> bool` is wrapped by `as_policy`. Fixed schedules are bit patterns: character l of
the pattern (0-based, left to right) is 1 when layer l calls the middle drafter.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from .signals import MAX_LAYERS, SIGNAL_NAMES

NAMED_SCHEDULES = {"all-small": "0", "all-mid": "1"}
# Every schedule of a round: [32, 5] int8, bit l of schedule s = 1 iff layer l calls the middle drafter
# (layer 0 the most significant bit: s = 0 is all-small, s = 31 all-mid).
SCHEDULES = np.array(list(itertools.product((0, 1), repeat=MAX_LAYERS)), np.int8)
NUM_SCHEDULES = len(SCHEDULES)  # 32
_CALLED = slice(SIGNAL_NAMES.index("called_0"), SIGNAL_NAMES.index("called_0") + MAX_LAYERS)
_FRONTIER_DEPTH = SIGNAL_NAMES.index("frontier_depth")


class SchedulePolicy(Protocol):
    """`decide` says whether a round's 0-based `layer` calls the middle drafter. A policy that marks itself
    `stateless = True` (its decision depends on (signals, layer) only) may have its layers decided in two
    places, as the distributed engine does (the coordinator and the n-gram actor); any other is asked in one."""

    name: str
    needs_signals: bool

    def decide(self, signals: np.ndarray | None, layer: int) -> bool: ...  # signals: [17] float32 (compute_signals)


@dataclass(frozen=True)
class FixedSchedule:
    pattern: str
    needs_signals: bool = False
    stateless = True

    @property
    def name(self) -> str:
        return self.pattern

    def decide(self, signals, layer: int) -> bool:
        return self.pattern[layer] == "1"


@dataclass(frozen=True)
class CallablePolicy:
    fn: Callable[[np.ndarray, int], bool]  # (signals [17], layer) -> call the middle drafter
    name: str = "callable"
    needs_signals: bool = True

    def decide(self, signals, layer: int) -> bool:
        return bool(self.fn(signals, layer))


@dataclass(frozen=True)
class ShallowTreeHeuristic:
    """The `treegraft` method for a pair without a scheduler artifact: take an n-gram step first, then
    call the middle drafter once, at the first layer where the n-gram tree is still shallow (mean
    frontier depth below `min_depth`: the context offered no long match to follow)."""

    min_depth: float = 2.0
    name: str = "treegraft"
    needs_signals: bool = True
    stateless = True

    def decide(self, signals, layer: int) -> bool:
        if layer == 0 or signals[_CALLED].any():
            return False
        return bool(signals[_FRONTIER_DEPTH] < self.min_depth)


class ReplaySchedule:
    """Given schedules round by round (e.g. the best ones in hindsight); all-small after the last. Counts
    rounds itself, so use one instance per request."""

    needs_signals = False

    def __init__(self, patterns: list[str], name: str = "replay"):
        self.patterns = list(patterns)
        self.name = name
        self.round = -1

    def decide(self, signals, layer: int) -> bool:
        if layer == 0:
            self.round += 1
        return self.round < len(self.patterns) and self.patterns[self.round][layer] == "1"


def fixed_schedule(method: str, depth: int) -> FixedSchedule:
    """`all-small`, `all-mid` or a `depth`-bit pattern such as 01001."""
    if method in NAMED_SCHEDULES:
        return FixedSchedule(NAMED_SCHEDULES[method] * depth)
    if not re.fullmatch(r"[01]+", method) or len(method) != depth:
        raise ValueError(
            f"schedule {method!r} is not valid: use all-small, all-mid or a {depth}-character pattern of "
            f"0 (n-gram step) and 1 (middle drafter), one character per layer, e.g. {('01001' * depth)[:depth]}"
        )
    return FixedSchedule(method)


def as_policy(policy) -> SchedulePolicy:
    if hasattr(policy, "decide"):
        return policy
    if callable(policy):
        return CallablePolicy(policy)
    raise TypeError(f"a schedule policy must have .decide(signals, layer) or be callable, got {type(policy)}")
