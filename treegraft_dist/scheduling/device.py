"""The scheduler for the device it runs on: shipped trajectories priced with this device's measured costs.

What a draft tree accepts under each schedule and budget depends on the models and the tree settings
only; what a schedule costs depends on the device, the precision and the threads. The two are kept
apart:
  trajectories  (hardware-independent) accepted lengths, pruned sizes and middle-drafter forward sizes of
                every round under all 32 schedules at every candidate budget; collected once with
                `treegraft collect` and shipped for the embedded pair (data/trajectories/);
  cost profile  (per model pair, device, dtype, threads) target verification by tree size, middle forward
                by tokens, n-gram step and scheduler call; measured once and cached as JSON;
  artifact      the scheduler fitted on the trajectories priced with one profile (`fit.fit`, the budget
                chosen among the tree sizes that profile measured, so it follows the device); cached,
                keyed by the profile, and stamped with the profile's key.
On first use on a device the profile is measured and the scheduler fitted (a minute or two on a CPU);
later runs load both from the cache. An artifact is only ever applied on the profile it was fitted
for: `check_profile` refuses any other, with what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from ..decoding.config import TreeConfig
from ..decoding.costs import CostModel, device_costs, profile_key
from ..decoding.scheduler import LearnedScheduler, SchedulerArtifactError
from ..models.hf import CausalLM
from .artifact import load_artifact
from .collect import Trajectories, read_trajectories
from .value import ValueHeads

PROFILE_KEY = "profile_key"  # in an artifact's cost_profile: the profile it was fitted for
# Bumped when the fit changes what it learns from the same data (2: signals constant over the training
# rounds, as one device's context timings are, are left out), so that cached fits are redone.
FIT_VERSION = 2
DATA_DIR = Path(__file__).parents[1] / "data" / "trajectories"
# Trajectories shipped per (target, middle) as named on the command line, collected at the published tree
# width (K = 10); `make trajectories` rebuilds them.
SHIPPED_TRAJECTORIES = {
    ("embedded:qwen2.5-coder-1.5b-instruct", "embedded:qwen2.5-coder-0.5b-instruct"):
        DATA_DIR / "qwen2.5-coder-1.5b+0.5b-instruct",
}
# The same rounds' prompts collected at other tree widths (otherwise the same settings). Where a middle call
# costs about what its tokens do (a CPU: 35 ms for 4 new nodes against 60 for 10 on a 2-core Zen 4 in bf16)
# and a wider tree's verification costs more than it accepts, a narrower tree decodes faster; where both are
# flat (a GPU) the wider one does. The fit prices every set with this device's costs and keeps the fastest.
SHIPPED_WIDTHS = {
    ("embedded:qwen2.5-coder-1.5b-instruct", "embedded:qwen2.5-coder-0.5b-instruct"):
        (DATA_DIR / "qwen2.5-coder-1.5b+0.5b-instruct-k4",),
}


def shipped_trajectories(pair: tuple[str, str] | None) -> Path | None:
    """The set shipped for `pair` at the published tree width, or None."""
    folder = SHIPPED_TRAJECTORIES.get(tuple(pair)) if pair else None
    return folder if folder is not None and (folder / "collect.json").is_file() else None


def shipped_trajectory_sets(pair: tuple[str, str] | None) -> tuple[Path, ...]:
    """Every set shipped for `pair`: the published width's first, then those at other widths."""
    first = shipped_trajectories(pair)
    if first is None:
        return ()
    others = SHIPPED_WIDTHS.get(tuple(pair), ())
    return (first,) + tuple(f for f in others if (f / "collect.json").is_file())


def priced(traj: Trajectories, cost: CostModel) -> Trajectories:
    """The same rounds with latencies from `cost` (the recorded ones are the collecting device's)."""
    return Trajectories({**traj.manifest, "cost_model": cost.to_dict()}, traj.table)


def measured_budgets(traj: Trajectories, cost: CostModel) -> tuple[int, ...]:
    """Recorded budgets this device measured: a size it did not (too slow to ever pay) is not a candidate."""
    budgets = tuple(b for b in traj.budgets if b in cost.verify_ms)
    if not budgets:
        raise ValueError(f"none of the recorded budgets {list(traj.budgets)} was measured on this device "
                         f"({sorted(cost.verify_ms)}): collect trajectories with these sizes")
    return budgets


def fit_for_device(traj: Trajectories, cost: CostModel, key: str, out: Path, log=print, **fit_args
                   ) -> tuple[LearnedScheduler, ValueHeads]:
    """Fit the scheduler for one cost profile and write it to `out`, stamped with the profile's key."""
    from .fit import fit

    scheduler, heads, report = fit(priced(traj, cost), out, budgets=measured_budgets(traj, cost),
                                   profile={PROFILE_KEY: key}, log=log, **fit_args)
    log(report.table())
    return scheduler, heads


def check_profile(scheduler: LearnedScheduler, key: str, where: str) -> None:
    fitted = scheduler.info.cost_profile.get(PROFILE_KEY)
    if fitted != key:
        raise SchedulerArtifactError(
            f"{where} was fitted for the cost profile {fitted or '(none recorded)'}, not this one ({key}); its "
            "decisions, budget and call cap assume another device: drop --scheduler to fit one here from the "
            "shipped trajectories, or `treegraft fit --data DIR --for-device` on this machine")


def same_drafting(a: TreeConfig, b: TreeConfig, any_width: bool = False) -> bool:
    """Whether two tree configs grow the same trees within their depth (the budget and the call budget are
    chosen per device; with `any_width` the tree width top_k too). Deepening drafts past the depth, where no
    trajectory reaches (collection drafts the 32 schedules of the depth's layers), so it is not compared."""
    free = {"budget": 1, "call_budget": None, "deepen": 0, "deepen_cost": None, "deepen_row_cost": 0.0,
            **({"top_k": 1} if any_width else {})}
    return dataclasses.replace(a, **free) == dataclasses.replace(b, **free)


def choose_width(sets: list[Trajectories], cost: CostModel, log=print) -> tuple[Trajectories, int]:
    """The trajectory set (one per tree width) and budget where the scheduled decode of the held-out prompts,
    priced with `cost`, is fastest (fit.budget_row at each; ties: the earlier set, the smaller budget).

    Each candidate costs a fit of the value heads, so they are taken from the highest `fit.budget_bound` down,
    and one whose bound is below a scheduled speed already reached is not fitted: it cannot be chosen."""
    from .fit import budget_bound, budget_row

    priced_sets = [priced(traj, cost) for traj in sets]
    bounds = {(i, b): budget_bound(traj, b, 0.25, 0)
              for i, traj in enumerate(priced_sets) for b in measured_budgets(traj, cost)}
    rows, reached = {}, 0.0
    for i, b in sorted(bounds, key=lambda c: -bounds[c]):
        if bounds[i, b] < reached:
            break
        rows[i, b] = budget_row(priced_sets[i], b, 0.25, 0)
        reached = max(reached, rows[i, b]["scheduled"])
    for i, traj in enumerate(sets):
        log(f"tree width {traj.manifest['tree']['top_k']}: held-out tok/s by budget (cost model)")
        for b in (b for j, b in bounds if j == i):
            row = rows.get((i, b))
            said = (", ".join(f"{k} {v:.2f}" for k, v in row.items()) + " tok/s" if row is not None else
                    f"at most {bounds[i, b]:.2f} tok/s, below the {reached:.2f} reached: not fitted")
            log(f"  budget {b}: {said}")
    i, budget = max(rows, key=lambda c: (rows[c]["scheduled"], -c[0], -c[1]))
    log(f"chosen: tree width {sets[i].manifest['tree']['top_k']}, budget {budget} ({rows[i, budget]['scheduled']:.2f} "
        "tok/s)")
    return sets[i], budget


def scheduler_for_device(pair: tuple[str, str], target: CausalLM, target_source: str, middle: CausalLM,
                         middle_source: str, cache_dir: Path, context: list[int], tree: TreeConfig, log=print,
                         trajectories: str | Path | None = None, any_width: bool = False
                         ) -> tuple[LearnedScheduler, ValueHeads] | None:
    """The scheduler fitted for this device from `trajectories` (a `treegraft collect` folder of this pair),
    else from those shipped for `pair`: loaded from the cache, or measured and fitted now and cached. None
    where none ship for the pair or they were collected with other tree settings than `tree` (their accepted
    lengths would not be this engine's). With `any_width` the tree width is the fit's to choose: among the
    sets shipped at several widths, the one this device decodes fastest (`choose_width`; the scheduler's
    `width` says which, and the engine must run it)."""
    folders = (Path(trajectories),) if trajectories is not None else shipped_trajectory_sets(pair)
    sets = []
    for folder in folders:
        traj = read_trajectories(folder)
        if trajectories is not None and tuple(traj.manifest.get("pair") or ()) != tuple(pair):
            raise ValueError(f"trajectories {str(folder)!r} were collected for the pair {traj.manifest.get('pair')}, "
                             f"not {list(pair)}: collect them for this pair with `treegraft collect`")
        collected = TreeConfig(**traj.manifest["tree"])
        if same_drafting(collected, tree, any_width):
            sets.append(traj)
        else:
            log(f"the trajectories in {folder.name} were collected with other tree settings ({collected}) than "
                f"these ({tree})")
    if not sets:
        return None
    tree = TreeConfig(**sets[0].manifest["tree"])
    key = profile_key(target, target_source, middle, middle_source)
    cost = device_costs(target, target_source, middle, middle_source, cache_dir, context, tree)
    # The data's identity, the fit's version and the costs are part of the name: new shipped trajectories, a
    # fit that changed what it learns from them, or a profile measured again (it was taken on a busy
    # machine) mean a new fit.
    data = sets[0].manifest if len(sets) == 1 else {"sets": [t.manifest for t in sets]}
    digest = hashlib.sha256(json.dumps({**data, "fit_version": FIT_VERSION, "cost": cost.to_dict()},
                                       sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / "schedulers" / f"{key}--{digest}.npz"
    if path.is_file():
        scheduler, heads = load_artifact(path, expect_pair=pair)
    else:
        to_stderr = lambda m: print(m, file=sys.stderr)  # noqa: E731
        traj, budget = (sets[0], None) if len(sets) == 1 else choose_width(sets, cost, to_stderr)
        log(f"fitting the scheduler for this device ({key}) from {len(sets)} trajectory set(s), tree width "
            f"{traj.manifest['tree']['top_k']} ({traj.table.num_rows} rounds); cached at {path}")
        scheduler, heads = fit_for_device(traj, cost, key, path, log=to_stderr,
                                          **({} if budget is None else {"budget": budget}))
    check_profile(scheduler, key, f"scheduler artifact {str(path)!r}")
    return scheduler, heads


def resolve_scheduler(path: str | Path | None, pair: tuple[str, str] | None, target: CausalLM, target_source: str,
                      middle: CausalLM, middle_source: str, cache_dir: Path, context: list[int], tree: TreeConfig,
                      log=print, trajectories: str | Path | None = None, any_width: bool = False
                      ) -> tuple[LearnedScheduler, ValueHeads | None] | None:
    """The `treegraft` method's scheduler: the artifact at `path` (refused unless fitted for this device's
    profile), else the one fitted here from `trajectories` or those shipped for `pair`; None if neither
    exists."""
    key = profile_key(target, target_source, middle, middle_source)
    if path is not None:
        scheduler, heads = load_artifact(path, expect_pair=pair)
        check_profile(scheduler, key, f"scheduler artifact {str(path)!r}")
        return scheduler, heads
    return scheduler_for_device(pair, target, target_source, middle, middle_source, cache_dir, context, tree, log,
                                trajectories, any_width)
