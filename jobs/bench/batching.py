"""Batched verification across requests: throughput and latency at 1, 4, 8 and 16 requests in flight, with
speculation on and off, on one distributed engine, side by side in one run.

  .venv/bin/python -m jobs.bench.batching [--pair embedded|tiny] [--tokens 32] [--concurrency 1,4,8,16]
        [--methods ar,all-small,all-small@fixed,treegraft] [--dtype auto] [--threads N]

`ar` is the same engine with speculation off (its steps are batched across requests too, so it is the
fastest plain decoding this engine does under load). `treegraft` is what the server runs by default: for the
embedded pair the scheduler fitted for this device (as `treegraft serve` and `treegraft eval` fit it), at the
budget it was fitted for unless `--budget` says otherwise; the shallow-tree heuristic for the tiny pair.
`@fixed` runs a method without the load-adapted budget (Resources.adapt_budget=False), to show what the
adaptation buys. Each cell: total generated tokens per
second over all requests, and per-request latency (submit to result; mean and 90th percentile). Every
output is compared with `ar`'s at the same concurrency and prompt: `exact` or, in bf16, a near-tie of the
target's logits is what lossless decoding may give (lossless.classify, with the target loaded after the runs);
the table gives exact/near-tie/mismatch per run.
Requests are benchmark prompts (chat-formatted first turns, spread over the six benchmarks).
`--alone K` makes the 1-request cell K prompts (over the six benchmarks) sent one at a time, each alone in
flight: one prompt says little about a request alone. `--repeats N` runs every cell N times, rotating the methods' order, and the table gives the median.
Each cell also counts the target's forward passes and the requests' pieces of work a pass held on average
(prefill chunks, trees, plain steps). Prints a Markdown table; `--out FILE.parquet` also writes the rows (one per run).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

from actors.engine import DistributedEngine
from actors.resources import for_device
from jobs.bench.common import bench_prompts, pair_paths, served_default, start_ray
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.scheduler import fitted_tree


def run_cell(engine, prompts, tokens, method, eos, one_at_a_time=False):
    """All `prompts` at once, or `one_at_a_time` (each request alone in flight, the next sent when it ends)."""
    t0 = time.perf_counter()
    if one_at_a_time:
        gens, lat = [], []
        for p in prompts:
            start = time.perf_counter()
            gens.append(engine.result(engine.submit(p, tokens, method, eos)))
            lat.append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
        return gens, sum(len(g.tokens) for g in gens) / wall, statistics.mean(lat), sorted(lat)[
            max(0, int(0.9 * len(lat)) - 1)]
    refs = [engine.submit(p, tokens, method, eos) for p in prompts]
    outs, lat = [], []
    pending = dict(zip([r for r in refs], range(len(refs))))
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(done[0])
        outs.append((i, engine.result(done[0])))
        lat.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    outs.sort(key=lambda x: x[0])
    gens = [g for _, g in outs]
    n = sum(len(g.tokens) for g in gens)
    return gens, n / wall, statistics.mean(lat), sorted(lat)[max(0, int(0.9 * len(lat)) - 1)]


def judge(rows: list[dict], prompts: list[list[int]], target_path: str, dtype: str) -> None:
    """Each run's outputs against ar's at the same concurrency, by the target's own logits at the first
    difference (lossless.classify): exact, near-tie (bf16 rounding) or mismatch. The target is loaded here
    once the engines are gone."""
    from treegraft_dist.evaluation.lossless import EXACT, MISMATCH, NEAR_TIE, classify
    from treegraft_dist.models.loading import load_model

    lm = None
    if any(o != r for row in rows if row["reference"] for o, r in zip(row["outputs"], row["reference"])):
        lm = load_model(target_path, "cpu", dtype).lm
    for row in rows:
        reference = row["reference"] or row["outputs"]  # no ar run at this concurrency: nothing to judge
        verdicts = [EXACT if o == r else classify(lm, prompts[i], r, o).verdict
                    for i, (o, r) in enumerate(zip(row["outputs"], reference))]
        row.update(exact=verdicts.count(EXACT), near_tie=verdicts.count(NEAR_TIE), mismatch=verdicts.count(MISMATCH))
        del row["outputs"], row["reference"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("tiny", "embedded"), default="embedded")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--methods", default="ar,all-small,all-small@fixed,01001")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--budget", type=int, default=None,
                    help="nodes verified per round (default: what the server would verify at)")
    ap.add_argument("--deepen", type=int, default=TreeConfig.deepen,
                    help="middle layers a round may draft past the depth (default %(default)s, as the server)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every concurrency's methods this many times, each time in the next rotation of "
                         "their order; the table gives the median tokens/s (the box drifts between cells)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each model actor (default: for_device's, the cores a plain process uses)")
    ap.add_argument("--alone", type=int, default=1,
                    help="at concurrency 1, this many prompts (over the six benchmarks) sent one at a time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    start_ray()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        t_path, m_path, tok = pair_paths(args.pair, d)
        eos = tuple(sorted({i for i in (tok.eos_token_id,) if i is not None}))
        prompts = bench_prompts(tok, max(levels + [args.alone]))
        default, budget, which = served_default(args.pair, t_path, m_path, args.dtype,
                                                args.threads or for_device("cpu", 1).torch_threads)
        args.budget = args.budget or budget
        print(f"treegraft: {which}; budget {args.budget}", flush=True)
        tree = fitted_tree(TreeConfig(budget=args.budget, deepen=args.deepen), default, budget=False)  # its width
        engines = {}
        for adapt in sorted({not m.endswith("@fixed") for m in methods}):
            threads = {} if args.threads is None else {"torch_threads": args.threads}
            res = for_device("cpu", 1, max_requests=max(levels), adapt_budget=adapt, **threads)
            engines[adapt] = DistributedEngine(t_path, m_path, tree, res, dtype=args.dtype,
                                               policies={"treegraft": default})  # as the server holds it
        try:
            for eng in engines.values():  # warm-up: kernels, forward times, the pass-cost profile (as the server)
                eng.warm()
                run_cell(eng, prompts[:2], 4, "all-small", eos)
            for c in levels:
                cells = []
                for rep in range(args.repeats):
                    for m in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                        name, adapt = m.removesuffix("@fixed"), not m.endswith("@fixed")
                        method = name  # "treegraft" names the engine's policy, as a served request does
                        before = engines[adapt].target_passes()
                        alone = c == 1 and args.alone > 1
                        gens, tput, mean_lat, p90 = run_cell(engines[adapt], prompts[:args.alone if alone else c],
                                                             args.tokens, method, eos, one_at_a_time=alone)
                        passes, items = (b - a for a, b in zip(before, engines[adapt].target_passes()))
                        acc = statistics.mean(g.stats.mean_accepted for g in gens)
                        size = statistics.mean(n for g in gens for n in g.stats.tree_sizes or [1])
                        cells.append((gens, dict(concurrency=c, method=m, repeat=rep, tokens_per_s=tput,
                                                 mean_latency_s=mean_lat, p90_latency_s=p90,
                                                 accepted_per_round=acc, tree_size=size, passes=passes,
                                                 items_per_pass=items / max(passes, 1))))
                        print(f"  {c:>2} requests {m:>16}: {tput:6.1f} tok/s, latency mean {mean_lat:5.1f} s "
                              f"p90 {p90:5.1f} s, {acc:.2f} tokens/round, {size:.1f} nodes/round, {passes} target "
                              f"passes of {items / max(passes, 1):.1f} requests' work; seconds a request: "
                              + ", ".join(f"{k} {sum(g.stats.seconds.get(k, 0.0) for g in gens) / len(gens):.2f}"
                                          for k in gens[0].stats.seconds), flush=True)
                ref = next((g for g, r in cells if r["method"] == "ar"), None)
                for gens, r in cells:
                    r["outputs"] = [g.tokens for g in gens]
                    r["reference"] = None if ref is None else [x.tokens for x in ref]
                    rows.append(r)
        finally:
            for eng in engines.values():
                eng.shutdown()
        judge(rows, prompts, t_path, args.dtype)
    print(f"\n{args.pair} pair, {args.tokens} new tokens per request, dtype {args.dtype}, budget {args.budget}, "
          f"{res.torch_threads} torch threads per model actor, {torch.get_num_threads()} cores seen, median of "
          f"{args.repeats} run(s) per cell\n")
    print("| requests | method | tokens/s (all) | vs ar | mean latency s | p90 latency s | tokens/round | nodes/round "
          "| target passes | requests a pass | exact/near-tie/mismatch vs ar, per run |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for r in rows:
        table.setdefault((r["concurrency"], r["method"]), []).append(r)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in table.items()}
    for (c, m), group in table.items():
        ratio = med[c, m] / med[c, "ar"] if (c, "ar") in med else float("nan")
        mean = {k: statistics.mean(x[k] for x in group) for k in ("mean_latency_s", "p90_latency_s",
                                                                  "accepted_per_round", "tree_size", "passes",
                                                                  "items_per_pass")}
        verdicts = ", ".join(f"{x['exact']}/{x['near_tie']}/{x['mismatch']}" for x in group)
        print(f"| {c} | {m} | {med[c, m]:.1f} | {ratio:.2f}x | {mean['mean_latency_s']:.1f} | {mean['p90_latency_s']:.1f} "
              f"| {mean['accepted_per_round']:.2f} | {mean['tree_size']:.1f} | {mean['passes']:.0f} "
              f"| {mean['items_per_pass']:.1f} | {verdicts} |")
    if args.out:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from treegraft_dist.files import replacing

        with replacing(args.out) as tmp:
            pq.write_table(pa.Table.from_pylist(rows), tmp)
    ray.shutdown()


if __name__ == "__main__":
    main()
