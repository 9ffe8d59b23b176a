"""Per-phase time of a decoding round on the embedded pair (bf16 by default), and where its time goes.

Decodes the first question of a few benchmarks (chat-formatted first turn) with `engine.Decoder` for every
method and budget, and prints per phase of RequestStats.seconds the ms per round (prefill: ms per request)
and the total per round (the wall time less the prefill, over the rounds).

    python -m jobs.bench.round                               # the working tree
    python -m jobs.bench.round --revs HEAD~1 HEAD            # two commits side by side
    python -m jobs.bench.round --revs HEAD . --repeats 2     # `.` is the working tree, edits included
    python -m jobs.bench.round --micro HEAD~1                # tree ops and prefill cache, HEAD~1 vs `.`
    python -m jobs.bench.round --profile cprofile            # where the time goes (or: torch)

Each revision's `treegraft_dist` (from `git archive`; `.` = a copy of the working tree) is imported under
its own name in this one process, and all of them drive the same loaded models, so a comparison costs the
memory of one pair. For every (prompt, method, budget) the revisions decode in turn, in an order that
alternates between repeats, so background load on the shared CPU falls on all of them alike. The last
column says whether a revision decoded exactly what the first one did: the same generated ids, the same
verified trees (tokens and parents of every pruned tree, hashed) and the same accepted lengths.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import sys
import time

import torch

from jobs.bench.common import GENERATE, PHASES, load_revisions, per_round_ms


# -- reports ------------------------------------------------------------------------------------------

def same_as(r: dict, ref: dict) -> bool:
    return r["tokens"] == ref["tokens"] and r["accepted"] == ref["accepted"] and r["trees"] == ref["trees"]


def configs(args) -> list[tuple[str, str, int]]:
    out = []
    for bench in args.benchmarks.split(","):
        for method in args.methods.split(","):
            budgets = [1] if method in ("ar", GENERATE) else [int(b) for b in args.budgets.split(",")]
            out.extend((bench, method, b) for b in budgets)
    return out


def table_row(label: str, ms: dict[str, float], same: bool) -> str:
    return f"  {label:<12}" + "".join(f"{ms[p]:>10.2f}" for p in PHASES + ("round",)) + \
        f"   {'yes' if same else 'NO'}"


def header() -> str:
    return f"  {'rev':<12}" + "".join(f"{p:>10}" for p in PHASES + ("round",)) + "   same"


def report_config(cfg: tuple, rep: int, revs: list[str], rows: list[dict]) -> None:
    bench, method, budget = cfg
    ref = rows[0]
    acc = sum(ref["accepted"]) / max(len(ref["accepted"]), 1)
    print(f"\n{bench} {method} budget {budget} (repeat {rep}): {ref['rounds']} rounds, {acc:.2f} accepted/round")
    print(header())
    for rev, r in zip(revs, rows):
        print(table_row(rev, per_round_ms(r), same_as(r, ref)))
    sys.stdout.flush()


def report_means(revs: list[str], results: dict) -> None:
    """Per (method, budget): mean ms per round over prompts and repeats, and each revision over the first."""
    groups: dict[tuple, list[list[dict]]] = {}
    for (_, method, budget), reps in results.items():
        groups.setdefault((method, budget), []).extend(reps)
    print("\n== mean over prompts and repeats: ms per round (prefill: ms per request); x REV = REV / first rev")
    for (method, budget), reps in groups.items():
        print(f"\n{method} budget {budget} ({len(reps)} requests)")
        print(header())
        means = []
        for i, rev in enumerate(revs):
            rows = [per_round_ms(rep[i]) for rep in reps]
            means.append({k: sum(r[k] for r in rows) / len(rows) for k in rows[0]})
            print(table_row(rev, means[i], all(same_as(rep[i], rep[0]) for rep in reps)))
        for i, rev in enumerate(revs[1:], 1):
            print(f"  {'x ' + rev:<12}" + "".join(f"{means[i][p] / means[0][p]:>10.2f}" if means[0][p] > 0
                                                   else f"{'-':>10}" for p in PHASES + ("round",)))
    sys.stdout.flush()


# -- modes --------------------------------------------------------------------------------------------

def compare(args) -> None:
    """Every config on every revision, alternating; the per-config and mean tables."""
    revisions = load_revisions(args.revs, args.dtype, args.with_middle)
    for r in revisions:  # untimed warm-up: one short decode per method
        for method in args.methods.split(","):
            r.decode(args.benchmarks.split(",")[0], method, 8, 8)
    results: dict[tuple, list[list[dict]]] = {}
    for rep in range(args.repeats):
        for cfg in configs(args):
            order = revisions if rep % 2 == 0 else revisions[::-1]
            got = {r.rev: r.decode(*cfg, args.new_tokens) for r in order}
            results.setdefault(cfg, []).append([got[rev] for rev in args.revs])
            report_config(cfg, rep, args.revs, results[cfg][-1])
    report_means(args.revs, results)


def micro(args) -> None:
    """The tree operations a round makes and the prefill cache, of `--micro REV` against the working tree,
    alternating, on the trees and prefill top-k of real requests (too fast to show in the phase times)."""
    import numpy as np

    revisions = load_revisions([".", args.micro], args.dtype, args.with_middle)
    new, old = ({"tree": importlib.import_module(f"{r.engine.__package__}.tree"),
                 "ngram": importlib.import_module(f"{r.engine.__package__}.ngram")} for r in revisions)
    trees, prefills = [], []
    engine = revisions[0].engine
    draft = engine.draft_tree
    verify = importlib.import_module(f"{engine.__package__}.verify")
    prefill = verify.TargetVerifier.prefill

    def recording_draft(*a, **kw):
        tree, calls = draft(*a, **kw)
        trees.append((tree.copy(), a[1].budget))
        return tree, calls

    def recording_prefill(verifier, prompt, want_prefill_cache=True):
        first, cache = prefill(verifier, prompt, want_prefill_cache)
        if cache is not None:
            prefills.append(cache)
        return first, cache

    engine.draft_tree, verify.TargetVerifier.prefill = recording_draft, recording_prefill
    for cfg in configs(args):
        revisions[0].decode(*cfg, args.new_tokens)

    def as_module(tree, mod):
        """The same tree as an instance of `mod`'s DraftTree."""
        out = mod["tree"].DraftTree.__new__(mod["tree"].DraftTree)
        out.__dict__.update({k: v.copy() if hasattr(v, "copy") else v for k, v in tree.__dict__.items()})
        return out

    inputs = {}
    for name, mod in (("old", old), ("new", new)):
        full = [(as_module(t, mod), b) for t, b in trees]
        inputs[name] = {"mod": mod, "full": full, "pruned": [t.prune(b)[0] for t, b in full]}
    # Every prompt position's top-3 tokens and one outside its top-k, as the n-gram drafter asks.
    queries = [[(r + 1, int(t)) for r in range(len(c.tokens)) for t in list(c.tokens[r, :3]) + [-1]]
               for c in prefills]

    def prefill_cache(x):
        for c, qs in zip(prefills, queries):
            cache = x["mod"]["ngram"].PrefillCache(c.tokens, c.logprobs)
            for q, t in qs:
                cache.logprob(q, t)

    ops = {
        "prune(budget)": (lambda x: [t.prune(b) for t, b in x["full"]], len(trees)),
        "ancestor_mask(full tree)": (lambda x: [t.ancestor_mask() for t, _ in x["full"]], len(trees)),
        "ancestor_mask(pruned tree)": (lambda x: [t.ancestor_mask() for t in x["pruned"]], len(trees)),
        "PrefillCache + lookups": (prefill_cache, len(prefills)),
    }
    runs = args.repeats * 10
    print(f"\n== {len(trees)} rounds, {len(prefills)} prompts: ms per round (PrefillCache: per prompt), "
          f"median of {runs} alternating runs")
    for name, (op, per) in ops.items():
        times = {"old": [], "new": []}
        for rep in range(runs):
            for which in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                t = time.perf_counter()
                op(inputs[which])
                times[which].append(time.perf_counter() - t)
        ms = {w: 1e3 * float(np.median(v)) / max(per, 1) for w, v in times.items()}
        print(f"  {name:<28} {args.micro:>8} {ms['old']:8.3f}   working tree {ms['new']:8.3f}   "
              f"x {ms['new'] / ms['old']:.2f}")


def profile(args) -> None:
    """Run every config once untimed, then once under cProfile or torch.profiler, on the working tree."""
    (revision,) = load_revisions(["."], args.dtype, args.with_middle)
    cfgs = configs(args)
    for cfg in cfgs:
        revision.decode(*cfg, 8)

    def run():
        for cfg in cfgs:
            revision.decode(*cfg, args.new_tokens)

    if args.profile == "cprofile":
        prof = cProfile.Profile()
        prof.runcall(run)
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", default=["."], help="git revisions to compare; `.` = the working tree")
    ap.add_argument("--benchmarks", default="humaneval,gsm8k,sum")
    ap.add_argument("--methods", default="all-small,all-mid,10000")
    ap.add_argument("--budgets", default="8,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-middle", dest="with_middle", action="store_false")
    ap.add_argument("--profile", choices=["cprofile", "torch"])
    ap.add_argument("--micro", metavar="REV", help="time tree operations and the prefill cache of REV against the "
                    "working tree's, on the trees of real requests")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.micro:
        micro(args)
    elif args.profile:
        profile(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
