"""Drafting from what the server has seen: the same engine with and without its n-gram history
(Resources.history_tokens), side by side, on requests that repeat earlier ones.

  .venv/bin/python -m jobs.bench.history [--pair embedded|tiny] [--questions 3] [--tokens 48]
        [--methods all-small,treegraft] [--history 200000] [--dtype auto] [--out FILE.parquet]

The workload, per MT-Bench question (two turns each; each method its own questions), in this order: the first turn; the second turn, the
first answer in its context (a chat's next turn); the first turn asked again (a client's retry, or another
user with the same question). Both engines serve the same sequence of requests, one request at a time,
taking turns request by request (their models are loaded once each; the history engine's memory builds up
as a server's would, the other keeps nothing between requests). `treegraft` is the server's default policy
(for the embedded pair the scheduler fitted for this device, at its budget, which every method verifies at,
as on the server). Both engines run the linear path and middle int8 choice this process's probes pick. Every output is compared with
the other engine's (both must equal the target's greedy decoding in fp32; they are the same computation
with different drafts): where they differ on the same prompt, the target (loaded once the engines are gone)
judges the first difference by its own logits (lossless.classify: a near-tie in bf16, else a mismatch); a
second turn whose first answers differed has different prompts and is not compared. Prints a Markdown table
per request kind: tokens/s, rounds, accepted tokens a round, the ratio with / without history and the
verdicts; `--out` writes the rows.
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
from jobs.bench.common import pair_paths, pin_kernels, served_default, start_ray
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.scheduler import fitted_tree
from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
from treegraft_dist.models.loading import pick_dtype

KINDS = ("first turn", "second turn", "asked again")
SIDES = ("no history", "history")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("tiny", "embedded"), default="embedded")
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--methods", default="all-small,treegraft")
    ap.add_argument("--history", type=int, default=200_000, help="the history engine's history_tokens")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    methods = args.methods.split(",")
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    args.dtype = str(dtype).removeprefix("torch.")
    # Both engines on the kernels this process's probes pick: each target worker probing on its own can land
    # on a different linear path, and that difference would be read as the history's.
    print(f"dtype {args.dtype}; both engines: {pin_kernels(dtype)}", flush=True)
    start_ray()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        t_path, m_path, tok = pair_paths(args.pair, d)
        eos = tuple(sorted({i for i in (tok.eos_token_id,) if i is not None}))
        res = for_device("cpu", 1)
        default, budget, which = served_default(args.pair, t_path, m_path, args.dtype, res.torch_threads)
        print(f"treegraft: {which}", flush=True)
        tree = fitted_tree(TreeConfig(budget=budget), default, budget=False)  # the width it was fitted for
        named = {"treegraft": default}  # as the server holds it: requests name it
        engines = {SIDES[0]: DistributedEngine(t_path, m_path, tree, res, dtype=args.dtype, policies=named),
                   SIDES[1]: DistributedEngine(t_path, m_path, tree, for_device("cpu", 1, history_tokens=args.history),
                                               dtype=args.dtype, policies=named)}
        try:
            for eng in engines.values():
                eng.warm()
            questions = [q for q in builtin("mt_bench") if len(q.turns) > 1]
            for i, m in enumerate(methods):  # other questions per method: a first turn is new to both engines
                for q in questions[i * args.questions : (i + 1) * args.questions]:
                    answers: dict[str, list[int]] = {}
                    for kind in KINDS:
                        for side, eng in engines.items():
                            if kind == "second turn":
                                prompt = chat_prompt(tok, list(q.turns[:2]),
                                                     [tok.decode(answers[side], skip_special_tokens=True)])
                            else:
                                prompt = chat_prompt(tok, [q.turns[0]], [])
                            t = time.perf_counter()
                            gen = eng.generate(prompt, args.tokens, m, eos)
                            wall = time.perf_counter() - t
                            if kind == "first turn":
                                answers[side] = gen.tokens
                            rows.append(dict(method=m, question=q.question_id, kind=kind, side=side,
                                             tokens=len(gen.tokens), seconds=wall, rounds=gen.stats.rounds,
                                             accepted_per_round=gen.stats.mean_accepted, output=gen.tokens,
                                             prompt=prompt))
                            print(f"  {m:>9} q{q.question_id} {kind:>11} {side:>10}: {len(gen.tokens) / wall:5.2f} "
                                  f"tok/s, {gen.stats.rounds} rounds, {gen.stats.mean_accepted:.2f} a round",
                                  flush=True)
        finally:
            for eng in engines.values():
                eng.shutdown()
        judge(rows, t_path, args.dtype)
    report(rows, methods, args, which)
    if args.out:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from treegraft_dist.files import replacing

        with replacing(args.out) as tmp:
            pq.write_table(pa.Table.from_pylist(rows), tmp)
    ray.shutdown()


def judge(rows: list[dict], target_path: str, dtype: str) -> None:
    """Set each "history" row's `verdict` against its "no history" twin: exact, near-tie or mismatch
    (lossless.classify, the target loaded here only where some output differs), or "other prompt"."""
    from treegraft_dist.evaluation.lossless import EXACT, classify
    from treegraft_dist.models.loading import load_model

    twins = {(r["method"], r["question"], r["kind"]): r for r in rows if r["side"] == SIDES[0]}
    pairs = [(twins[r["method"], r["question"], r["kind"]], r) for r in rows if r["side"] == SIDES[1]]
    lm = None
    if any(a["prompt"] == b["prompt"] and a["output"] != b["output"] for a, b in pairs):
        lm = load_model(target_path, "cpu", dtype).lm
    for a, b in pairs:
        if a["prompt"] != b["prompt"]:
            a["verdict"] = b["verdict"] = "other prompt"
        else:
            a["verdict"] = b["verdict"] = (EXACT if a["output"] == b["output"]
                                           else classify(lm, a["prompt"], a["output"], b["output"]).verdict)


def report(rows: list[dict], methods: list[str], args, which: str) -> None:
    print(f"\n{args.pair} pair, {args.questions} MT-Bench questions x {args.tokens} new tokens, one request at a "
          f"time, dtype {args.dtype}, history {args.history} tokens; treegraft: {which}\n")
    print("| method | request | tok/s without | tok/s with history | with / without | accepted/round without | "
          "accepted/round with | outputs with vs without |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for m in methods:
        for kind in KINDS:
            cell = {s: [r for r in rows if (r["method"], r["kind"], r["side"]) == (m, kind, s)] for s in SIDES}
            tps = {s: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for s, v in cell.items()}
            acc = {s: statistics.mean(r["accepted_per_round"] for r in v) for s, v in cell.items()}
            verdicts = [r["verdict"] for r in cell[SIDES[1]]]
            said = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts))
            print(f"| {m} | {kind} | {tps[SIDES[0]]:.2f} | {tps[SIDES[1]]:.2f} | {tps[SIDES[1]] / tps[SIDES[0]]:.2f}x "
                  f"| {acc[SIDES[0]]:.2f} | {acc[SIDES[1]]:.2f} | {said} |")


if __name__ == "__main__":
    main()
