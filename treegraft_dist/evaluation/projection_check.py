"""`treegraft project` against reality on one machine: the projection with this machine's own cost profile
next to a measured `treegraft eval` on the same prompts, and the error per method (`python -m
jobs.bench.check_projection` runs it on the embedded pair).

Steps:
  1. this machine's cost profile of the pair, as on first use (costs.device_costs: measured once,
     cached), and the scheduler fitted for it on all the trajectories (OUT/scheduler.npz);
  2. the projection (projection.project) of the trajectories' rounds of the first N prompts per benchmark;
  3. `treegraft eval` on exactly those prompts (the collected questions, chat-formatted as collect does them,
     as many new tokens as were collected), all-small and all-mid at the budgets the projection chose,
     treegraft with the scheduler of step 1;
  4. per method, projected and measured decode tokens/s (the tokens after the first over the wall time less
     the prefill: a projection leaves prefill out) and speedup over ar, and the error projected / measured - 1.
Both price the scheduler at its fitted budget (eval's treegraft prunes every round's tree to it).
Written: OUT/check.md, OUT/check.csv, OUT/projection (the projection's files), OUT/eval (eval's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..decoding.config import TreeConfig
from ..decoding.costs import device_costs, profile_key
from ..files import write_csv, write_text
from ..models.loading import LoadedModel
from ..models.paths import cache_root
from ..scheduling.collect import Trajectories, read_trajectories
from ..scheduling.device import fit_for_device, same_drafting, shipped_trajectories
from .benchmarks import builtin, chat_prompt
from .evaluate import COST_CONTEXT_BENCHMARK, EvalConfig, Evaluation
from .projection import AR, LABEL, MEAN, METHODS, ordered, project


class Checked(NamedTuple):
    text: str  # the Markdown report, as written to OUT/check.md
    rows: list[dict]  # per method and benchmark, as written to OUT/check.csv
    mismatches: int  # eval's outputs that differ from ar


def checked_methods(text: str) -> list[str]:
    """The comma-separated methods to check: ar and any of the projection's."""
    methods = [m for m in text.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or AR not in methods:
        raise ValueError(f"--methods takes ar and any of {', '.join(METHODS[1:])}, got {text!r}")
    return methods


def checked_trajectories(pair: tuple[str, str], data: Path | None, per_benchmark: int) -> Trajectories:
    """The trajectories to check against (`data`, or the ones shipped for `pair`), refused with a ValueError
    that says why where they or the prompt count cannot be checked."""
    if per_benchmark < 1:
        raise ValueError(f"--prompts-per-benchmark must be at least 1, got {per_benchmark}")
    data = data or shipped_trajectories(pair)
    if data is None:
        raise ValueError(f"no trajectories ship for {pair}: give --data (a `treegraft collect` folder)")
    traj = read_trajectories(data)
    if tuple(traj.manifest["pair"]) != pair:
        raise ValueError(f"{data} holds trajectories of {tuple(traj.manifest['pair'])}, not {pair}")
    tree = TreeConfig(**traj.manifest["tree"])
    if not same_drafting(tree, TreeConfig()):
        raise ValueError(f"{data} was collected with other tree settings ({tree}) than eval drafts with")
    return traj


def check(traj: Trajectories, target: LoadedModel, middle: LoadedModel, pair: tuple[str, str], methods: list[str],
          per_benchmark: int, out: Path, cache_dir: str | None = None, log=print, **fit_args) -> Checked:
    """Steps 1-4 above for the loaded pair; `fit_args` go to the scheduler's fit (fewer epochs in tests)."""
    tree = TreeConfig(**traj.manifest["tree"])
    context = chat_prompt(target.tokenizer, [builtin(COST_CONTEXT_BENCHMARK)[-1].turns[0]], [])
    cost = device_costs(target.lm, target.source, middle.lm, middle.source, cache_root(cache_dir), context, tree)
    key = profile_key(target.lm, target.source, middle.lm, middle.source)
    scheduler, _ = fit_for_device(traj, cost, key, out / "scheduler.npz", log=log, **fit_args)
    prompts = selected(traj, per_benchmark)
    projected = project(restricted(traj, prompts), cost, scheduler, key)
    budgets = {m: next(r["budget"] for r in projected if r["method"] == m) for m in ("all-small", "all-mid")
               if m in methods}
    log(f"prompts: {prompts}; budgets: {budgets}")
    cfg = EvalConfig(benchmarks=[], benchmark_files=question_files(prompts, out / "prompts"), methods=methods,
                     prompts_per_benchmark=per_benchmark, max_new_tokens=int(traj.manifest["max_new_tokens"]),
                     out=out / "eval", budget=budgets, cache_dir=Path(cache_dir) if cache_dir else None,
                     scheduler=out / "scheduler.npz", pair=pair)
    summary = Evaluation(target, middle, cfg, log=log).run()
    rows = compare([r for r in projected if r["method"] in methods], measured(out / "eval" / "results.parquet", methods),
                   methods)
    text = (f"# {LABEL.capitalize()} against measured: {key}\n\n"
            f"{sum(len(q) for q in prompts.values())} prompts ({', '.join(f'{b} {q}' for b, q in prompts.items())}), "
            f"{cfg.max_new_tokens} new tokens; decode only (prefill left out of both). Error = projected / measured - 1.\n\n"
            f"{table(rows)}\n")
    write_csv(out / "check.csv", rows)
    write_text(out / "check.md", text)
    return Checked(text, rows, len(summary.mismatches))


def selected(traj: Trajectories, per_benchmark: int) -> dict[str, list[str]]:
    """The first `per_benchmark` collected questions of every benchmark (by question number)."""
    ids: dict[str, set[str]] = {}
    for bench, qid in zip(traj.table.column("benchmark").to_pylist(), traj.table.column("prompt_id").to_pylist()):
        ids.setdefault(bench, set()).add(qid)
    return {b: sorted(ids[b], key=lambda q: (len(q), q))[:per_benchmark] for b in ordered(ids)}


def restricted(traj: Trajectories, prompts: dict[str, list[str]]) -> Trajectories:
    keys = pa.array(sorted(f"{b}/{q}" for b, qs in prompts.items() for q in qs))
    names = pc.binary_join_element_wise(traj.table.column("benchmark"), traj.table.column("prompt_id"), "/")
    return Trajectories(traj.manifest, traj.table.filter(pc.is_in(names, value_set=keys)))


def question_files(prompts: dict[str, list[str]], folder: Path) -> list[str]:
    """One JSONL file per benchmark (its name: eval reads the benchmark from the file name) with the first turn
    of each selected question, as collect prompts them."""
    files = []
    for bench, qids in prompts.items():
        by_id = {q.question_id: q for q in builtin(bench)}
        rows = [{"question_id": q, "category": by_id[q].category, "turns": [by_id[q].turns[0]]} for q in qids]
        path = folder / f"{bench}.jsonl"
        write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(path))
    return files


def measured(results: Path, methods: list[str]) -> dict[tuple[str, str], float]:
    """(method, benchmark) -> decode tokens/s: the tokens after the first over the wall time less prefill."""
    rows = pq.read_table(results).to_pylist()
    out = {}
    for m in methods:
        for b in dict.fromkeys(r["benchmark"] for r in rows):
            sub = [r for r in rows if r["method"] == m and r["benchmark"] == b]
            out[m, b] = sum(r["new_tokens"] - 1 for r in sub) / sum(r["wall_s"] - r["prefill_s"] for r in sub)
    return out


def compare(projected: list[dict], rates: dict[tuple[str, str], float], methods: list[str]) -> list[dict]:
    """Per method and benchmark, then the mean over benchmarks (as the projection's): projected and measured
    tokens/s and speedup over ar, and the errors projected / measured - 1."""
    proj = {(r["method"], r["benchmark"]): r for r in projected}
    out = []
    for m in methods:
        mine = []
        for (method, b), rate in rates.items():
            if method == m:
                mine.append({"method": m, "benchmark": b, "budget": proj[m, b]["budget"],
                             "projected_tokens_per_s": proj[m, b]["tokens_per_s"], "measured_decode_tokens_per_s": rate,
                             "projected_speedup": proj[m, b]["speedup"], "measured_decode_speedup": rate / rates[AR, b]})
        mine.append({**mine[0], "benchmark": MEAN, **{k: sum(r[k] for r in mine) / len(mine) for k in (
            "projected_tokens_per_s", "measured_decode_tokens_per_s", "projected_speedup", "measured_decode_speedup")}})
        for r in mine:
            r["tokens_per_s_error"] = r["projected_tokens_per_s"] / r["measured_decode_tokens_per_s"] - 1
            r["speedup_error"] = r["projected_speedup"] / r["measured_decode_speedup"] - 1
        out += mine
    return out


def table(rows: list[dict]) -> str:
    lines = ["| method | budget | projected tok/s | measured decode tok/s | error | projected speedup | "
             "measured decode speedup | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["benchmark"] == MEAN:
            lines.append(f"| {r['method']} | {r['budget']} | {r['projected_tokens_per_s']:.2f} | "
                         f"{r['measured_decode_tokens_per_s']:.2f} | {r['tokens_per_s_error']:+.0%} | "
                         f"{r['projected_speedup']:.2f}x | {r['measured_decode_speedup']:.2f}x | "
                         f"{r['speedup_error']:+.0%} |")
    return "\n".join(lines)
