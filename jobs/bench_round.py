"""Per-phase time of a decoding round on the embedded pair (bf16 by default), and where its time goes.

Decodes the first question of a few benchmarks (chat-formatted first turn) with `engine.Decoder` for every
method and budget, and prints per phase of RequestStats.seconds the ms per round (prefill: ms per request)
and the total per round (the wall time less the prefill, over the rounds).

    python jobs/bench_round.py                               # the working tree
    python jobs/bench_round.py --revs HEAD~1 HEAD            # two commits side by side
    python jobs/bench_round.py --revs HEAD . --repeats 2     # `.` is the working tree, edits included
    python jobs/bench_round.py --micro HEAD~1                # tree ops and prefill cache, HEAD~1 vs `.`
    python jobs/bench_round.py --profile cprofile            # where the time goes (or: torch)

Each revision's `treegraft_dist` (from `git archive`; `.` = a copy of the working tree) is imported under
its own name in this one process, and all of them drive the same loaded models, so a comparison costs the
memory of one pair. For every (prompt, method, budget) the revisions decode in turn, in an order that
alternates between repeats, so background load on the shared CPU falls on all of them alike. The last
column says whether a revision decoded exactly what the first one did: the same generated ids, the same
verified trees (tokens and parents of every pruned tree, hashed) and the same accepted lengths.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import hashlib
import importlib
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = "qwen2.5-coder-1.5b-instruct"
MIDDLE = "qwen2.5-coder-0.5b-instruct"
PHASES = ("prefill", "ngram", "middle", "scheduler", "verify", "other")
GENERATE = "generate"  # not a Decoder method: transformers' own greedy `model.generate`


def import_revision(rev: str, scratch: Path) -> str:
    """Import `rev`'s package (`.` = the working tree now) under a name of its own; returns that name."""
    if rev == ".":
        name = "treegraft_worktree"
        shutil.copytree(ROOT / "treegraft_dist", scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.strip()
        name = f"treegraft_{sha}"
        archive = subprocess.run(["git", "archive", sha, "treegraft_dist"], cwd=ROOT, check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
        (scratch / "treegraft_dist").rename(scratch / name)
    if str(scratch) not in sys.path:
        sys.path.insert(0, str(scratch))
    importlib.import_module(name)
    return name


def module(package: str, *names: str):
    """`package`'s module under the first of `names` it has (revisions before the package was split into
    models/, decoding/, evaluation/ kept every module at the top)."""
    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if not e.name or not f"{package}.{name}".startswith(e.name):
                raise
    raise ModuleNotFoundError(f"{package} has none of {', '.join(names)}")


def load_middle(models, source: str, dtype: str, tokenizer):
    """The middle drafter as the evaluation loads it (int8 decoder linears where faster), where the revision
    has that option."""
    try:
        return models.load_model(source, "cpu", dtype, tokenizer, drafter=True)
    except TypeError:
        return models.load_model(source, "cpu", dtype, tokenizer)


class Models:
    """The embedded pair, loaded once (with the first revision's loader) and shared by all revisions."""

    def __init__(self, package: str, dtype: str, with_middle: bool):
        prepare = module(package, "models.prepare", "prepare")
        models = module(package, "models.loading", "models")
        benchmarks = module(package, "evaluation.benchmarks", "benchmarks")
        root = prepare.cache_root()
        for name in (TARGET, MIDDLE):
            if not (root / name / prepare.MARKER_NAME).is_file():
                raise SystemExit(f"{root / name} is not prepared yet: run `treegraft prepare-models` first")
        target = models.load_model(str(root / TARGET), "cpu", dtype)
        self.tokenizer = target.tokenizer
        self.target = target.lm.model
        middle = load_middle(models, str(root / MIDDLE), dtype, target.tokenizer) if with_middle else None
        self.middle = middle.lm.model if middle is not None else None
        # The drafting head over the draft vocabulary lives on the loader's wrapper: revisions that have one
        # take it over (a revision's own wrapper is built around the same model).
        self.draft_head = {k: getattr(middle.lm, k) for k in ("draft_vocab", "_draft_head")
                           if middle is not None and hasattr(middle.lm, k)}
        self.prompts = {}
        for name in benchmarks.BENCHMARKS:
            question = benchmarks.builtin(name)[0]
            self.prompts[name] = benchmarks.chat_prompt(self.tokenizer, [question.turns[0]], [])


class Revision:
    """One revision's decoding code over the shared models; hashes every tree its target verifies."""

    def __init__(self, rev: str, package: str, models: Models):
        self.rev = rev
        self.models = models
        hf = module(package, "models.hf", "hf")
        self.engine = module(package, "decoding.engine", "engine")
        self.config = module(package, "decoding.config", "config")
        self.target = hf.CausalLM(models.target)
        self.middle = hf.CausalLM(models.middle) if models.middle is not None else None
        for k, v in models.draft_head.items():
            if self.middle is not None and hasattr(self.middle, k):
                setattr(self.middle, k, v)
        self.digest = hashlib.sha1()
        verify = module(package, "decoding.verify", "verify")
        original = verify.TargetVerifier.verify

        def verify_and_hash(verifier, tree):
            self.digest.update(tree.tokens[: tree.size].tobytes())
            self.digest.update(tree.parents[: tree.size].tobytes())
            return original(verifier, tree)

        verify.TargetVerifier.verify = verify_and_hash

    def decode(self, bench: str, method: str, budget: int, new_tokens: int) -> dict:
        prompt = self.models.prompts[bench]
        if method == GENERATE:
            return hf_generate(self.models.target, prompt, new_tokens)
        self.digest = hashlib.sha1()
        decoder = self.engine.Decoder(self.target, self.middle, self.config.TreeConfig(budget=budget))
        gen = decoder.generate(prompt, new_tokens, method)
        s = gen.stats
        return {"tokens": gen.tokens, "wall_s": s.wall_s, "rounds": s.rounds, "seconds": dict(s.seconds),
                "accepted": s.accepted, "trees": self.digest.hexdigest()}


def hf_generate(model, prompt: list[int], new_tokens: int) -> dict:
    """transformers' greedy generate; its prefill (with the first token) is timed as a 1-token generate,
    so that the per-token decoding time compares with ours."""
    ids = torch.tensor([prompt])

    def generate(n):
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist(), time.perf_counter() - t

    _, prefill = generate(1)
    tokens, wall = generate(new_tokens)
    return {"tokens": tokens, "wall_s": wall, "rounds": new_tokens - 1, "seconds": {"prefill": prefill},
            "accepted": [], "trees": ""}


def load_revisions(revs: list[str], dtype: str, with_middle: bool) -> list[Revision]:
    """The revisions, over models loaded once; their packages stay on disk until the process exits (a
    function may import a module late)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-round-"))
    atexit.register(shutil.rmtree, scratch, True)
    packages = [import_revision(rev, scratch) for rev in revs]
    models = Models(packages[0], dtype, with_middle)
    return [Revision(rev, package, models) for rev, package in zip(revs, packages)]


# -- reports ------------------------------------------------------------------------------------------

def per_round_ms(r: dict) -> dict[str, float]:
    """ms per round of each phase, the prefill per request; `round` = (wall - prefill) / rounds."""
    rounds = max(r["rounds"], 1)
    out = {p: 1e3 * r["seconds"].get(p, 0.0) / (1 if p == "prefill" else rounds) for p in PHASES}
    out["round"] = 1e3 * (r["wall_s"] - r["seconds"].get("prefill", 0.0)) / rounds
    return out


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
