"""Other inputs than the recorded signals for the value planner, to ask whether they predict a round better:
rounds whose device-constant signals (the two timings, and with them their log ratio) are replaced by the
previous round's accepted lengths, or by what the round's root says before any drafting. `python -m
jobs.bench.data --history / --root-signals` fits planners on them."""

from __future__ import annotations

import numpy as np

from .collect import Trajectories
from .value import Rounds

MATCH_CAP = 32  # longest suffix match looked for, in tokens


def with_history(traj: Trajectories, rounds: Rounds) -> Rounds:
    """`rounds` with signals 1 and 2 (t_tgt_ms, t_mid_ms) replaced by log1p of the previous round's accepted
    length under the collection's behaviour schedule and under all-small (0 at a prompt's first round)."""
    order = traj.table.column("round").to_numpy()
    behaviour = traj.table.column("behaviour").to_numpy().astype(np.int64)
    prev = np.zeros((len(order), 2))
    later = np.flatnonzero(order > 0)  # rows are stored in round order within a prompt
    if np.any(order[later - 1] != order[later] - 1):
        raise ValueError("rounds are not stored in order within each prompt: the previous round is not the row before")
    prev[later, 0] = rounds.accepted[later - 1, behaviour[later - 1]]
    prev[later, 1] = rounds.accepted[later - 1, 0]
    signals = rounds.signals.copy()
    signals[:, :, 1:3] = np.log1p(prev)[:, None, :]
    return type(rounds)(signals, rounds.accepted, rounds.latency_ms, rounds.prompt_ids, rounds.benchmarks)


def longest_match(context: list[int], cap: int = MATCH_CAP) -> int:
    """Length of the longest suffix of `context` that also occurs earlier in it (up to `cap`)."""
    n, best = len(context), 0
    for length in range(1, min(cap, n - 1) + 1):
        suffix = context[n - length :]
        if not any(context[i : i + length] == suffix for i in range(n - length)):
            break
        best = length
    return best


def with_root(rounds: Rounds, features: np.ndarray) -> Rounds:
    """`rounds` with signals 1-3 (the device-constant timings) replaced by `features` ([R, 3])."""
    signals = rounds.signals.copy()
    signals[:, :, 1:4] = features[:, None, :].astype(np.float32)
    return type(rounds)(signals, rounds.accepted, rounds.latency_ms, rounds.prompt_ids, rounds.benchmarks)

