"""Per-request statistics and the timer that fills them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

PHASES = ("prefill", "ngram", "middle", "scheduler", "verify", "other")


@dataclass
class RequestStats:
    """rounds = target verification passes; accepted = tokens gained per round (bonus included);
    tree_sizes = nodes verified per round (root included); middle_calls = middle calls per round;
    seconds = wall time per phase; wall_s = the whole request; deep_expected, deep_accepted = the verified nodes of
    deepening layers (engine.deepening): their drafter path probabilities summed, and how many the target accepted."""

    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    middle_calls: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_s: float = 0.0
    accepted_at_budget: dict[int, list[int]] = field(default_factory=dict)
    deep_expected: float = 0.0
    deep_accepted: int = 0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def middle_calls_per_round(self) -> float:
        return sum(self.middle_calls) / len(self.middle_calls) if self.middle_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(mean_accepted=self.mean_accepted, middle_calls_per_round=self.middle_calls_per_round,
                   tokens_per_s=self.tokens_per_s)
        return out


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA `device` (kernels run asynchronously); nothing to wait for elsewhere."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates wall time into RequestStats.seconds; whatever no phase claims is `other`.

    On a CUDA `device` it synchronises the device where it measures (at the start, at every phase boundary
    and at the end): kernels run asynchronously, so without that a phase would be charged with the work
    the one before it queued, or end before its own work did."""

    def __init__(self, stats: RequestStats, device: torch.device | None = None):
        self.stats = stats
        self.device = device
        synchronize(device)
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.stats.seconds[name] += time.perf_counter() - t

    def finish(self) -> None:
        synchronize(self.device)
        self.stats.wall_s = time.perf_counter() - self._t0
        claimed = sum(v for k, v in self.stats.seconds.items() if k != "other")
        self.stats.seconds["other"] = max(0.0, self.stats.wall_s - claimed)
