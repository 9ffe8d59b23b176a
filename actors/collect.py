"""`treegraft collect` as a Ray Data pipeline: prompts as a dataset, a pool of actors that hold the two
models, one Parquet file of rounds per prompt.

    prompts (ray.data.from_items) -> map_batches(CollectWorker, compute=ActorPoolStrategy(size=N))
                                  -> OUT/rounds/<benchmark>--<question>.parquet (schema: collect.ROUND_SCHEMA)

Before the pipeline, one remote task measures the device cost model with the models loaded; it goes to
OUT/collect.json with the model pair, tree settings and budgets. Every later run over OUT reuses that
manifest (and refuses other settings), so a resumed collection prices all rounds alike. A worker writes a
prompt's file whole (temporary file, then rename) and skips prompts whose file exists: an interrupted run
loses at most the prompts in flight and never duplicates one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch
from tqdm import tqdm

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import CANDIDATES, CostModel, device_costs, profile_key
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from treegraft_dist.files import write_json, write_parquet
from treegraft_dist.models.loading import load_model, load_tokenizer
from treegraft_dist.scheduling.collect import (
    HELD_OUT_BENCHMARKS,
    MANIFEST,
    ROUNDS_DIR,
    SCHEMA_VERSION,
    Collector,
    part_name,
    records_table,
)
from treegraft_dist.scheduling.device import PROFILE_KEY

LOCAL_OBJECT_STORE = 512 * 1024**2
COLLECT_BENCHMARKS = tuple(b for b in BENCHMARKS if b not in HELD_OUT_BENCHMARKS)


@dataclass
class CollectConfig:
    """target/middle: loadable sources (folders or hub ids) every node can read; pair: the names the
    artifact records for them. Questions [first_question, first_question + prompts_per_benchmark) of each
    benchmark are collected (the evaluation uses the first ones, so keep first_question above its count)."""

    target: str
    middle: str
    pair: tuple[str, str]
    out: Path
    benchmarks: tuple[str, ...] = COLLECT_BENCHMARKS
    prompts_per_benchmark: int = 8
    first_question: int = 20
    max_new_tokens: int = 64
    tree: TreeConfig = field(default_factory=TreeConfig)
    device: str = "auto"
    dtype: str = "auto"
    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    threads: int | None = None  # torch threads per actor (default: this machine's cores / actors)
    cache_dir: Path | None = None  # where latency profiles are cached

    def __post_init__(self):
        self.out = Path(self.out)
        held = [b for b in self.benchmarks if b in HELD_OUT_BENCHMARKS]
        if held:
            raise ValueError(f"{', '.join(held)} is held out of the offline stage (it measures the scheduler on a "
                             f"benchmark it never saw): collect on {', '.join(COLLECT_BENCHMARKS)}")
        for b in self.benchmarks:
            builtin(b)
        for name in ("prompts_per_benchmark", "max_new_tokens", "actors"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.first_question < 0:
            raise ValueError(f"--first-question must be >= 0, got {self.first_question}")

    def settings(self) -> dict:
        """What must match between runs over one output folder."""
        return {"pair": list(self.pair), "tree": self.tree.to_dict(), "max_new_tokens": self.max_new_tokens}


def _load(cfg: dict):
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    target = load_model(cfg["target"], cfg["device"], cfg["dtype"])
    middle = load_model(cfg["middle"], cfg["device"], cfg["dtype"], drafter=True)
    return target, middle


def _measure(cfg: dict, context: list[int]) -> dict:
    target, middle = _load(cfg)
    cache = Path(cfg["cache_dir"]) if cfg.get("cache_dir") else None
    from treegraft_dist.models.paths import cache_root

    cost = device_costs(target.lm, target.source, middle.lm, middle.source, cache_root(cache), context,
                        TreeConfig(**cfg["tree"]))
    # A scheduler fitted on these costs as recorded applies on this profile only (treegraft_dist/scheduling/device.py).
    return {**cost.to_dict(), PROFILE_KEY: profile_key(target.lm, target.source, middle.lm, middle.source)}


class CollectWorker:
    """One pool actor: both models loaded once, then one prompt per batch row."""

    def __init__(self, cfg: dict, cost: dict):
        self.target, middle = _load(cfg)
        self.cfg = cfg
        self.cost = CostModel.from_dict(cost)
        self.collector = Collector(self.target.lm, middle.lm, TreeConfig(**cfg["tree"]), self.cost,
                                   tuple(cfg["budgets"]))
        self.rounds_dir = Path(cfg["out"]) / ROUNDS_DIR

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # column -> [rows], in and out
        done = {"benchmark": [], "prompt_id": [], "rounds": [], "seconds": [], "skipped": []}
        for bench, qid, ids in zip(batch["benchmark"], batch["prompt_id"], batch["ids"]):
            bench, qid, ids = str(bench), str(qid), [int(t) for t in ids]
            path = self.rounds_dir / part_name(bench, qid)
            start = time.perf_counter()
            skipped = path.exists()
            rounds = 0
            if not skipped:
                records = self.collector.rounds(ids, self.cfg["max_new_tokens"], self.target.eos_ids)
                write_parquet(path, records_table(records, bench, qid, len(ids), self.collector.budgets, self.cost))
                rounds = len(records)
            for k, v in zip(done, (bench, qid, rounds, time.perf_counter() - start, skipped)):
                done[k].append(v)
        return {k: np.asarray(v) for k, v in done.items()}


@dataclass
class CollectReport:
    out: Path
    prompts: int  # prompts in the selection
    collected: int  # collected by this run
    skipped: int  # already there
    rounds: int  # rounds written by this run
    seconds: float


def prompts_for(cfg: CollectConfig) -> list[dict]:
    """The selected questions, benchmarks interleaved (a run stopped early still covers every benchmark)."""
    tokenizer = load_tokenizer(cfg.target)
    per_bench = [builtin(b)[cfg.first_question : cfg.first_question + cfg.prompts_per_benchmark]
                 for b in cfg.benchmarks]
    out = []
    for i in range(cfg.prompts_per_benchmark):
        for bench, questions in zip(cfg.benchmarks, per_bench):
            if i < len(questions):
                q = questions[i]
                out.append({"benchmark": bench, "prompt_id": q.question_id,
                            "ids": chat_prompt(tokenizer, [q.turns[0]], [])})
    if not out:
        raise ValueError(f"no questions from number {cfg.first_question} on in {', '.join(cfg.benchmarks)}: lower "
                         "--first-question")
    return out


def _manifest(cfg: CollectConfig, worker_cfg: dict, context: list[int], remote_opts: dict) -> dict:
    """The folder's manifest: read and checked if it exists, else written with a freshly measured cost model."""
    path = cfg.out / MANIFEST
    if path.is_file():
        manifest = json.loads(path.read_text())
        old = {k: manifest.get(k) for k in cfg.settings()}
        if manifest.get("schema_version") != SCHEMA_VERSION or old != cfg.settings():
            raise ValueError(f"{cfg.out} holds trajectories collected with other settings ({old}, schema "
                             f"{manifest.get('schema_version')}); resume with the same ones or pass a new --out")
        return manifest
    # max_calls=1: the worker process exits afterwards and gives back the memory of both models.
    cost = ray.get(ray.remote(max_calls=1)(_measure).options(**remote_opts).remote(worker_cfg, context))
    # Every candidate budget, whatever this device's profile: accepted lengths do not depend on the hardware,
    # so one collection serves the fit for any device (which prices them with its own costs).
    budgets = [b for b in CANDIDATES if b <= cfg.tree.budget]
    manifest = {"schema_version": SCHEMA_VERSION, **cfg.settings(), "cost_model": cost, "budgets": budgets,
                "benchmarks": list(cfg.benchmarks), "held_out": list(HELD_OUT_BENCHMARKS),
                "advance": "accepted length of the round's best schedule at the largest budget"}
    write_json(path, manifest)
    return manifest


def collect(cfg: CollectConfig, address: str | None = None) -> CollectReport:
    """Run (or resume) the collection on the Ray cluster at `address` (None: the one this process is in,
    or a new local one)."""
    start = time.perf_counter()
    prompts = prompts_for(cfg)
    owns = not ray.is_initialized()
    if owns:
        # Only token ids and small status rows travel through the object store: keep it small locally.
        local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(cfg.actors * cfg.cpus_per_actor)),
                 "object_store_memory": LOCAL_OBJECT_STORE}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **({} if address else local))
    try:
        threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.actors)
        worker_cfg = {"target": cfg.target, "middle": cfg.middle, "device": cfg.device, "dtype": cfg.dtype,
                      "tree": cfg.tree.to_dict(), "max_new_tokens": cfg.max_new_tokens, "out": str(cfg.out),
                      "threads": threads, "cache_dir": str(cfg.cache_dir) if cfg.cache_dir else None}
        opts = {"num_cpus": cfg.cpus_per_actor, "num_gpus": cfg.gpus_per_actor}
        manifest = _manifest(cfg, worker_cfg, prompts[0]["ids"], opts)
        worker_cfg["budgets"] = manifest["budgets"]
        rounds_dir = cfg.out / ROUNDS_DIR
        todo = [p for p in prompts if not (rounds_dir / part_name(p["benchmark"], p["prompt_id"])).exists()]
        collected = rounds = 0
        if todo:
            ds = ray.data.from_items(todo, override_num_blocks=len(todo))
            ds = ds.map_batches(CollectWorker, fn_constructor_kwargs={"cfg": worker_cfg, "cost": manifest["cost_model"]},
                                batch_size=1, compute=ray.data.ActorPoolStrategy(size=cfg.actors), **opts)
            bar = tqdm(total=len(todo), desc="collecting prompts", unit="prompt", file=sys.stderr)
            for row in ds.iter_rows():
                if not row["skipped"]:
                    collected += 1
                    rounds += int(row["rounds"])
                bar.set_postfix_str(f"{row['benchmark']}/{row['prompt_id']}: {row['rounds']} rounds "
                                    f"in {row['seconds']:.0f} s")
                bar.update()
            bar.close()
        return CollectReport(cfg.out, len(prompts), collected, len(prompts) - len(todo), rounds,
                             time.perf_counter() - start)
    finally:
        if owns:
            ray.shutdown()
