"""The `treegraft` commands: generate, eval, summary, collect, fit, project, serve, prepare-models.

One file at about 500 lines on purpose: each subcommand is its parser and a short handler that checks the
arguments and calls the package (the work itself lives in decoding/, scheduling/, evaluation/ and models/),
and a reader finds every flag of the tool in one place. What runs on Ray (the distributed engine, collect,
serve) is given to `main` as a RayCommands by the console script, jobs/cli.py: the package imports nothing
of actors/ or jobs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from .decoding.config import TreeConfig
from .decoding.engine import AR_METHOD, Decoder
from .decoding.sampling import SamplingParams
from .decoding.schedule import fixed_schedule
from .decoding.scheduler import fitted_tree
from .evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from .evaluation.evaluate import EvalConfig, Evaluation
from .evaluation.methods import DEFAULT_METHODS
from .evaluation.timelimit import parse_seconds
from .models import compact, draft, kernels, precision
from .models.loading import (
    LoadedModel,
    ModelError,
    check_pair,
    describe_model,
    load_model,
    pick_device,
    resolve_pair,
)
from .models.prepare import (
    DEFAULT_MIDDLE,
    DEFAULT_TARGET,
    PrepareError,
    prepare_default_models,
    resolve_model_path,
)

TREEGRAFT_SIZED = "treegraft@sized"  # treegraft with every round's tree sized (sizing.py)


class UsageError(ValueError):
    """Bad command-line input; printed as one line, no traceback."""


# (args, target, middle or None, tree settings, sampling) -> a distributed engine, used as a context manager
EngineFactory = Callable[[argparse.Namespace, LoadedModel, LoadedModel | None, TreeConfig, SamplingParams],
                         AbstractContextManager]


@dataclasses.dataclass(frozen=True)
class RayCommands:
    """What the commands run on Ray, given by the console script: the engine behind --distributed, the
    `collect` and `serve` handlers, and the Ray side's errors to print as one line (once it is loaded)."""

    engine: EngineFactory
    collect: Callable[[argparse.Namespace], int]
    serve: Callable[[argparse.Namespace], int]
    errors: Callable[[], tuple[type, ...]]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target model: local folder, hub id, or an embedded name (default: %(default)s)")
    p.add_argument("--middle", default=DEFAULT_MIDDLE,
                   help="middle drafter, same vocabulary as the target (default: %(default)s); 'none' for n-gram only")
    p.add_argument("--cache-dir", default=None, help="where embedded models are prepared (env TREEGRAFT_CACHE)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto (the fastest the device runs natively, measured: bf16 on GPUs and on CPUs with native bf16, "
                   "else fp32), float32, bfloat16, float16")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true", help="run on Ray actors (target group, drafters, coordinator)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the target with --distributed")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    d = TreeConfig()
    p.add_argument("--depth", type=int, default=d.depth, help="drafting layers per round D (default %(default)s)")
    p.add_argument("--tree-k", type=int, default=None,
                   help=f"children per node and frontier size K (default: the width the treegraft scheduler was "
                        f"fitted for on this device, else {d.top_k})")
    p.add_argument("--lookback", type=int, default=d.lookback, help="expanded-pool lookback L (default %(default)s)")
    p.add_argument("--budget", type=int, default=None,
                   help=f"nodes verified per round, root included (default {d.budget}; --method treegraft sizes "
                        "every round's tree for this device, up to this many nodes if given)")
    p.add_argument("--long-chain", type=int, default=d.long_chain,
                   help="tokens the root's best n-gram match may copy past the layers' depth (default %(default)s; "
                        "0 = the published settings)")
    p.add_argument("--deepen", type=int, default=d.deepen,
                   help="middle layers a round may draft past --depth while the middle drafter is sure enough that "
                        "one more layer pays for its call (default %(default)s; 0 = the published settings)")
    p.add_argument("--middle-window", type=int, default=d.middle_window,
                   help="prompt tokens the middle drafter reads, the last ones (default %(default)s; 0 = the whole "
                        "prompt, the published settings)")
    p.add_argument("--pin-match", type=int, default=d.pin_match,
                   help="a long chain behind an n-gram match of at least this many tokens (a copy) is verified ahead "
                        "of the nodes ranked by score (default %(default)s; 0 = never)")


def tree_config(args) -> TreeConfig:
    budget = TreeConfig.budget if args.budget is None else args.budget
    if budget < 1:
        raise UsageError(f"--budget must be at least 1 (the root), got {budget}")
    if args.long_chain < 0:
        raise UsageError(f"--long-chain must be >= 0, got {args.long_chain}")
    if args.deepen < 0:
        raise UsageError(f"--deepen must be >= 0, got {args.deepen}")
    if args.middle_window < 0:
        raise UsageError(f"--middle-window must be >= 0 (0: the whole prompt), got {args.middle_window}")
    if args.pin_match < 0:
        raise UsageError(f"--pin-match must be >= 0 (0: never pin a copy's chain), got {args.pin_match}")
    if args.tree_k is not None and args.tree_k < 1:
        raise UsageError(f"--tree-k must be at least 1, got {args.tree_k}")
    return TreeConfig(depth=args.depth, top_k=TreeConfig.top_k if args.tree_k is None else args.tree_k,
                      lookback=args.lookback, budget=budget,
                      long_chain=args.long_chain, deepen=args.deepen, middle_window=args.middle_window,
                      pin_match=args.pin_match)


def load_pair(args, need_middle: bool):
    """(target, middle or None) as LoadedModels; with --distributed only tokenizers and configs are
    loaded here (the weights load in the actors)."""
    t_src, t_tok, m_src, m_tok = resolve_pair(args.target, args.middle if need_middle else None, args.cache_dir)
    if args.dtype == "auto":
        print(f"treegraft: {precision.describe(pick_device(args.device))}", file=sys.stderr)
    if getattr(args, "distributed", False):
        return describe_model(t_src, t_tok, args.tp), (describe_model(m_src, m_tok) if m_src else None)
    target = load_model(t_src, args.device, args.dtype, t_tok)
    if target.lm.device.type == "cpu":
        print(f"treegraft: {kernels.describe(target.lm.dtype, target.lm.model)}", file=sys.stderr)
        if target.lm.dtype == compact.DTYPE:
            print(f"treegraft: {compact.describe()}; target: {compact.summary(target.lm.model)}", file=sys.stderr)
    if m_src is None:
        return target, None
    middle = load_model(m_src, args.device, args.dtype, m_tok, drafter=True)
    print(f"treegraft: middle drafter: {draft.describe(middle.lm)}", file=sys.stderr)
    check_pair(target, middle)
    return target, middle


def treegraft_policy(args, target: LoadedModel, middle: LoadedModel | None, prompt: list[int]):
    """The learned scheduler for this pair and device (--scheduler, or the one fitted here from the trajectories
    shipped for the pair), else the heuristic."""
    from .decoding.schedule import ShallowTreeHeuristic
    from .models.paths import cache_root
    from .scheduling.artifact import load_artifact
    from .scheduling.device import resolve_scheduler

    pair = (args.target, args.middle)
    if args.distributed:
        found = load_artifact(args.scheduler, expect_pair=pair) if args.scheduler else None
    else:
        found = resolve_scheduler(args.scheduler, pair, target.lm, target.source, middle.lm, middle.source,
                                  cache_root(args.cache_dir), prompt, tree_config(args),
                                  lambda m: print(f"treegraft: {m}", file=sys.stderr),
                                  any_width=getattr(args, "tree_k", None) is None)
    if found is None:
        print("treegraft: no scheduler for this pair, running the shallow-tree heuristic (see `treegraft fit`)",
              file=sys.stderr)
        return ShallowTreeHeuristic()
    return found[0]


def device_costs(args, target: LoadedModel) -> dict[int, float]:
    """This device's verification ms by tree size (measured once, cached: costs.latency_profile)."""
    from .decoding.costs import latency_profile
    from .models.paths import cache_root

    return latency_profile(target.lm, target.source, cache_root(args.cache_dir))


def device_sizer(args, target: LoadedModel):
    """treegraft sizes every round's tree for this device's verification costs, up to --budget or the largest
    size measured."""
    from .decoding.sizing import TreeSizer

    costs = device_costs(args, target)
    return TreeSizer(costs, max_size=max(costs) if args.budget is None else args.budget)


def copy_reach(args, target: LoadedModel):
    """Verify a copied span past the budget where this device's pass costs say it pays."""
    from .decoding.sizing import CopyReach

    return CopyReach(device_costs(args, target))


def cmd_generate(args, engine: EngineFactory) -> int:
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise UsageError("--prompt is empty: give the text to continue")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    cfg = tree_config(args)
    method = args.method
    sized = method == TREEGRAFT_SIZED
    if sized:
        method = "treegraft"
    if method not in (AR_METHOD, "treegraft"):
        fixed_schedule(method, cfg.depth)  # validates the pattern before any model is loaded
    uses_middle = args.method not in (AR_METHOD, "all-small")
    target, middle = load_pair(args, uses_middle)
    if uses_middle and middle is None:
        raise UsageError(f"method {args.method!r} calls the middle drafter: give --middle")
    tok = target.tokenizer
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    else:
        prompt = tok(args.prompt, add_special_tokens=True)["input_ids"]
    room = target.max_positions - cfg.max_tree_depth - 1
    if len(prompt) + args.max_new_tokens > room:
        raise UsageError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                         f"target's context ({target.max_positions} positions, {cfg.max_tree_depth + 1} kept for the "
                         "draft tree): shorten the prompt or ask for fewer tokens")
    if method == "treegraft":
        method = treegraft_policy(args, target, middle, list(prompt))
        # The tree size and width the scheduler was fitted for, where not given.
        cfg = fitted_tree(cfg, method, budget=args.budget is None and not sized, width=args.tree_k is None)
    if args.distributed:
        with engine(args, target, middle, cfg, sampling) as distributed:
            gen = distributed.generate(list(prompt), args.max_new_tokens, method, target.eos_ids, seed=args.seed)
    else:
        # treegraft verifies a copied span past its budget where that pays (its scheduler's setup measured the
        # device's pass costs already).
        reach = copy_reach(args, target) if args.method == "treegraft" and not sized and cfg.pin_match else None
        decoder = Decoder(target.lm, middle.lm if middle else None, cfg, sampling,
                          sizer=device_sizer(args, target) if sized else None, reach=reach)
        gen = decoder.generate(list(prompt), args.max_new_tokens, method, target.eos_ids, seed=args.seed)
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"token_ids": gen.tokens, "text": text, "stats": gen.stats.to_dict()}))
    else:
        s = gen.stats
        print(text)
        print(f"\n[{s.method}] {s.new_tokens} tokens in {s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s), "
              f"{s.rounds} rounds, {s.mean_accepted:.2f} tokens/round, {s.middle_calls_per_round:.2f} middle calls/round",
              file=sys.stderr)
    return 0


def cmd_eval(args, engine: EngineFactory) -> int:
    started = time.monotonic()  # --time-limit counts from here: loading, measuring and fitting count too
    budget = _eval_budget(args.budget)
    cfg = EvalConfig(benchmarks=[b for b in args.benchmarks.split(",") if b], benchmark_files=args.benchmark_file,
                     methods=[m for m in args.methods.split(",") if m], prompts_per_benchmark=args.prompts_per_benchmark,
                     max_new_tokens=args.max_new_tokens, out=Path(args.out), multi_turn=args.multi_turn, budget=budget,
                     cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                     scheduler=Path(args.scheduler) if args.scheduler else None, pair=(args.target, args.middle),
                     time_limit=parse_seconds(args.time_limit) if args.time_limit else None, started=started)
    for b in cfg.benchmarks:
        builtin(b)  # unknown names fail before any model is loaded
    target, middle = load_pair(args, need_middle=True)
    if args.distributed:
        if not isinstance(cfg.budget, int):
            raise UsageError("--budget auto profiles the target in this process: give one number with --distributed")
        tree = TreeConfig(budget=cfg.budget)
        if cfg.scheduler is not None:  # the width its artifact was fitted for
            from .scheduling.artifact import load_artifact

            tree = fitted_tree(tree, load_artifact(cfg.scheduler, expect_pair=cfg.pair)[0], budget=False)
        with engine(args, target, middle, tree, SamplingParams()) as distributed:
            summary = Evaluation(target, middle, cfg, engine=distributed).run()
    else:
        summary = Evaluation(target, middle, cfg).run()
    return _report(summary, cfg.out)


def _report(summary, out: Path) -> int:
    print(summary.table())
    print(f"\nresults: {out / 'results.parquet'}\nsummary: {out / 'summary.md'}\nchart: {out / 'speedup.png'}")
    if summary.mismatches:
        print(f"treegraft: error: {len(summary.mismatches)} outputs differ from ar: "
              + ", ".join(f"{m} on {b}/{q}" for m, b, q in summary.mismatches[:10]), file=sys.stderr)
        return 1
    return 0


def cmd_summary(args) -> int:
    from .evaluation.summary import summarize_folder

    return _report(summarize_folder(Path(args.out)), Path(args.out))


def _eval_budget(value: str) -> int | str | dict[str, int]:
    """'auto', N, or METHOD=N,... (e.g. the 'budgets:' line of an earlier run; methods not named: auto)."""
    if value == "auto":
        return value
    if "=" not in value:
        return _int_arg("--budget", value)
    out = {}
    for item in value.split(","):
        method, _, n = item.partition("=")
        if not method.strip() or not n.strip():
            raise UsageError(f"--budget: {item!r} is not METHOD=N (e.g. all-small=2,all-mid=12)")
        out[method.strip()] = _int_arg(f"--budget {method.strip()}", n.strip())
    return out


def _int_arg(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer or 'auto', got {value!r}") from None


def cmd_fit(args) -> int:
    from .scheduling.collect import read_trajectories
    from .scheduling.fit import fit

    budget = None if args.budget == "auto" else _int_arg("--budget", args.budget)
    if not 0 < args.heldout_fraction < 1:
        raise UsageError(f"--heldout-fraction must be between 0 and 1, got {args.heldout_fraction}")
    traj = read_trajectories(args.data)
    extra = {}
    if args.for_device:
        traj, extra = _priced_for_this_device(args, traj)
    _, _, report = fit(traj, args.out, budget, args.heldout_fraction, args.seed,
                       log=lambda m: print(m, file=sys.stderr), **extra)
    print(report.table())
    print(f"\nartifact: {args.out}")
    return 0


def _priced_for_this_device(args, traj):
    """The trajectories priced with this device's cost profile (the pair they record, loaded here), and the
    fit arguments that stamp the artifact with that profile."""
    from .decoding.costs import device_costs, profile_key
    from .models.paths import cache_root
    from .scheduling.device import PROFILE_KEY, measured_budgets, priced

    names = traj.manifest["pair"]
    srcs = [resolve_model_path(n, args.cache_dir) for n in names]
    target, middle = (load_model(src, args.device, args.dtype, drafter=i == 1) for i, src in enumerate(srcs))
    prompt = chat_prompt(target.tokenizer, [builtin("humaneval")[-1].turns[0]], [])
    tree = TreeConfig(**traj.manifest["tree"])
    cost = device_costs(target.lm, target.source, middle.lm, middle.source, cache_root(args.cache_dir), prompt, tree)
    key = profile_key(target.lm, target.source, middle.lm, middle.source)
    print(f"treegraft: fitting for this device's profile {key}", file=sys.stderr)
    return priced(traj, cost), {"budgets": measured_budgets(traj, cost), "profile": {PROFILE_KEY: key}}


def cmd_project(args) -> int:
    from .evaluation.projection import read_profiles, run
    from .scheduling.collect import read_trajectories
    from .scheduling.device import DATA_DIR, SHIPPED_TRAJECTORIES

    profiles = read_profiles(args.profile)
    data = Path(args.data) if args.data else SHIPPED_TRAJECTORIES[(DEFAULT_TARGET, DEFAULT_MIDDLE)]
    traj = read_trajectories(data)
    name = str(data.relative_to(DATA_DIR.parent.parent)) if data.is_relative_to(DATA_DIR.parent.parent) else str(data)
    projection = run(traj, profiles, Path(args.out), name, log=lambda m: print(f"treegraft: {m}", file=sys.stderr),
                     seed=args.seed)
    print(projection.markdown)
    print("\n" + "\n".join(str(f) for f in projection.files))
    return 0


def cmd_prepare(args) -> int:
    target, middle = prepare_default_models(args.cache_dir, progress=True)
    print(f"target: {target}\nmiddle: {middle}")
    return 0


def build_parser(ray: RayCommands) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treegraft", description="Lossless two-drafter tree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt")
    _add_model_args(g)
    _add_tree_args(g)
    _add_distributed_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    g.add_argument("--method", default="all-small",
                   help="ar, all-small, all-mid, treegraft (the learned scheduler at the budget it was fitted for), "
                        "treegraft@sized (every round's tree sized for this device), or a DEPTH-bit pattern such as "
                        "01001 (1 = middle drafter at that layer)")
    g.add_argument("--scheduler", default=None, metavar="PATH",
                   help="scheduler artifact for --method treegraft (default: the one shipped for the embedded pair)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    g.set_defaults(func=functools.partial(cmd_generate, engine=ray.engine))

    e = sub.add_parser("eval", help="methods x benchmark prompts, speedups, lossless check")
    _add_model_args(e)
    _add_distributed_args(e)
    e.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma-separated (default: %(default)s); '' for none")
    e.add_argument("--benchmark-file", action="append", default=[], help="extra JSONL file (question_id, category, turns); repeatable")
    e.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated (default: %(default)s; also value-planner, oracle) or 5-bit patterns; a fixed "
                        "method with @published (all-small@published) runs the published tree settings; @sized sizes each "
                        "round's tree; treegraft@paced drafts only while drafting pays, as the server runs a request alone")
    e.add_argument("--prompts-per-benchmark", type=int, default=2)
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--budget", default="auto",
                   help="nodes verified per round: N, 'auto' to fit the device (default), or METHOD=N,... per method "
                        "(the others auto; the 'budgets:' line a run prints)")
    e.add_argument("--multi-turn", action="store_true", help="all turns (later turns carry the reference answers)")
    e.add_argument("--scheduler", default=None, metavar="PATH",
                   help="scheduler artifact (treegraft fit) for treegraft, value-planner and oracle (default: the "
                        "one shipped for the embedded pair)")
    e.add_argument("--time-limit", default=None, metavar="T",
                   help="end within T (seconds, or 20m): from the second round of prompts on, methods other than ar, "
                        "treegraft and the peers are left out (the last listed first) when the rest would not fit, "
                        "and the run stops before the first prompt those cannot finish in time; what was left out "
                        "is printed and written under the summary. Default: no limit")
    e.add_argument("--out", default="out/eval")
    e.set_defaults(func=functools.partial(cmd_eval, engine=ray.engine))

    s = sub.add_parser("summary", help="the summary table and chart of an eval folder (e.g. of an interrupted run)")
    s.add_argument("out", help="the --out folder of `treegraft eval` (holds results.parquet)")
    s.set_defaults(func=cmd_summary)

    f = sub.add_parser("fit", help="fit the value heads and distil the scheduler from collected trajectories")
    f.add_argument("--data", required=True, help="a `treegraft collect` output folder")
    f.add_argument("--out", required=True, help="artifact file to write (.npz)")
    f.add_argument("--budget", default="auto", help="recorded tree budget to fit for, or 'auto' (default)")
    f.add_argument("--heldout-fraction", type=float, default=0.25, help="share of prompts held out (default %(default)s)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--for-device", action="store_true",
                   help="price the trajectories with this machine's measured costs (--device, --dtype) and fit for "
                        "them; without it the fit uses the costs recorded where they were collected")
    f.add_argument("--device", default="auto", help="with --for-device: cpu, cuda, ... (default: cuda if available)")
    f.add_argument("--dtype", default="auto", help="with --for-device: the precision to measure (default: auto)")
    f.add_argument("--cache-dir", default=None, help="with --for-device: where models and profiles are cached")
    f.set_defaults(func=cmd_fit)

    c = sub.add_parser("collect", help="scheduler trajectories: every round under all 32 schedules (Ray Data)")
    _add_model_args(c)
    _add_tree_args(c)
    c.add_argument("--benchmarks", default=None, help="comma-separated (default: all but mt_bench, which is held out)")
    c.add_argument("--prompts-per-benchmark", type=int, default=8)
    c.add_argument("--first-question", type=int, default=20,
                   help="first question used per benchmark (default %(default)s; eval uses the first ones)")
    c.add_argument("--max-new-tokens", type=int, default=64, help="length of each reference decode")
    c.add_argument("--actors", type=int, default=1, help="actors in the pool, each holding both models")
    c.add_argument("--cpus-per-actor", type=float, default=1.0)
    c.add_argument("--gpus-per-actor", type=float, default=0.0)
    c.add_argument("--threads", type=int, default=None, help="torch threads per actor (default: cores / actors)")
    c.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    c.add_argument("--out", default="out/trajectories", help="output folder; an interrupted run resumes there")
    c.set_defaults(func=ray.collect)

    j = sub.add_parser("project", help="speedups projected from trajectories and a measured cost profile (no model runs)")
    j.add_argument("--profile", required=True,
                   help="jobs/gpu_check.py's profile.json, or a cost profile `treegraft eval` cached (<cache>/profiles/*--costs.json)")
    j.add_argument("--data", default=None,
                   help="trajectories, a `treegraft collect` folder (default: the ones shipped for the embedded pair)")
    j.add_argument("--seed", type=int, default=0, help="seed of the scheduler fit (default %(default)s)")
    j.add_argument("--out", default="out/project", help="folder for projection.md, .csv, charts and the fitted schedulers")
    j.set_defaults(func=cmd_project)

    v = sub.add_parser("serve", help="the OpenAI-compatible Ray Serve application, locally (serve.yaml: on a cluster)")
    v.add_argument("--target", default=DEFAULT_TARGET, help="target model: folder, hub id or embedded name (default: %(default)s)")
    v.add_argument("--middle", default=DEFAULT_MIDDLE, help="middle drafter (default: %(default)s); 'none' for n-gram only")
    v.add_argument("--model-name", default=None, help="the name clients ask for (default: the target's folder name)")
    v.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the target")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    v.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    v.add_argument("--device", default="auto", help="cpu or cuda (default: cuda when the cluster has the GPUs)")
    v.add_argument("--dtype", default="auto")
    v.add_argument("--method", default="treegraft", help="default decoding method; a request's \"method\" overrides it")
    v.add_argument("--scheduler", default=None, metavar="PATH", help="scheduler artifact for the method treegraft")
    v.add_argument("--draft-history", type=int, default=200_000, metavar="TOKENS",
                   help="tokens of finished requests (prompts and outputs) the n-gram drafter also matches, least "
                        "recently used out, about 100 bytes each (default %(default)s; 0: none)")
    v.add_argument("--trajectories", default=None, metavar="DIR",
                   help="fit the method treegraft's scheduler for this device from these `treegraft collect` "
                        "trajectories of the pair (default: the ones shipped for it, if any)")
    v.add_argument("--budget", type=int, default=None, help="nodes verified per round")
    v.add_argument("--max-requests", type=int, default=8, help="requests decoded at once (default %(default)s)")
    v.add_argument("--max-queued", type=int, default=64, help="requests that may wait; more get 429 (default %(default)s)")
    v.add_argument("--max-tokens", type=int, default=256, help="completion length when a request gives none")
    v.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for room to run before a 503 with Retry-After (default %(default)s)")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $TREEGRAFT_API_KEY, "
                        "else open)")
    v.add_argument("--cache-dir", default=None)
    v.set_defaults(func=ray.serve)

    p = sub.add_parser("prepare-models", help="fetch, verify and convert the embedded default model pair")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_prepare)
    return parser


def main(argv: list[str] | None, ray: RayCommands) -> int:
    args = build_parser(ray).parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ModelError, PrepareError, ValueError, *ray.errors()) as e:
        print(f"treegraft: error: {e}", file=sys.stderr)
        return 2
