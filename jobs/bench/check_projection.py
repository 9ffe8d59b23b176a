"""`treegraft project` against reality on this machine: the projection with this machine's own cost profile
next to a measured `treegraft eval` on the same prompts, and the error per method.

    python -m jobs.bench.check_projection --prompts-per-benchmark 2 --out out/check-projection   # embedded pair, CPU

On a quiet machine (it times every method); the steps are treegraft_dist/evaluation/projection_check.py's.
The oracle is projected; eval runs it with --methods ...,oracle (it enumerates every round's 32 schedules
before its timed decode: slow on a CPU).
Written: OUT/check.md, OUT/check.csv, OUT/projection (the projection's files), OUT/eval (eval's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from treegraft_dist.commands import load_pair
from treegraft_dist.evaluation.projection import METHODS, ORACLE
from treegraft_dist.evaluation.projection_check import check, checked_methods, checked_trajectories
from treegraft_dist.models.loading import ModelError
from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET, PrepareError

DEFAULT_METHODS = tuple(m for m in METHODS if m != ORACLE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--middle", default=DEFAULT_MIDDLE)
    p.add_argument("--data", default=None, help="trajectories of the pair (default: the ones shipped for it)")
    p.add_argument("--prompts-per-benchmark", type=int, default=2)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="of " + ", ".join(METHODS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default="out/check-projection")
    args = p.parse_args(argv)
    args.distributed = False
    log = lambda m: print(f"check_projection: {m}", file=sys.stderr)  # noqa: E731
    try:
        return run(args, log)
    except (ModelError, PrepareError, ValueError) as e:
        print(f"check_projection: error: {e}", file=sys.stderr)
        return 2


def run(args, log) -> int:
    methods = checked_methods(args.methods)
    pair = (args.target, args.middle)
    traj = checked_trajectories(pair, Path(args.data) if args.data else None, args.prompts_per_benchmark)
    out = Path(args.out)
    target, middle = load_pair(args, need_middle=True)
    done = check(traj, target, middle, pair, methods, args.prompts_per_benchmark, out, args.cache_dir, log)
    print(done.text)
    print(f"{out / 'check.md'}\n{out / 'check.csv'}\n{out / 'eval'}")
    return 1 if done.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
