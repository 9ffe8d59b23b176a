"""Served against in-process decoding, one request at a time: what the actors cost a single request.

  .venv/bin/python -m jobs.bench.serve [--pair embedded|tiny] [--prompts 2] [--tokens 32] [--repeats 3]
        [--methods ar,treegraft] [--dtype auto] [--budget 64] [--served-threads N] [--also-threads N]
        [--worker-niceness N] [--linear same|auto|compact|packed|stock]

Both sides are loaded at once and take turns, request by request: the in-process `Decoder` (what `treegraft
generate` runs) and a `DistributedEngine` on a local Ray cluster with `for_device("cpu")`'s resources (what
`treegraft serve` puts behind its API), on the same prompts (chat-formatted benchmark first turns), in the same
precision (`--dtype auto` is resolved once here and both sides are given its result) and on the same kernels
(`--linear same`: the linear path and the middle's int8 choice this process's probes pick, set in
$TREEGRAFT_LINEAR and $TREEGRAFT_DRAFT_INT8 for the workers too; each process probes on its own otherwise, and a
near tie can send them different ways). `treegraft` is the server's default method on both sides: for the
embedded pair the scheduler fitted for this device, found as `treegraft serve` finds it, at the budget it was
fitted for (`--budget` overrides); the shallow-tree heuristic for the tiny pair. Every request is timed from the caller (for the engine: submit to result,
every actor call included); each side and method is warmed up once, untimed, before any timed request (kernels,
probes, the target's forward timing the heuristic reads). Within a repeat each prompt runs on every side in
turn, the order rotated every repeat, so a neighbour's load falls on all alike; the ratio to in-process is taken
per repeat and the table gives the median.
`--also-threads N` adds a third side in the same turns: the same engine with its target and middle actors
switched to N torch threads for the request (torch.set_num_threads through __ray_call__), e.g. 1, what they ran
with while Ray's OMP_NUM_THREADS set them, so a before and after come from one run on one machine's load.

`--served-threads N` starts the engine's model actors on N torch threads instead of for_device's choice (their
probes then run on N threads too). Ray runs its workers at niceness 15, so where other processes compete for the
cores the actors get a fraction of what this process gets at 0: the workers run at this process's niceness
unless `--worker-niceness` says otherwise (15: Ray's default, as `treegraft serve` runs them). The lines above
the table give each actor's torch threads and niceness, the linear path of each model, the resident memory of
the served target worker and what loading the target added to this process's. Prints a Markdown table.
Memory: both sides of the embedded pair in fp32 hold about 13 GB on the compact path, about 22 GB on the packed
one (`--linear compact` keeps a 24 GB machine clear of that when a busy probe would pick packed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import psutil
import ray
import torch

from actors.engine import DistributedEngine
from actors.resources import for_device
from jobs.bench.common import bench_prompts, pair_paths, pin_kernels, served_default, start_ray
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import AR_METHOD, Decoder
from treegraft_dist.decoding.scheduler import fitted_tree
from treegraft_dist.models import kernels, precision
from treegraft_dist.models.loading import DTYPES, check_pair, load_model, pick_dtype

IN_PROCESS, SERVED = "in-process", "served"


def resident_gb(pid: int | None = None) -> float:
    return psutil.Process(pid).memory_info().rss / 1e9


def linear_path(lm) -> str:
    return "compact" if lm.compact else "packed" if lm.packed else "stock"


def actor_facts(engine: DistributedEngine) -> dict[str, dict]:
    """Torch threads, niceness, $OMP_NUM_THREADS, pid and linear path of every actor (a look inside through
    __ray_call__)."""

    def facts(actor):
        lm = getattr(actor, "lm", None)
        return {"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(),
                "nice": os.nice(0), "linears": None if lm is None else linear_path(lm),
                "int8": None if lm is None else lm.quantized}

    handles = engine.actors()
    named = {"coordinator": engine.coordinator, "target": handles["target"][0], "middle": handles["middle"],
             "ngram": handles["ngram"]}
    return {k: ray.get(h.__ray_call__.remote(facts)) for k, h in named.items() if h is not None}


def set_model_threads(engine: DistributedEngine, threads: int) -> None:
    """torch.set_num_threads(threads) in the engine's target and middle actors (a look inside, between requests)."""
    handles = engine.actors()
    ray.get([h.__ray_call__.remote(lambda _: torch.set_num_threads(threads))
             for h in (*handles["target"], handles["middle"]) if h is not None])


def served_on(engine: DistributedEngine, threads: int, usual: int, eos: tuple[int, ...]):
    """A side that runs a request on the engine with its model actors switched to `threads` torch threads."""

    def run(prompt, n, method):
        set_model_threads(engine, threads)
        try:
            return engine.generate(prompt, n, method, eos)  # "treegraft" names the engine's policy
        finally:
            set_model_threads(engine, usual)
    return run


def timed(run) -> tuple[object, float]:
    t = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("tiny", "embedded"), default="embedded")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="ar,treegraft")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    ap.add_argument("--budget", type=int, default=None,
                    help="nodes verified per round (default: what the server would verify at)")
    ap.add_argument("--served-threads", type=int, default=None,
                    help="torch threads of the engine's model actors (default: for_device's)")
    ap.add_argument("--also-threads", type=int, default=None,
                    help="also run every request on the engine with its model actors switched to this many threads")
    ap.add_argument("--worker-niceness", type=int, default=os.nice(0),
                    help="niceness of the Ray workers (default: this process's; Ray's own default is 15)")
    ap.add_argument("--linear", choices=("same", "auto", *kernels.LINEAR_MODES[1:]), default="same",
                    help="same: both sides run the linear path this process's probes pick; compact, packed, "
                         "stock: that path; either way the middle's int8 choice is this process's too; auto: each "
                         "process decides both")
    args = ap.parse_args()
    methods = args.methods.split(",")
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"dtype: {dtype_name}" + (f" ({precision.describe(torch.device('cpu'))})" if args.dtype == "auto" else ""),
          flush=True)
    if args.linear != "auto":
        print(f"on both sides: {pin_kernels(dtype, None if args.linear == 'same' else args.linear)}", flush=True)
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # read by the raylet start_ray starts
    start_ray(num_cpus=os.cpu_count())
    res = for_device("cpu", 1)
    if args.served_threads is not None:
        res = dataclasses.replace(res, torch_threads=args.served_threads)
    rows: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as d:
        t_path, m_path, tok = pair_paths(args.pair, d)
        default, budget, which = served_default(args.pair, t_path, m_path, dtype_name, res.torch_threads)
        args.budget = args.budget or budget
        print(f"treegraft: {which}; budget {args.budget}", flush=True)
        tree = fitted_tree(TreeConfig(budget=args.budget), default, budget=False)  # the width it was fitted for

        def policy(method: str):  # in process; the engine holds it by name, as the server's requests name it
            return default if method == "treegraft" else method

        eos = tuple(sorted({i for i in (tok.eos_token_id,) if i is not None}))
        prompts = bench_prompts(tok, args.prompts)
        # The engine first: its workers' loading peaks (file pages and the copies made from them) do not meet
        # this process's.
        engine = DistributedEngine(t_path, m_path, tree, res, dtype=dtype_name, policies={"treegraft": default})
        try:
            engine.warm()  # as the server does before it answers
            facts = actor_facts(engine)
            before = resident_gb()
            target = load_model(t_path, "cpu", dtype_name, tok)
            loaded_gb = resident_gb() - before
            middle = load_model(m_path, "cpu", dtype_name, tok, drafter=True)
            check_pair(target, middle)
            decoder = Decoder(target.lm, middle.lm, tree)
            sides = {IN_PROCESS: lambda p, n, m: decoder.generate(p, n, policy(m), eos),
                     SERVED: lambda p, n, m: engine.generate(p, n, m, eos)}
            if args.also_threads is not None:
                sides[f"served, {args.also_threads} threads"] = served_on(engine, args.also_threads,
                                                                           facts["target"]["threads"], eos)
            for m in methods:  # warm-up, untimed
                for run in sides.values():
                    run(prompts[0], 4, m)
            print(f"torch threads (niceness): driver {torch.get_num_threads()} ({os.nice(0)}), "
                  + ", ".join(f"{k} {v['threads']} ({v['nice']})" for k, v in facts.items())
                  + f"; the actors' OMP_NUM_THREADS={facts['target']['omp']}")
            print(f"linear paths: in process target {linear_path(target.lm)}, middle {linear_path(middle.lm)}"
                  f"{' in int8' if middle.lm.quantized else ''}; served target {facts['target']['linears']}, middle "
                  f"{facts['middle']['linears']}{' in int8' if facts['middle']['int8'] else ''}")
            print(f"resident memory: served target worker {resident_gb(facts['target']['pid']):.2f} GB; loading the "
                  f"target in process added {loaded_gb:.2f} GB to this one", flush=True)
            for rep in range(args.repeats):
                try:
                    done = run_repeat(rep, sides, methods, prompts, args.tokens)
                except Exception as e:  # a lost actor, say: the table gives the repeats that finished
                    print(f"repeat {rep} stopped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                    break
                for key, timed_runs in done.items():
                    rows.setdefault(key, []).extend(timed_runs)
        finally:
            engine.shutdown()
    if rows:
        report(rows, methods, list(sides), args, dtype_name, res)
    ray.shutdown()


def run_repeat(rep: int, sides: dict, methods: list[str], prompts: list[list[int]], tokens: int) -> dict:
    """{(method, side): [(repeat, prompt index, Generation, seconds)]} of one repeat: each prompt on every side
    in turn, the order rotated every repeat."""
    names = list(sides)
    order = names[rep % len(names):] + names[: rep % len(names)]
    if rep % 2:
        order.reverse()
    out: dict[tuple[str, str], list] = {}
    for m in methods:
        for i, p in enumerate(prompts):
            for side in order:
                gen, wall = timed(lambda: sides[side](p, tokens, m))
                out.setdefault((m, side), []).append((rep, i, gen, wall))
                print(f"  repeat {rep} {m:>9} prompt {i} {side:>18}: {len(gen.tokens) / wall:5.2f} tok/s, "
                      f"{gen.stats.rounds} rounds, {statistics.mean(gen.stats.tree_sizes or [1]):.1f} nodes/round",
                      flush=True)
    return out


def report(rows: dict, methods: list[str], sides: list[str], args, dtype_name: str, res) -> None:
    def per_repeat(m, side):  # tokens/s over the repeat's prompts
        out = {}
        for rep, _, gen, wall in rows[m, side]:
            n, s = out.get(rep, (0, 0.0))
            out[rep] = (n + len(gen.tokens), s + wall)
        return {rep: n / s for rep, (n, s) in out.items()}

    repeats = len({rep for rep, *_ in next(iter(rows.values()))})
    print(f"\n{args.pair} pair, {args.prompts} prompts x {args.tokens} new tokens, one request at a time, dtype "
          f"{dtype_name}, budget {args.budget}, served model actors on {res.torch_threads} torch threads at niceness "
          f"{args.worker_niceness}, median of {repeats} repeats (ratios: per repeat, against in-process)\n")
    print("| method | side | tok/s | vs in-process | rounds | accepted/round | nodes/round | same ids as in-process |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        base = per_repeat(m, IN_PROCESS)
        for side in sides:
            tps = per_repeat(m, side)
            ratio = statistics.median(tps[r] / base[r] for r in tps)
            stats = [g.stats for _, _, g, _ in rows[m, side]]
            accepted = f"{statistics.mean(s.mean_accepted for s in stats):.2f}" if m != AR_METHOD else "-"
            nodes = f"{statistics.mean(n for s in stats for n in s.tree_sizes or [1]):.1f}" if m != AR_METHOD else "-"
            same = sum(a[2].tokens == b[2].tokens for a, b in zip(rows[m, IN_PROCESS], rows[m, side]))
            print(f"| {m} | {side} | {statistics.median(tps.values()):.2f} | {ratio:.2f}x | "
                  f"{statistics.mean(s.rounds for s in stats):.1f} | {accepted} | {nodes} | {same}/{len(stats)} |")


if __name__ == "__main__":
    main()
