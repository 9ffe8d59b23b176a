"""`treegraft fit`: collected trajectories -> value heads per signal subset -> exact margins -> the
3,265-parameter scheduler, saved as one artifact.

Steps (all on rounds priced at one verification budget):
  budget     unless given, the recorded budget where value heads on all signals, followed greedily, decode
             the held-out prompts fastest (the budget a scheduler can make the most of on this device);
  call cap   b0 = floor(T_tgt / T_mid) at that budget: schedules with more middle calls are out of reach
             at run time, so they get 0 tokens/s in every max below;
  split      by prompt, MT-Bench never present (it is not collected);
  subsets    per candidate subset, the four value heads on the train prompts; each is scored on the
             held-out prompts by its heads' error and by the speed of the schedules its margins imply
             (follow margin > 0 from the first layer); the fastest wins, ties go to the lower error;
  distil     exact margins of the chosen heads at every train decision state (all suffixes enumerated),
             regressed by the online MLP from the state alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..decoding.costs import CostModel
from ..decoding.schedule import SCHEDULES
from ..decoding.scheduler import LearnedScheduler, SchedulerInfo
from . import value
from .artifact import save_artifact
from .collect import Trajectories
from .value import (
    CANDIDATE_SUBSETS,
    NUM_DECISION_STATES,
    Rounds,
    ValueHeads,
    feasible,
    fit_scheduler,
    fit_value_heads,
    fit_value_heads_each,
    split_rounds,
)

SPEED_TIE = 0.01  # subsets within 1% of the fastest count as tied; the lower held-out error wins
# Epochs of the value heads that only rank budgets: a quarter of a full fit ranks them alike and keeps a
# first-use fit for a new device (one scan over up to ten budgets) to a couple of minutes on a CPU.
BUDGET_SCAN_EPOCHS = 10


def call_cap(cost: CostModel, budget: int) -> int:
    t = cost.timings(budget)
    return max(0, math.floor(t.t_tgt_ms / t.t_mid_ms))


def schedules_from_margins(margins: np.ndarray, max_calls: int | None) -> np.ndarray:
    """[R, 31] margins -> [R] schedule index reached by calling iff margin > 0 (and calls remain)."""
    out = np.zeros(len(margins), np.int64)
    for r, m in enumerate(margins):
        state, calls = 0, 0
        while state < NUM_DECISION_STATES:
            call = m[state] > 0 and (max_calls is None or calls < max_calls)
            calls += call
            state = 2 * state + 1 + int(call)
        out[r] = state - NUM_DECISION_STATES
    return out


def speed(rounds: Rounds, schedules: np.ndarray) -> float:
    """Tokens per second of decoding every round with its given schedule (`schedules`: [R] indices): total
    accepted / total time."""
    idx = np.arange(len(rounds))
    return float(rounds.accepted[idx, schedules].sum() / (rounds.latency_ms[idx, schedules].sum() / 1e3))


def oracle_schedules(rounds: Rounds, max_calls: int | None) -> np.ndarray:  # [R]: each round's best feasible schedule
    tps = rounds.tokens_per_s() * feasible(max_calls)
    return np.argmax(tps, axis=1)


def reference_speeds(rounds: Rounds, max_calls: int | None) -> dict[str, float]:
    """Tokens/s of the capped oracle and of the two fixed endpoints on `rounds`."""
    return {"oracle": speed(rounds, oracle_schedules(rounds, max_calls)),
            "all-small": speed(rounds, np.zeros(len(rounds), np.int64)),
            "all-mid": speed(rounds, np.full(len(rounds), len(SCHEDULES) - 1))}


def speed_bound(rounds: Rounds, max_calls: int | None) -> float:
    """The most tokens/s that any choice of one feasible schedule per round reaches on `rounds`: total
    accepted over total time, maximised by Dinkelbach's iteration from the per-round oracle's choice (which
    maximises each round's own rate, not always the total's). No scheduler can beat it."""
    ok = feasible(max_calls)
    accepted, seconds = rounds.accepted[:, ok].astype(np.float64), rounds.latency_ms[:, ok] / 1e3
    idx = np.arange(len(rounds))
    rate = speed(rounds, oracle_schedules(rounds, max_calls))
    while True:
        pick = np.argmax(accepted - rate * seconds, axis=1)
        better = float(accepted[idx, pick].sum() / seconds[idx, pick].sum())
        if better <= rate:
            return rate
        rate = better


def budget_row(traj: Trajectories, budget: int, heldout_fraction: float, seed: int,
               value_fit: dict | None = None) -> dict[str, float]:
    """Held-out tokens/s (cost model) at one recorded budget of: the value heads on all 17 signals followed
    greedily (what a scheduler can reach there), the capped oracle, all-small and all-mid."""
    cap = call_cap(traj.cost, budget)
    train, held = split_rounds(traj.rounds(budget), heldout_fraction, seed)
    heads = fit_value_heads(train, CANDIDATE_SUBSETS["all"], seed=seed,
                            **{"epochs": BUDGET_SCAN_EPOCHS, **(value_fit or {})})
    return {"scheduled": speed(held, schedules_from_margins(heads.margins(held.signals, cap), cap)),
            **reference_speeds(held, cap)}


def budget_bound(traj: Trajectories, budget: int, heldout_fraction: float, seed: int) -> float:
    """`speed_bound` of the held-out rounds at `budget`: what budget_row's "scheduled" can at most reach."""
    return speed_bound(split_rounds(traj.rounds(budget), heldout_fraction, seed)[1], call_cap(traj.cost, budget))


def budget_speeds(traj: Trajectories, heldout_fraction: float, seed: int, value_fit: dict | None = None,
                  log=print, budgets: tuple[int, ...] | None = None) -> dict[int, dict[str, float]]:
    """budget_row per recorded budget (or per one of `budgets`)."""
    out = {}
    for b in budgets or traj.budgets:
        out[b] = budget_row(traj, b, heldout_fraction, seed, value_fit)
        log(f"  budget {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in out[b].items()) + " tok/s")
    return out


def choose_budget(speeds: dict[int, dict[str, float]]) -> int:
    """The budget where the scheduled decode is fastest on the held-out prompts (ties: the smaller)."""
    return max(speeds, key=lambda b: (speeds[b]["scheduled"], -b))


@dataclass
class FitReport:
    budget: int
    call_cap: int
    subset: str
    train_rounds: int
    heldout_rounds: int
    candidates: dict[str, dict]  # name -> {"error": mean held-out error, "speed": implied tok/s, heads errors}
    heldout_speed: dict[str, float]  # policy -> tokens/s on the held-out rounds under the cost model
    sign_agreement: float  # held-out: scheduler decision == oracle-margin sign
    by_budget: dict[int, dict[str, float]]  # budget_speeds, when the budget was chosen

    def budget_table(self) -> str:
        if not self.by_budget:
            return ""
        names = list(next(iter(self.by_budget.values())))
        lines = ["| budget | " + " | ".join(f"{n} tok/s" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
        for b, row in self.by_budget.items():
            mark = " (chosen)" if b == self.budget else ""
            lines.append(f"| {b}{mark} | " + " | ".join(f"{row[n]:.2f}" for n in names) + " |")
        return "\n".join(lines) + "\n\n"

    def table(self) -> str:
        lines = [self.budget_table() + f"budget {self.budget}, call cap b0 = {self.call_cap}; {self.train_rounds} train rounds, "
                 f"{self.heldout_rounds} held-out rounds", "",
                 "| signal subset | held-out error (value heads) | implied held-out tok/s | chosen |",
                 "|---|---|---|---|"]
        for name, c in self.candidates.items():
            lines.append(f"| {name} | {c['error']:.3f} | {c['speed']:.2f} | {'yes' if name == self.subset else ''} |")
        lines += ["", "| policy (held-out rounds, cost model) | tok/s | vs oracle |", "|---|---|---|"]
        top = self.heldout_speed["oracle"]
        for name, v in self.heldout_speed.items():
            lines.append(f"| {name} | {v:.2f} | {v / top:.1%} |")
        lines.append(f"\nscheduler decisions agreeing with the oracle margin's sign (held-out states): "
                     f"{self.sign_agreement:.1%}")
        return "\n".join(lines)


def fit(traj: Trajectories, out: str | Path, budget: int | None = None, heldout_fraction: float = 0.25,
        seed: int = 0, candidates: dict[str, tuple[str, ...]] = CANDIDATE_SUBSETS, value_fit: dict | None = None,
        scheduler_fit: dict | None = None, log=print, budgets: tuple[int, ...] | None = None,
        profile: dict | None = None) -> tuple[LearnedScheduler, ValueHeads, FitReport]:
    """`budgets`: the candidates when choosing the budget (default: every recorded one); `profile`: extra
    entries for the artifact's cost profile (e.g. the key of the device profile it is fitted for)."""
    by_budget = {}
    if budget is None:
        budgets = budgets or traj.budgets
        log(f"choosing the budget among {list(budgets)} (value heads on all signals, held-out prompts)")
        by_budget = budget_speeds(traj, heldout_fraction, seed, value_fit, log, budgets)
        budget = choose_budget(by_budget)
    cap = call_cap(traj.cost, budget)
    rounds = traj.rounds(budget)
    train, held = split_rounds(rounds, heldout_fraction, seed)
    if not len(train) or not len(held):
        raise ValueError(f"the split left {len(train)} train and {len(held)} held-out rounds: collect more "
                         f"prompts (there are {len(np.unique(rounds.prompt_ids))}) or change --heldout-fraction")
    log(f"budget {budget}, call cap {cap}: fitting value heads on {len(train)} rounds, "
        f"{len(candidates)} signal subsets")
    states = train.signals[:, :NUM_DECISION_STATES]
    # Subsets that leave the same signals once the constant ones are out have the same heads: fitted once.
    signals = {name: value.informative(subset, states) for name, subset in candidates.items()}
    distinct = list(dict.fromkeys(signals.values()))
    fitted = dict(zip(distinct, fit_value_heads_each(train, distinct, seed=seed, **(value_fit or {}))))
    scores = {}
    for key, heads in fitted.items():
        err = heads.heldout_error(held)
        implied = speed(held, schedules_from_margins(heads.margins(held.signals, cap), cap))
        scores[key] = {"error": err["mean"], "speed": implied, "heads": err}
    heads_by = {name: fitted[signals[name]] for name in candidates}
    scored = {name: scores[signals[name]] for name in candidates}
    for name, score in scored.items():
        log(f"  {name}: held-out error {score['error']:.3f}, implied {score['speed']:.2f} tok/s")
    fastest = max(s["speed"] for s in scored.values())
    best = min((n for n in candidates if scored[n]["speed"] >= (1 - SPEED_TIE) * fastest),
               key=lambda n: scored[n]["error"])
    heads = heads_by[best]
    margins = heads.margins(train.signals, cap).reshape(-1)
    model = fit_scheduler(train.decision_signals(), margins, candidates[best], seed, **(scheduler_fit or {}))
    with torch.no_grad():
        predicted = model(torch.from_numpy(held.decision_signals())).numpy().reshape(len(held), -1)
    oracle_m = value.oracle_margins(held.accepted, held.latency_ms, cap)
    agreement = float(np.mean((predicted > 0) == (oracle_m > 0)))
    ref = reference_speeds(held, cap)
    held_speed = {"oracle": ref["oracle"], "scheduler (distilled)": speed(held, schedules_from_margins(predicted, cap)),
                  "value planner": scored[best]["speed"], "all-small": ref["all-small"], "all-mid": ref["all-mid"]}
    report = FitReport(budget, cap, best, len(train), len(held), scored, held_speed, agreement, by_budget)
    info = SchedulerInfo(
        tuple(traj.manifest["pair"]),
        {**traj.manifest["cost_model"], **(profile or {}), "budget": budget, "call_cap": cap},
        {"train": sorted(set(train.prompt_ids.tolist())), "heldout": sorted(set(held.prompt_ids.tolist())),
         "benchmarks": sorted(set(rounds.benchmarks.tolist())), "held_out_benchmarks": ["mt_bench"],
         "seed": seed, "heldout_fraction": heldout_fraction},
        {"subset": best, "candidates": {n: {"error": s["error"], "speed": s["speed"]} for n, s in scored.items()},
         "heldout_speed": held_speed, "sign_agreement": agreement,
         "tree": traj.manifest["tree"], "max_new_tokens": traj.manifest["max_new_tokens"]},
    )
    scheduler = LearnedScheduler(model, info)
    save_artifact(out, scheduler, heads)
    return scheduler, heads, report


