"""The `treegraft` console script: the package's commands (treegraft_dist/commands.py, where every flag is)
with what they run on Ray: the engine behind --distributed and `collect` (actors/), and `serve` (jobs/serve.py).
Ray is imported only by a command that uses it. `python -m jobs.cli ...` is the same from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from treegraft_dist import commands
from treegraft_dist.commands import RayCommands, UsageError, tree_config
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.models.loading import LoadedModel, pick_device, resolve_pair


def distributed_engine(args, target: LoadedModel, middle: LoadedModel | None, cfg: TreeConfig,
                       sampling: SamplingParams):
    """A DistributedEngine on a local Ray cluster (or --address); on CPU the actors share the cores and
    ask for no GPUs."""
    from actors import DistributedEngine
    from actors.resources import for_device

    res = for_device(pick_device(args.device).type, args.tp)
    return DistributedEngine(target.source, middle.source if middle else None, cfg, res, args.address, sampling,
                             args.dtype)


def cmd_collect(args) -> int:
    from actors.collect import COLLECT_BENCHMARKS, CollectConfig, collect

    tree = tree_config(args)
    benchmarks = tuple(b for b in (args.benchmarks or ",".join(COLLECT_BENCHMARKS)).split(",") if b)
    if args.middle.lower() == "none":
        raise UsageError("collect builds trees with the middle drafter: give --middle")
    t_src, _, m_src, _ = resolve_pair(args.target, args.middle, args.cache_dir)
    cfg = CollectConfig(t_src, m_src, (args.target, args.middle), Path(args.out), benchmarks,
                        args.prompts_per_benchmark, args.first_question, args.max_new_tokens, tree, args.device,
                        args.dtype, args.actors, args.cpus_per_actor, args.gpus_per_actor, args.threads,
                        Path(args.cache_dir) if args.cache_dir else None)
    report = collect(cfg, args.address)
    print(f"{report.collected} prompts collected ({report.rounds} rounds), {report.skipped} already there, of "
          f"{report.prompts} selected, in {report.seconds:.0f} s\nrounds: {report.out / 'rounds'}\n"
          f"manifest: {report.out / 'collect.json'}")
    return 0


def cmd_serve(args) -> int:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    from jobs.serve import run_local

    return run_local(args)


def distributed_errors() -> tuple[type, ...]:
    """Placement and target-group failures print as one line too, once the Ray side is loaded."""
    mod = sys.modules.get("actors")
    return (mod.PlacementError, mod.TargetGroupError) if mod else ()


RAY = RayCommands(engine=distributed_engine, collect=cmd_collect, serve=cmd_serve, errors=distributed_errors)


def main(argv: list[str] | None = None) -> int:
    return commands.main(argv, RAY)


if __name__ == "__main__":
    sys.exit(main())
