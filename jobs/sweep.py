"""`python -m jobs.sweep --grid GRID.yaml --out DIR`: an evaluation grid run on a Ray cluster.

A grid file (YAML, e.g. jobs/grids/embedded.yaml) names model pairs, methods, tree budgets, benchmarks,
dtypes, prompts per benchmark and new tokens. A cell is one (pair, dtype, benchmark, question, method,
budget); `ar` is always among the methods (every output is checked against it) and, like the peers, has
no budget.

    grid -> per (pair, dtype): a pool of SweepWorker actors, each loading the pair once and running the
            missing cells of one question after another (ar among them: its tokens are the reference)
         -> DIR/cells/<pair>--<dtype>/<benchmark>--<question>--<method>--<budget>.parquet (one row, written whole)
         -> DIR/results.parquet (every cell of the grid), DIR/summary.md (one table per pair and dtype),
            DIR/<pair>--<dtype>/summary.md, summary.csv, speedup.png

Rows, verdicts, tables and charts are `treegraft eval`'s (treegraft_dist/evaluation/evaluate.py); a row adds the pair,
the dtype and the generated ids (a stored ar row is the reference of cells run later). The driver writes
every file, so only it needs DIR; model folders must be readable on every node. Rerunning over DIR skips
every cell whose file exists; DIR/sweep.json records what must not change between runs (each pair's models,
the number of new tokens).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from tqdm import tqdm

from treegraft_dist.decoding.engine import AR_METHOD
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, BenchmarkError, Question, builtin, chat_prompt
from treegraft_dist.evaluation.evaluate import EvalConfig, Evaluation, select_questions
from treegraft_dist.evaluation.lossless import MISMATCH
from treegraft_dist.evaluation.methods import ALL_METHODS, PUBLISHED, SIZED, is_method, is_ours
from treegraft_dist.evaluation.peers import PEER_METHODS
from treegraft_dist.evaluation.summary import row_verdict, summarize
from treegraft_dist.files import write_json, write_parquet, write_text
from treegraft_dist.models.loading import DTYPES, ModelError, check_pair, check_tokenizers, load_model, load_tokenizer
from treegraft_dist.models.prepare import PrepareError, resolve_model_path
from treegraft_dist.scheduling.collect import part_name

CELLS_DIR = "cells"
MANIFEST = "sweep.json"
RESULTS = "results.parquet"
EXAMPLE = "jobs/grids/embedded.yaml"
LIST_KEYS = ("pairs", "methods", "budgets", "benchmarks", "dtypes")
INT_KEYS = ("prompts_per_benchmark", "max_new_tokens")
PAIR_KEYS = ("name", "target", "middle", "scheduler")
LOCAL_OBJECT_STORE = 256 * 1024**2  # only token ids and result rows travel
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set in the driver of a job from `ray job submit`


class GridError(ValueError):
    """A grid file (or an output folder) that cannot be swept; the message says what to fix."""


@dataclass(frozen=True)
class Pair:
    name: str  # names the pair's files and tables
    target: str  # as written in the grid: a folder, a hub id or an embedded name
    middle: str
    scheduler: str | None = None  # artifact for treegraft (default: the one fitted for the device, if any)


@dataclass(frozen=True)
class Grid:
    pairs: tuple[Pair, ...]
    methods: tuple[str, ...]  # ar first
    budgets: tuple[int, ...]
    benchmarks: tuple[str, ...]
    dtypes: tuple[str, ...]
    prompts_per_benchmark: int
    max_new_tokens: int

    def cells_of(self, method: str) -> list[int | None]:
        """The budgets a method runs at: every grid budget for our tree methods, none for ar and the peers."""
        return [None] if method == AR_METHOD or method in PEER_METHODS else list(self.budgets)

    def label(self, method: str, budget: int | None) -> str:
        """The method's name in tables and charts; with several budgets, a tree method's names its budget."""
        return method if budget is None or len(self.budgets) == 1 else f"{method} b{budget}"


def _fail(path, what: str) -> GridError:
    return GridError(f"grid file {path}: {what} (see {EXAMPLE} for a complete grid)")


def _as_list(path, raw: dict, key: str) -> list:
    value = raw[key]
    items = value if isinstance(value, list) else [value]
    if not items or any(v is None for v in items):
        raise _fail(path, f"'{key}' must be a non-empty list")
    return items


def _count(path, raw: dict, key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(path, f"'{key}' must be an integer >= 1, got {value!r}")
    return value


def _pair(path, item, i: int) -> Pair:
    if not isinstance(item, dict):
        raise _fail(path, f"pairs[{i}] must be a mapping with target and middle, got {item!r}")
    unknown = sorted(set(item) - set(PAIR_KEYS))
    if unknown:
        raise _fail(path, f"pairs[{i}] has unknown key(s) {', '.join(map(repr, unknown))}: a pair takes "
                          f"{', '.join(PAIR_KEYS)}")
    for key in ("target", "middle"):
        if not isinstance(item.get(key), str) or not item[key].strip():
            raise _fail(path, f"pairs[{i}] needs '{key}': a model folder, a hub id or an embedded name")
    if item["middle"].lower() == "none":
        raise _fail(path, f"pairs[{i}]: middle 'none' is not swept (most methods need a middle drafter): "
                          "name a middle model")
    name = str(item.get("name") or f"{Path(item['target']).name}+{Path(item['middle']).name}")
    scheduler = item.get("scheduler")
    if scheduler is not None and not isinstance(scheduler, str):
        raise _fail(path, f"pairs[{i}]: 'scheduler' must be the path of a scheduler artifact, got {scheduler!r}")
    return Pair(name, item["target"], item["middle"], scheduler)


def parse_grid(raw, path="<grid>") -> Grid:
    """The grid a parsed YAML document describes; GridError names the first thing wrong and what to do."""
    if not isinstance(raw, dict):
        raise _fail(path, f"the file must be a mapping with the keys {', '.join(LIST_KEYS + INT_KEYS)}")
    for key in raw:
        if key not in LIST_KEYS + INT_KEYS:
            near = difflib.get_close_matches(str(key), LIST_KEYS + INT_KEYS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise _fail(path, f"unknown key '{key}'{hint}: the keys are {', '.join(LIST_KEYS + INT_KEYS)}")
    missing = [k for k in LIST_KEYS + INT_KEYS if k not in raw]
    if missing:
        raise _fail(path, f"missing key(s) {', '.join(missing)}")

    pairs = tuple(_pair(path, item, i) for i, item in enumerate(_as_list(path, raw, "pairs")))
    names = [p.name for p in pairs]
    if len(set(names)) < len(names):
        raise _fail(path, f"pair names repeat ({', '.join(names)}): give each pair its own 'name'")

    methods = [str(m) for m in _as_list(path, raw, "methods")]
    for m in methods:
        if not is_method(m):
            raise _fail(path, f"unknown method {m!r}: use {', '.join(ALL_METHODS)} or a 5-bit pattern such as "
                              f"01001 (a fixed one with {PUBLISHED}: the published tree settings; with {SIZED}: "
                              "trees sized per round)")
    methods = list(dict.fromkeys([AR_METHOD] + methods))  # ar: the reference every output is checked against

    budgets = _as_list(path, raw, "budgets")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise _fail(path, f"bad budget(s) {', '.join(map(repr, bad))}: budgets are tree sizes, integers >= 1 "
                          "such as [8, 32, 64] ('auto' is `treegraft eval`'s: here the budget is an axis of the grid)")

    benchmarks = [str(b) for b in _as_list(path, raw, "benchmarks")]
    for b in benchmarks:
        if b not in BENCHMARKS:
            raise _fail(path, f"unknown benchmark {b!r}: choose from {', '.join(BENCHMARKS)}")

    dtypes = [str(d) for d in _as_list(path, raw, "dtypes")]
    for d in dtypes:
        if d != "auto" and d not in DTYPES:
            raise _fail(path, f"unknown dtype {d!r}: use auto, {', '.join(DTYPES)}")

    return Grid(pairs, tuple(methods), tuple(dict.fromkeys(budgets)), tuple(dict.fromkeys(benchmarks)),
                tuple(dict.fromkeys(dtypes)), _count(path, raw, "prompts_per_benchmark"),
                _count(path, raw, "max_new_tokens"))


def load_grid(path: str | Path) -> Grid:
    path = Path(path)
    if not path.is_file():
        raise GridError(f"grid file {path} does not exist: give a YAML grid such as {EXAMPLE}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise GridError(f"grid file {path} is not valid YAML ({str(e).splitlines()[0]}): fix its syntax") from None
    return parse_grid(raw, path)


# -- cells ------------------------------------------------------------------------------------------------
def group_name(pair: Pair, dtype: str) -> str:
    """The folder of a (pair, dtype): its cells and its summary, table and chart."""
    safe = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in pair.name)
    return f"{safe}--{dtype}"


def cell_path(out: Path, group: str, benchmark: str, question_id: str, method: str, budget: int | None) -> Path:
    return out / CELLS_DIR / group / part_name(benchmark, f"{question_id}--{method}--{budget or 'none'}")


def read_cell(path: Path) -> dict:
    return pq.read_table(path).to_pylist()[0]


def write_cell(path: Path, row: dict) -> None:
    write_parquet(path, pa.Table.from_pylist([row]))


# -- the worker -----------------------------------------------------------------------------------------
WARMUP_NEW_TOKENS = 8  # an untimed request per (method, budget) before its first cell, as `treegraft eval` does


class SweepWorker:
    """One actor: a pair loaded at one dtype (`load`, once per pair and dtype), then the missing cells of one
    question after another (`run`), each method on the same prompt back to back."""

    def __init__(self, device: str, threads: int, cache_dir: str | None):
        import torch

        torch.set_num_threads(threads)
        self.device, self.cache_dir = device, cache_dir
        self.evaluation: Evaluation | None = None

    def load(self, spec: dict) -> str:
        """Load spec's pair (sources resolved by the driver) at spec's dtype; returns the dtype it runs in."""
        self.evaluation = self.runners = None  # the previous pair's memory goes before the next pair loads
        target = load_model(spec["target_source"], self.device, spec["dtype"])
        middle = load_model(spec["middle_source"], self.device, spec["dtype"], drafter=True)
        check_pair(target, middle)
        cfg = EvalConfig(benchmarks=list(spec["benchmarks"]), methods=list(spec["methods"]),
                         budget=spec["budgets"][0], max_new_tokens=spec["max_new_tokens"],
                         cache_dir=Path(self.cache_dir) if self.cache_dir else None,
                         scheduler=Path(spec["scheduler"]) if spec["scheduler"] else None,
                         pair=(spec["target"], spec["middle"]))
        self.evaluation = Evaluation(target, middle, cfg, log=lambda m: print(f"sweep worker: {m}", file=sys.stderr))
        self.spec, self.runners = spec, {}
        # Warm-up prompt: the last question of the first benchmark, outside the evaluated ones (as in eval).
        self.warm_ids = chat_prompt(target.tokenizer, [builtin(spec["benchmarks"][0])[-1].turns[0]], [])
        self.torch_dtype = str(target.lm.model.dtype).removeprefix("torch.")
        return self.torch_dtype

    def _runner(self, method: str, budget: int | None):
        if (method, budget) not in self.runners:
            # ar and the peers ignore the tree budget; any valid one builds their runner.
            run = self.evaluation.runner(method, budget or self.spec["budgets"][0])
            run(self.warm_ids, WARMUP_NEW_TOKENS)
            self.runners[method, budget] = run
        return self.runners[method, budget]

    def run(self, question: Question, todo: list[tuple[str, int | None]], reference: list[int] | None,
            shift: int) -> list[dict]:
        """The rows of `todo`'s (method, budget) cells on the question's first turn. `reference`: ar's tokens
        from an earlier run, None when ar is in `todo`. The order rotates by `shift` (the question's index),
        so no method always runs first."""
        n = self.spec["max_new_tokens"]
        [prompt] = self.evaluation.prompts([question], lambda ids: self._runner(AR_METHOD, None)(ids, n).tokens)
        k = shift % len(todo)
        gens = {key: self._runner(*key)(prompt.ids, n) for key in todo[k:] + todo[:k]}
        if (AR_METHOD, None) in gens:
            reference = gens[AR_METHOD, None].tokens
        rows = []
        for method, budget in todo:
            gen = gens[method, budget]
            row = self.evaluation.judge(method, prompt, gen, reference, budget)
            rows.append({**row, "pair": self.spec["pair"], "target": self.spec["target"],
                         "middle": self.spec["middle"], "dtype": self.spec["dtype"], "torch_dtype": self.torch_dtype,
                         "output_ids": gen.tokens})
        return rows


# -- the driver -----------------------------------------------------------------------------------------
@dataclass
class Unit:
    """One question of one (pair, dtype) with the cells it still lacks: one `SweepWorker.run` call."""

    group: str
    index: int  # the question's place in the selection
    question: Question
    todo: list[tuple[str, int | None]]
    reference: list[int] | None  # ar's stored tokens when ar is done


def _manifest(grid: Grid, out: Path) -> dict:
    """DIR/sweep.json for this grid, merged with the one already in DIR; GridError if they disagree."""
    new = {"max_new_tokens": grid.max_new_tokens,
           "pairs": {p.name: {"target": p.target, "middle": p.middle, "scheduler": p.scheduler} for p in grid.pairs}}
    path = out / MANIFEST
    if not path.is_file():
        return new
    old = json.loads(path.read_text())
    if old.get("max_new_tokens") != grid.max_new_tokens:
        raise GridError(f"{out} holds a sweep with max_new_tokens {old.get('max_new_tokens')}, the grid asks for "
                        f"{grid.max_new_tokens}: keep the number or pass a new --out")
    for name, models in new["pairs"].items():
        if old["pairs"].get(name, models) != models:
            raise GridError(f"{out} holds pair {name!r} as {old['pairs'][name]}, the grid has {models}: rename the "
                            "pair or pass a new --out")
    return {**new, "pairs": {**old["pairs"], **new["pairs"]}}


def _sources(pair: Pair, cache_dir: str | None) -> tuple[str, str]:
    """Loadable sources of the pair (embedded names prepared), their tokenizers checked: no weights loaded."""
    target, middle = (resolve_model_path(src, cache_dir) for src in (pair.target, pair.middle))
    check_tokenizers(load_tokenizer(target), load_tokenizer(middle), pair.target, pair.middle)
    if pair.scheduler and not Path(pair.scheduler).is_file():
        raise GridError(f"pair {pair.name!r}: scheduler artifact {pair.scheduler} does not exist")
    return target, middle


def _keys(grid: Grid) -> list[tuple[str, int | None]]:
    return [(m, b) for m in grid.methods for b in grid.cells_of(m)]


def plan(grid: Grid, out: Path, questions: list[Question]) -> tuple[list[Unit], int, int]:
    """(units to run, cells in the grid, cells already done)."""
    units, total, done = [], 0, 0
    for pair in grid.pairs:
        for dtype in grid.dtypes:
            group = group_name(pair, dtype)
            for i, q in enumerate(questions):
                keys = _keys(grid)
                todo = [k for k in keys if not cell_path(out, group, q.benchmark, q.question_id, *k).is_file()]
                total, done = total + len(keys), done + len(keys) - len(todo)
                if todo:
                    reference = None
                    if (AR_METHOD, None) not in todo:
                        ar = cell_path(out, group, q.benchmark, q.question_id, AR_METHOD, None)
                        reference = read_cell(ar)["output_ids"]
                    units.append(Unit(group, i, q, todo, reference))
    return units, total, done


def _connect(address: str | None) -> bool:
    """Join the cluster at `address` (or RAY_ADDRESS, as under `ray job submit`), else start a local one;
    True if this call started Ray (and so shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    local = address is None and not os.environ.get("RAY_ADDRESS")
    ray.init(address=address, logging_level="WARNING",
             **({"include_dashboard": False, "object_store_memory": LOCAL_OBJECT_STORE} if local else {}))
    return True


def run_units(grid: Grid, out: Path, units: list[Unit], sources: dict, args) -> None:
    """Every unit on a pool of `args.workers` actors, one (pair, dtype) after another; cells are written as
    their rows come back."""
    import ray
    from ray.util import ActorPool

    owns = _connect(args.address)
    actors = []
    try:
        threads = args.threads or max(1, int(args.cpus_per_worker))
        by_group = {}
        for u in units:
            by_group.setdefault(u.group, []).append(u)
        size = min(args.workers, max(map(len, by_group.values())))
        cls = ray.remote(SweepWorker).options(num_cpus=args.cpus_per_worker, num_gpus=args.gpus_per_worker)
        actors = [cls.remote(args.device, threads, args.cache_dir) for _ in range(size)]
        bar = tqdm(total=sum(len(u.todo) for u in units), desc="sweep", unit="cell", file=sys.stderr)
        for pair in grid.pairs:
            for dtype in grid.dtypes:
                group = group_name(pair, dtype)
                if group not in by_group:
                    continue
                spec = {"pair": pair.name, "target": pair.target, "middle": pair.middle, "scheduler": pair.scheduler,
                        "target_source": sources[pair.name][0], "middle_source": sources[pair.name][1],
                        "dtype": dtype, "methods": list(grid.methods), "budgets": list(grid.budgets),
                        "benchmarks": list(grid.benchmarks), "max_new_tokens": grid.max_new_tokens}
                bar.set_postfix_str(f"{group}: loading the pair")
                ran_in = set(ray.get([a.load.remote(spec) for a in actors]))
                tqdm.write(f"sweep: {group}: {len(by_group[group])} questions on {len(actors)} workers "
                           f"({', '.join(sorted(ran_in))})", file=sys.stderr)
                pool = ActorPool(actors)
                work = pool.map_unordered(lambda a, u: a.run.remote(u.question, u.todo, u.reference, u.index),
                                          by_group[group])
                for rows in work:
                    for row in rows:
                        write_cell(cell_path(out, group, row["benchmark"], row["prompt_id"], row["method"],
                                             row["budget"]), row)
                    bar.set_postfix_str(f"{group} {rows[0]['benchmark']}/{rows[0]['prompt_id']}")
                    bar.update(len(rows))
        bar.close()
    finally:
        for a in actors:
            ray.kill(a)
        if owns:
            ray.shutdown()


def finish(grid: Grid, out: Path, questions: list[Question]) -> list[tuple]:
    """DIR/results.parquet from every cell of the grid; per (pair, dtype) the summary, table and chart of
    `treegraft eval` (a tree method per budget when there are several), all tables in DIR/summary.md and on
    stdout. Returns the mismatches of our methods as (group, method label, benchmark, question)."""
    everything, tables, mismatches = [], [], []
    labels = [grid.label(m, b) for m, b in _keys(grid)]
    for pair in grid.pairs:
        for dtype in grid.dtypes:
            group = group_name(pair, dtype)
            rows = [read_cell(cell_path(out, group, q.benchmark, q.question_id, m, b))
                    for q in questions for m, b in _keys(grid)]
            everything += rows
            labelled = [{**r, "method": grid.label(r["method"], r["budget"])} for r in rows]
            summary = summarize(pa.Table.from_pylist(labelled), labels)
            summary.write(out / group)
            tables.append(f"## {group}\n\n{summary.table()}\n")
            mismatches += [(group, label["method"], r["benchmark"], r["prompt_id"]) for r, label in zip(rows, labelled)
                           if row_verdict(r) == MISMATCH and is_ours(r["method"])]
    write_parquet(out / RESULTS, pa.Table.from_pylist(everything))
    write_text(out / "summary.md", "\n".join(tables))
    print("\n".join(tables))
    print(f"results: {out / RESULTS} ({len(everything)} rows)\nsummary: {out / 'summary.md'}\ncharts: "
          + ", ".join(str(out / group_name(p, d) / "speedup.png") for p in grid.pairs for d in grid.dtypes))
    return mismatches


def sweep(args) -> int:
    grid = load_grid(args.grid)
    out = Path(args.out).absolute()
    manifest = _manifest(grid, out)
    questions = select_questions(EvalConfig(benchmarks=list(grid.benchmarks),
                                            prompts_per_benchmark=grid.prompts_per_benchmark))
    sources = {pair.name: _sources(pair, args.cache_dir) for pair in grid.pairs}
    write_json(out / MANIFEST, manifest)
    units, total, done = plan(grid, out, questions)
    print(f"sweep: {total} cells ({len(grid.pairs)} pairs x {len(grid.dtypes)} dtypes x {len(questions)} questions "
          f"x {len(_keys(grid))} methods and budgets) in {out}: {done} already done (skipped), {total - done} to run",
          flush=True)
    if units:
        start = time.perf_counter()
        try:
            run_units(grid, out, units, sources, args)
        except Exception as e:
            import ray

            if not isinstance(e, ray.exceptions.RayError):
                raise
            print(f"sweep: error: a worker failed ({e}); the cells it finished are kept: fix the cause and rerun the "
                  "same command to resume", file=sys.stderr)
            return 1
        print(f"sweep: ran {total - done} cells in {time.perf_counter() - start:.0f} s", flush=True)
    mismatches = finish(grid, out, questions)
    if mismatches:
        print(f"sweep: error: {len(mismatches)} outputs differ from ar: "
              + ", ".join(f"{m} on {g} {b}/{q}" for g, m, b, q in mismatches[:10]), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--grid", required=True, help=f"YAML grid file (e.g. {EXAMPLE})")
    p.add_argument("--out", required=True, help="output folder on the driver's machine (absolute under `ray job "
                                                "submit`: the job runs in an uploaded copy of the working dir)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS as set by `ray job "
                                                   "submit`, else a new local cluster)")
    p.add_argument("--workers", type=int, default=1, help="actors, each holding one loaded pair (default: 1)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs a worker reserves (default: 1)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs a worker reserves (default: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: its CPUs)")
    p.add_argument("--device", default="auto", help="cpu, cuda ... in the workers (default: cuda if available)")
    p.add_argument("--cache-dir", default=None, help="where embedded models are prepared and profiles cached "
                                                     "(env TREEGRAFT_CACHE)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for name in ("workers", "threads"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise GridError(f"--{name} must be at least 1, got {getattr(args, name)}")
        if args.cpus_per_worker <= 0 or args.gpus_per_worker < 0:
            raise GridError("--cpus-per-worker must be > 0 and --gpus-per-worker >= 0")
        if RAY_JOB_ENV in os.environ and not Path(args.out).is_absolute():
            raise GridError(f"--out {args.out} is relative, and this job runs in a temporary copy of the working "
                            "directory that Ray deletes: give an absolute path (e.g. \"$PWD/out/sweep\")")
        return sweep(args)
    except (GridError, ModelError, BenchmarkError, PrepareError) as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
