"""Projected speedups: hardware-independent trajectories priced with a measured cost profile.

The trajectories (collect.py) record what every round's tree accepts under all 32 schedules at every
candidate budget, and the sizes of the forwards that built it; a cost profile records what each forward and
step costs on one device. `treegraft project` prices every recorded round with a profile and reports, per
benchmark, tokens per second and speedup over ar of

  ar         one single-node target pass per token (verify_ms[1]);
  all-small  the n-gram drafter at every layer, at the recorded budget fastest under this profile;
  all-mid    the middle drafter at every layer, likewise;
  treegraft  the scheduler fitted for this profile (fit.fit, as on a device's first use), at its budget and
             call cap b0, deciding on the recorded signals;
  oracle     the fastest schedule of every round in hindsight, at the scheduler's budget and call cap.

Every figure is projected from measured costs, not measured. It covers decoding only (no prefill) and
prices the forwards, n-gram steps and scheduler calls; per-round bookkeeping (grafting, pruning, KV
compaction, Python) is not in a profile. A round's acceptance is that of the recorded round, whose position
the reference reached along the best schedule. The scheduler is fitted on three quarters of the same prompts.
Shipped trajectories cover the held-in benchmarks only: MT-Bench never enters the offline stage.
`jobs/bench/check_projection.py` measures how far these projections are from a `treegraft eval` on one machine.

A profile file is either a cost model as `treegraft eval` caches it (<cache>/profiles/<key>--costs.json) or
jobs/gpu_check.py's profile.json: the measured pair's cost model with its metadata, and under "proxies" more
named cost models (e.g. a 70B-shaped target scaled from a few layers), each projected in its own section.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..decoding.costs import CostModel
from ..decoding.schedule import NUM_SCHEDULES, SCHEDULES
from ..decoding.scheduler import LearnedScheduler
from ..files import write_csv, write_text
from ..scheduling.collect import Trajectories
from ..scheduling.device import fit_for_device, measured_budgets, priced
from ..scheduling.fit import oracle_schedules, schedules_from_margins
from ..scheduling.value import Rounds
from .benchmarks import BENCHMARKS
from .summary import plot_speedups

LABEL = "projected from measured costs"
AR, ALL_SMALL, ALL_MID, TREEGRAFT, ORACLE = "ar", "all-small", "all-mid", "treegraft", "oracle"
METHODS = (AR, ALL_SMALL, ALL_MID, TREEGRAFT, ORACLE)
MEAN = "(mean)"
ALL_MID_SCHEDULE = NUM_SCHEDULES - 1
PROJECTED = ("tokens_per_s", "speedup")  # columns that are projections (prefixed so in the CSV)


@dataclass(frozen=True)
class Profile:
    """One named cost model of a profile file, with what the file says about it."""

    name: str
    cost: CostModel
    note: str = ""
    key: str | None = None  # the device profile key a real run of the pair there would have (scheduling/device.py)


def read_profiles(path: str | Path) -> list[Profile]:
    """The cost models of a profile file (see the module docstring); ValueError with what to give instead."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"profile {str(path)!r} does not exist: give jobs/gpu_check.py's profile.json or a cached "
                         "<cache>/profiles/*--costs.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"profile {str(path)!r} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {str(path)!r} holds {type(data).__name__}, not a JSON object")
    entries = {}
    if "verify_ms" in data:
        entries[data.get("name") or path.name.removesuffix(".json").removesuffix("--costs")] = data
    proxies = data.get("proxies", {})
    if not isinstance(proxies, dict):
        raise ValueError(f"profile {str(path)!r}: 'proxies' must map names to cost models")
    entries.update(proxies)
    if not entries:
        raise ValueError(f"profile {str(path)!r} holds no cost model (device, ngram_ms, scheduler_ms, middle_ms, "
                         "verify_ms) and no proxies: give jobs/gpu_check.py's profile.json or a cached "
                         "*--costs.json")
    out = []
    for name, entry in entries.items():
        try:
            cost = CostModel.from_dict(entry)
        except ValueError as e:
            raise ValueError(f"profile {str(path)!r}, {name}: {e}") from None
        if 1 not in cost.verify_ms or not cost.middle_ms:
            raise ValueError(f"profile {str(path)!r}, {name}: it needs verify_ms at tree size 1 (ar's step) and at "
                             "least one middle_ms size")
        out.append(Profile(str(name), cost, str(entry.get("note", "")), entry.get("profile_key")))
    return out


def scheduler_margins(scheduler: LearnedScheduler, rounds: Rounds) -> np.ndarray:  # -> [R, 31]
    with torch.no_grad():
        margins = scheduler.model(torch.from_numpy(rounds.decision_signals())).numpy()
    return margins.reshape(len(rounds), -1)


def ordered(benchmarks) -> list[str]:
    """Benchmark names once each, as eval's tables order them (those of files after, by name)."""
    order = list(BENCHMARKS)
    return sorted(set(benchmarks), key=lambda b: (order.index(b) if b in order else len(order), b))


def rate(rounds: Rounds, schedules: np.ndarray, where: np.ndarray) -> tuple[float, float, float]:
    """(tokens/s, accepted per round, middle calls per round) of the rounds `where` [R] bool, each decoded
    with its schedule `schedules` [R]."""
    idx = np.flatnonzero(where)
    chosen = schedules[idx]
    accepted = rounds.accepted[idx, chosen]
    ms = rounds.latency_ms[idx, chosen].sum()
    return float(accepted.sum() / (ms / 1e3)), float(accepted.mean()), float(SCHEDULES[chosen].sum(1).mean())


def fixed_budget(by_budget: dict[int, Rounds], schedule: int) -> int:
    """The budget at which one schedule for every round decodes fastest (ties: the smaller)."""
    speed = {b: rate(r, np.full(len(r), schedule), np.ones(len(r), bool))[0] for b, r in by_budget.items()}
    return max(speed, key=lambda b: (speed[b], -b))


def project(traj: Trajectories, cost: CostModel, scheduler: LearnedScheduler, profile: str = "") -> list[dict]:
    """Per benchmark and method, the projected rows: tokens_per_s, speedup (over ar), budget, rounds,
    mean_accepted, middle_calls_per_round; then one (mean) row per method over the benchmarks (as eval's)."""
    traj = priced(traj, cost)
    by_budget = {b: traj.rounds(b) for b in measured_budgets(traj, cost)}
    budget = int(scheduler.info.cost_profile["budget"])
    if budget not in by_budget:
        raise ValueError(f"the scheduler was fitted for budget {budget}, which this profile did not measure")
    cap = int(scheduler.info.cost_profile["call_cap"])
    at_budget = by_budget[budget]
    choices = {ALL_SMALL: (fixed_budget(by_budget, 0), None), ALL_MID: (fixed_budget(by_budget, ALL_MID_SCHEDULE), None),
               TREEGRAFT: (budget, schedules_from_margins(scheduler_margins(scheduler, at_budget), cap)),
               ORACLE: (budget, oracle_schedules(at_budget, cap))}
    benchmarks = ordered(at_budget.benchmarks.tolist())
    ar_rate = 1e3 / cost.verify(1)
    rows = []
    for method in METHODS:
        per_bench = []
        for bench in benchmarks:
            where = at_budget.benchmarks == bench
            if method == AR:
                row = {"budget": 1, "tokens_per_s": ar_rate, "mean_accepted": 1.0, "middle_calls_per_round": 0.0}
            else:
                b, schedules = choices[method]
                rounds = by_budget[b]
                if schedules is None:
                    schedules = np.full(len(rounds), 0 if method == ALL_SMALL else ALL_MID_SCHEDULE)
                tps, acc, calls = rate(rounds, schedules, where)
                row = {"budget": b, "tokens_per_s": tps, "mean_accepted": acc, "middle_calls_per_round": calls}
            per_bench.append({"profile": profile, "method": method, "benchmark": bench, "rounds": int(where.sum()),
                              **row, "speedup": row["tokens_per_s"] / ar_rate, "basis": LABEL})
        rows += per_bench
        rows.append({**per_bench[0], "benchmark": MEAN, "rounds": sum(r["rounds"] for r in per_bench),
                     **{k: float(np.mean([r[k] for r in per_bench]))
                        for k in ("tokens_per_s", "speedup", "mean_accepted", "middle_calls_per_round")}})
    return rows


def table(rows: list[dict], title: str) -> str:
    """One profile's rows as Markdown: speedup over ar per benchmark, then mean figures."""
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows if r["benchmark"] != MEAN))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["benchmark"]): r for r in rows}
    lines = [f"### {title}", "",
             f"| method ({LABEL}) | budget | " + " | ".join(f"{b} speedup" for b in benchmarks)
             + " | mean speedup | mean tok/s | accepted/round | mid calls/round |",
             "|---" * (len(benchmarks) + 6) + "|"]
    for m in methods:
        mean = cell[m, MEAN]
        lines.append(f"| {m} | {mean['budget']} | " + " | ".join(f"{cell[m, b]['speedup']:.2f}x" for b in benchmarks)
                     + f" | {mean['speedup']:.2f}x | {mean['tokens_per_s']:.2f} | {mean['mean_accepted']:.2f} | "
                     f"{mean['middle_calls_per_round']:.2f} |")
    return "\n".join(lines)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", name).strip("-")[:120] or "profile"


@dataclass
class Projection:
    rows: list[dict]
    markdown: str
    files: list[Path]


def run(traj: Trajectories, profiles: list[Profile], out: Path, data_name: str, log=print, **fit_args) -> Projection:
    """Fit the scheduler for every profile (an artifact each under `out`), project, and write projection.md,
    projection.csv and one chart per profile. `fit_args` go to fit.fit (e.g. fewer epochs in tests)."""
    out = Path(out)
    benchmarks = ordered(traj.table.column("benchmark").to_pylist())
    held_out = traj.manifest.get("held_out") or ["mt_bench"]
    sections = [f"# Speedups {LABEL}", "",
                f"Acceptance: {data_name} ({' + '.join(traj.manifest['pair'])}, {traj.table.num_rows} rounds of "
                f"benchmarks {', '.join(benchmarks)}; held out of the offline stage, so not covered: "
                f"{', '.join(held_out)}). Decoding only (no prefill); forwards, n-gram steps and scheduler calls "
                "priced, per-round bookkeeping not; the scheduler is fitted on three quarters of these prompts.", ""]
    rows, files = [], []
    for p in profiles:
        artifact = out / f"scheduler--{slug(p.name)}.npz"
        log(f"fitting the scheduler for {p.name} ({artifact})")
        scheduler, _ = fit_for_device(traj, p.cost, p.key or p.name, artifact, log=log, **fit_args)
        mine = project(traj, p.cost, scheduler, p.name)
        rows += mine
        title = f"{p.name}: speedup over ar, {LABEL}"
        sections += [table(mine, title), "", *([p.note, ""] if p.note else []),
                     f"Scheduler fitted for this profile: {artifact.name} (budget "
                     f"{scheduler.info.cost_profile['budget']}, call cap {scheduler.info.cost_profile['call_cap']}).", ""]
        chart = out / f"projection--{slug(p.name)}.png"
        plot_speedups(_ChartRows(mine), chart, title=f"{p.name}\nspeedup over ar, {LABEL}")
        files += [artifact, chart]
    markdown = "\n".join(sections)
    write_text(out / "projection.md", markdown)
    write_csv(out / "projection.csv", [{("projected_" + k if k in PROJECTED else k): v for k, v in r.items()} for r in rows])
    return Projection(rows, markdown, [out / "projection.md", out / "projection.csv", *files])


@dataclass
class _ChartRows:
    """What evaluate.plot_speedups reads of a summary."""

    rows: list[dict]

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(r["method"] for r in self.rows))

    @property
    def benchmarks(self) -> list[str]:
        return list(dict.fromkeys(r["benchmark"] for r in self.rows if r["benchmark"] != MEAN))
