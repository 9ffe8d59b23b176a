"""An evaluation's wall-clock bound (`treegraft eval --time-limit`): what a run leaves out to finish in time.

Prompts run round-robin over the benchmarks, every method on every prompt. From the second round on, before
each prompt, the time the remaining prompts need is projected from what each method took on the same
benchmark in earlier rounds. If that passes the bound, methods are left out of the remaining prompts, the last
listed first, from the last prompt that leaves the rest enough time; `ar` (the reference), `treegraft` and the
peers are never left out. If those alone cannot finish every prompt, they go on while the next prompt fits,
and the run stops before the first that does not: the prompts run go round-robin, so the benchmarks differ by
at most one prompt. Either is said when it happens and written under the summary table; a run that fits leaves
out nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

from ..decoding.engine import AR_METHOD
from .methods import TREEGRAFT
from .peers import PEER_METHODS

KEPT = (AR_METHOD, TREEGRAFT) + PEER_METHODS  # never left out: the reference, the product, the peers
RESERVE_S = 15.0  # after the last prompt: the summary, the chart, the exit


def parse_seconds(value: str) -> float:
    """'900', '900s', '15m' or '1h' -> seconds; anything else a ValueError that says what is accepted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", value or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--time-limit must be a positive number of seconds or minutes (900, 900s, 15m, 1h), "
                         f"got {value!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class Plan:
    """What the run leaves out from here on: methods (in the order dropped) and whether it stops now."""

    drop: list[str] = field(default_factory=list)
    stop: bool = False
    need_s: float = 0.0  # the projection with every method still running
    left_s: float = 0.0


def project(remaining: list[str], methods: list[str], seconds: dict[tuple[str, str], list[float]]) -> float:
    """Seconds the prompts of benchmarks `remaining` (one entry per prompt) need with `methods`: each method's
    mean on that benchmark so far, or its mean over every benchmark where it has not run that one."""
    total = 0.0
    for m in methods:
        everywhere = [s for (mm, _), xs in seconds.items() if mm == m for s in xs]
        if not everywhere:
            continue
        overall = sum(everywhere) / len(everywhere)
        for b in remaining:
            xs = seconds.get((m, b))
            total += sum(xs) / len(xs) if xs else overall
    return total


def plan(left_s: float, remaining: list[str], methods: list[str], seconds: dict[tuple[str, str], list[float]]) -> Plan:
    """What to leave out of the next prompt so the remaining prompts (their benchmarks) fit `left_s`: droppable
    methods last-listed first until they fit, but none while the next prompt with every method and the rest
    without those still fit (a method covers as many prompts as the time allows); if the kept methods alone
    cannot finish them all, they run the next prompt if it fits and the run stops when it does not."""
    out = Plan(need_s=project(remaining, methods, seconds), left_s=left_s)
    running = list(methods)
    for m in reversed(methods):
        if project(remaining, running, seconds) <= left_s:
            break
        if m not in KEPT:
            running.remove(m)
            out.drop.append(m)
    if project(remaining, running, seconds) > left_s:
        out.stop = project(remaining[:1], running, seconds) > left_s
        return out
    if out.drop and project(remaining[:1], methods, seconds) + project(remaining[1:], running, seconds) <= left_s:
        out.drop = []  # this prompt still fits with every method: leave them out from a later one
    return out


class TimeLimit:
    """The bound of one run, counted from `started` (time.monotonic() when the command began): loading the
    models, measuring the device and fitting the scheduler count against it too."""

    def __init__(self, seconds: float, started: float | None = None, reserve_s: float = RESERVE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.seconds, self.reserve_s, self.clock = seconds, reserve_s, clock
        self.started = clock() if started is None else started

    def left(self) -> float:
        return self.seconds - self.reserve_s - (self.clock() - self.started)

    def describe(self) -> str:
        return f"{self.seconds / 60:g} min" if self.seconds >= 600 else f"{self.seconds:.0f} s"
