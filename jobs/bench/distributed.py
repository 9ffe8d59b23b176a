"""Distributed path vs the single-process engine on the same models, on this machine's CPU.

  .venv/bin/python -m jobs.bench.distributed [--tokens 64] [--prompts 4] [--tp 1 2]
  .venv/bin/python -m jobs.bench.distributed --pair embedded --tp 1 --tokens 32 --schedules all-small,01001
        [--budget 4] [--compare-prefetch [--prefetch-last]]   # with and without the middle catch-up prefetch

Per schedule and TP size: time per round (wall time / target verifications) of the single-process
`Decoder` and of `actors.DistributedEngine`, and the difference, the per-round overhead of the actors
(Ray calls, pickling trees, the all-reduces of TP over gloo). Then throughput (generated tokens per
second, all requests together) with 1, 4 and 8 requests in flight. Models: the tiny LLaMA pair of the
tests (tests/tiny.py), saved to a temporary folder; a local Ray cluster with fake GPUs for placement.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import ray
import torch

from actors.engine import DistributedEngine
from actors.resources import Resources
from jobs.bench.common import start_ray, tests_on_path
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.models.hf import CausalLM

SCHEDULES = ("all-small", "01001", "all-mid")


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    half = [[rng.randrange(vocab) for _ in range(32)] for _ in range(n - n // 2)]
    return half + [[rng.randrange(vocab) for _ in range(8)] * 4 for _ in range(n // 2)]


def per_round_ms(run, prompts, tokens, method) -> tuple[float, int]:
    run(prompts[0], tokens, method)  # warm-up
    t, rounds = time.perf_counter(), 0
    for p in prompts:
        rounds += run(p, tokens, method).stats.rounds
    return (time.perf_counter() - t) * 1e3 / rounds, rounds


def throughput(engine, prompts, tokens, method, inflight) -> float:
    batch = (prompts * inflight)[:inflight]
    engine.generate_many(batch, tokens, method)  # warm-up at this concurrency
    t = time.perf_counter()
    n = sum(len(g.tokens) for g in engine.generate_many(batch, tokens, method))
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pair", choices=("tiny", "embedded"), default="tiny")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--budget", type=int, default=TreeConfig().budget, help="nodes verified per round")
    ap.add_argument("--compare-prefetch", action="store_true",
                    help="embedded pair: also run without the middle drafter's catch-up prefetch")
    ap.add_argument("--prefetch-last", action="store_true", help="with --compare-prefetch: the run without it first")
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    torch.set_num_threads(1)
    start_ray(num_gpus=8, object_store_mb=200)
    if args.pair == "embedded":
        embedded_pair(args, schedules)
        return
    tests_on_path()
    from tiny import VOCAB, char_tokenizer, perturbed_copy, save_tiny, tiny_model

    model = tiny_model("llama")
    middle = perturbed_copy(model, 0.3, 1)
    decoder = Decoder(CausalLM(model), CausalLM(middle))
    prompts = make_prompts(args.prompts, VOCAB)
    single = {m: per_round_ms(decoder.generate, prompts, args.tokens, m) for m in schedules}
    rows, tput = [], []
    with tempfile.TemporaryDirectory() as d:
        tok = char_tokenizer()
        paths = save_tiny(Path(d) / "t", model, tok), save_tiny(Path(d) / "m", middle, tok)
        for tp in args.tp:
            res = Resources(tp=tp, device="cpu", target_cpus=0.1, middle_cpus=0.1, ngram_cpus=0.1,
                            coordinator_cpus=0.1, torch_threads=1)
            with DistributedEngine(*paths, resources=res, dtype="float32") as engine:
                for m in schedules:
                    dist_ms, rounds = per_round_ms(engine.generate, prompts, args.tokens, m)
                    rows.append((tp, m, rounds, single[m][0], dist_ms))
                for c in (1, 4, 8):
                    tput.append((tp, c, throughput(engine, prompts, args.tokens, "01001", c)))
    t = time.perf_counter()
    n = sum(len(decoder.generate(p, args.tokens, "01001").tokens) for p in (prompts * 8)[:8])
    single_tput = n / (time.perf_counter() - t)

    print_rounds(f"{args.prompts} prompts x {args.tokens} new tokens, tiny LLaMA pair, fp32", rows)
    print(f"\nThroughput, schedule 01001, {args.tokens} new tokens per request "
          f"(single-process engine, one request at a time: {single_tput:.0f} tokens/s)\n")
    print("| TP | requests in flight | tokens/s (all requests) |")
    print("|---:|---:|---:|")
    for tp, c, v in tput:
        print(f"| {tp} | {c} | {v:.0f} |")
    ray.shutdown()


def print_rounds(what: str, rows) -> None:
    print(f"\nPer round ({what}, {torch.get_num_threads()} torch thread per process)\n")
    print("| TP | schedule | rounds | single-process ms/round | distributed ms/round | overhead ms/round | overhead |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tp, m, rounds, s, dist in rows:
        print(f"| {tp} | {m} | {rounds} | {s:.1f} | {dist:.1f} | {dist - s:+.1f} | {(dist - s) / s:+.1%} |")


def embedded_pair(args, schedules: list[str]) -> None:
    """Per-round overhead on the embedded pair: the single-process Decoder against the actors."""
    from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
    from treegraft_dist.models.loading import load_model
    from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET, prepare_model

    paths = str(prepare_model(DEFAULT_TARGET)), str(prepare_model(DEFAULT_MIDDLE))
    target = load_model(paths[0], "cpu", "float32")
    middle = load_model(paths[1], "cpu", "float32", target.tokenizer, drafter=True)
    prompts = [chat_prompt(target.tokenizer, [builtin(b)[0].turns[0]], []) for b in ("gsm8k", "humaneval", "mt_bench")]
    eos = sorted(target.eos_ids)
    tree = TreeConfig(budget=args.budget)
    decoder = Decoder(target.lm, middle.lm, tree)
    single = {m: per_round_ms(lambda p, n, m: decoder.generate(p, n, m, eos_ids=eos), prompts, args.tokens, m)
              for m in schedules}
    del decoder, target, middle
    rows = []
    for tp in args.tp:
        settings = ((False, True) if args.prefetch_last else (True, False)) if args.compare_prefetch else (True,)
        for prefetch in settings:
            res = Resources(tp=tp, device="cpu", target_cpus=0.1, middle_cpus=0.1, ngram_cpus=0.1,
                            coordinator_cpus=0.1, torch_threads=1, middle_prefetch=prefetch)
            with DistributedEngine(*paths, tree, resources=res, dtype="float32") as engine:
                for m in schedules:
                    dist_ms, rounds = per_round_ms(lambda p, n, m: engine.generate(p, n, m, eos_ids=eos), prompts,
                                                   args.tokens, m)
                    rows.append((tp, m if prefetch else f"{m} (no prefetch)", rounds, single[m][0], dist_ms))
    print_rounds(f"3 benchmark prompts x {args.tokens} new tokens, embedded pair, fp32, budget {args.budget}", rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
