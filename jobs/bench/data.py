"""Is the scheduler's data the limit? A learning curve of the value planner on a fixed set of held-out prompts.

The collected rounds are priced with one cost profile (a `--costs` JSON as the main job caches it, or the one
recorded at collection), then, for each number of train prompts, value heads on all signals are fitted on that
many prompts drawn from the rest and followed greedily on the held-out prompts (the value planner: what the
distilled scheduler approximates). If tokens/s keeps rising with the train prompts, more trajectories pay.
Beside it, the one schedule fastest on the train prompts, used for every held-out round: what the signals
add over no decision at all. `--history` fits a second planner on rounds whose two timing signals (constant
within one device's fit, so left out of it) are replaced by the previous round's accepted lengths (under the
schedule that advanced the collection, and under all-small): whether recent acceptance predicts the next
round's. `--root-signals` fits a third on rounds whose three device-constant signals (the two timings and
their log ratio) are replaced by what the round's root says before any drafting: the target's probability of
the root token where it produced it, that distribution's entropy, and log1p of the longest earlier match of
the context's suffix (the n-gram drafter copies from there); the target's greedy reference of every prompt
is decoded again for it (bf16: minutes on a CPU). Last, the ceilings of policies that pick one schedule in
hindsight per benchmark and per prompt (every collected prompt but MT-Bench's): how much of the per-round
oracle any choice coarser than a round can reach.

    python -m jobs.bench.data --data treegraft_dist/data/trajectories/qwen2.5-coder-1.5b+0.5b-instruct \
        --costs ~/.cache/treegraft/models/profiles/<key>--costs.json --budget 12 --train 10,20,30 --seeds 0,1,2

Prints a table (mean over seeds; each seed draws its own held-out and train prompts) and writes it as CSV
with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from treegraft_dist.decoding.costs import CostModel
from treegraft_dist.decoding.schedule import SCHEDULES
from treegraft_dist.files import write_csv
from treegraft_dist.scheduling.collect import read_trajectories
from treegraft_dist.scheduling.device import priced
from treegraft_dist.scheduling.fit import (
    call_cap,
    oracle_schedules,
    reference_speeds,
    schedules_from_margins,
    speed,
)
from treegraft_dist.scheduling.inputs import longest_match, with_history, with_root
from treegraft_dist.scheduling.value import CANDIDATE_SUBSETS, feasible, fit_value_heads


def feasible_schedules(cap: int) -> list[int]:
    return [int(s) for s in np.flatnonzero(feasible(cap))]


def root_features(traj) -> np.ndarray:  # [R, 3]: p(root), entropy where the root was produced, log1p(match)
    """Per round, from the target's greedy reference of its prompt decoded again with the embedded target."""
    import torch

    from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
    from treegraft_dist.models.loading import load_model
    from treegraft_dist.models.paths import cache_root
    from treegraft_dist.models.prepare import MARKER_NAME
    from treegraft_dist.scheduling.collect import reference_decode

    source = cache_root() / "qwen2.5-coder-1.5b-instruct"
    if not (source / MARKER_NAME).is_file():
        sys.exit(f"--root-signals decodes with the embedded target: run `treegraft prepare-models` first ({source})")
    target = load_model(str(source), "cpu", "auto")
    t = traj.table
    bench = np.asarray(t.column("benchmark").to_pylist())
    ids = np.asarray(t.column("prompt_id").to_pylist())
    position = t.column("position").to_numpy()
    prompt_len = t.column("prompt_len").to_numpy()
    out = np.zeros((t.num_rows, 3))
    keys = sorted(set(zip(bench.tolist(), ids.tolist())))
    for b, q_id in tqdm(keys, desc="references decoded again", unit="prompt"):
        rows = np.flatnonzero((bench == b) & (ids == q_id))
        question = next(q for q in builtin(b) if q.question_id == q_id)
        prompt = chat_prompt(target.tokenizer, [question.turns[0]], [])
        if len(prompt) != prompt_len[rows[0]]:
            sys.exit(f"{b}/{q_id}: the prompt has {len(prompt)} tokens here and {prompt_len[rows[0]]} in the data")
        ref, _ = reference_decode(target.lm, prompt, int(position[rows].max()) + 1, set(target.eos_ids))
        seq = prompt + ref
        with torch.inference_mode():
            logp = torch.log_softmax(target.lm.logits(target.lm.hidden(target.lm.new_cache(), torch.tensor(seq),
                                                                     torch.arange(len(seq)))), -1)
        top = logp.max(-1).values.exp().numpy()  # [len(seq)]: row i, the target's confidence in token i + 1
        entropy = -(logp.exp() * logp).sum(-1).numpy()
        for r in rows:
            produced = min(len(prompt) + int(position[r]) - 2, len(seq) - 1)  # the row that gave the root
            context = seq[: len(prompt) + int(position[r])]
            out[r] = top[produced], entropy[produced], np.log1p(longest_match(context))
    return out


def hindsight(rounds, cap: int, groups: np.ndarray) -> float:
    """Tokens/s when each group of rounds runs the one feasible schedule fastest on that group."""
    best = np.zeros(len(rounds), np.int64)
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        part = rounds.take(idx)
        best[idx] = max(feasible_schedules(cap), key=lambda s: speed(part, np.full(len(part), s)))
    return speed(rounds, best)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a `treegraft collect` output folder")
    p.add_argument("--costs", default=None, help="a cost profile JSON (default: the one recorded at collection)")
    p.add_argument("--budget", type=int, default=12, help="recorded tree budget to price the rounds at")
    p.add_argument("--heldout", type=int, default=20, help="held-out prompts (the same for every train size)")
    p.add_argument("--train", type=ints, default=[10, 20, 30], help="train prompt counts, comma-separated")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--history", action="store_true", help="also fit on the previous round's accepted lengths")
    p.add_argument("--root-signals", action="store_true",
                   help="also fit on what the round's root says (target confidence and entropy, suffix match)")
    p.add_argument("--out", default=None, help="CSV of the per-seed rows")
    args = p.parse_args()

    traj = read_trajectories(args.data)
    if args.costs:
        costs = Path(args.costs).expanduser()
        if not costs.is_file():
            sys.exit(f"--costs {args.costs}: no such file; give a <cache>/profiles/*--costs.json that `treegraft "
                     "eval` or `treegraft fit --for-device` wrote")
        traj = priced(traj, CostModel.from_dict(json.loads(costs.read_text())))
    if args.budget not in traj.budgets:
        sys.exit(f"budget {args.budget} was not recorded in {args.data}: use one of {list(traj.budgets)}")
    rounds = traj.rounds(args.budget)
    cap = call_cap(traj.cost, args.budget)
    variants = {"signals": rounds, **({"signals + history": with_history(traj, rounds)} if args.history else {})}
    if args.root_signals:
        features = root_features(traj)
        variants["signals + root"] = with_root(rounds, features)
        calls_best = np.array([sum(SCHEDULES[s]) for s in oracle_schedules(rounds, cap)])
        names = ("target p(root)", "entropy at the root", "log1p suffix match")
        print("correlation with the oracle's middle calls a round / with all-small's accepted length: " + "; ".join(
            f"{n} {np.corrcoef(features[:, j], calls_best)[0, 1]:+.2f} / "
            f"{np.corrcoef(features[:, j], rounds.accepted[:, 0])[0, 1]:+.2f}" for j, n in enumerate(names)))
    keep = rounds.benchmarks != "mt_bench"
    prompts = np.unique(rounds.prompt_ids[keep])
    if args.heldout + max(args.train) > len(prompts):
        sys.exit(f"{len(prompts)} prompts collected: {args.heldout} held out leaves fewer than {max(args.train)} "
                 "to train on; lower --heldout or --train")

    rows = []
    with tqdm(total=len(args.seeds) * len(args.train) * len(variants), desc="fitting value heads", unit="fit") as bar:
        for seed in args.seeds:
            order = np.random.default_rng(seed).permutation(prompts)
            held_ids, pool = order[:args.heldout], order[args.heldout:]
            for name, view in variants.items():
                held = view.take(np.flatnonzero(np.isin(view.prompt_ids, held_ids)))
                ref = reference_speeds(held, cap)
                for n in args.train:
                    train = view.take(np.flatnonzero(np.isin(view.prompt_ids, pool[:n])))
                    heads = fit_value_heads(train, CANDIDATE_SUBSETS["all"], seed=seed)
                    planner = speed(held, schedules_from_margins(heads.margins(held.signals, cap), cap))
                    fixed = max(feasible_schedules(cap), key=lambda s: speed(train, np.full(len(train), s)))
                    rows.append({"inputs": name, "seed": seed, "train_prompts": n, "train_rounds": len(train),
                                 "heldout_rounds": len(held), "heldout_error": heads.heldout_error(held)["mean"],
                                 "planner_tok_s": planner, "oracle_tok_s": ref["oracle"],
                                 "all_small_tok_s": ref["all-small"], "of_oracle": planner / ref["oracle"],
                                 "fixed_schedule": fixed,
                                 "fixed_of_oracle": speed(held, np.full(len(held), fixed)) / ref["oracle"]})
                    bar.update()

    print(f"\n{traj.cost.device}, budget {args.budget}, call cap {cap}; {args.heldout} held-out prompts, "
          f"mean of {len(args.seeds)} seeds\n")
    print("| planner inputs | train prompts | train rounds | held-out error | planner tok/s | oracle tok/s | "
          "planner / oracle | best fixed schedule / oracle |")
    print("|---|---|---|---|---|---|---|---|")
    for name in variants:
        for n in args.train:
            sel = [r for r in rows if r["train_prompts"] == n and r["inputs"] == name]
            mean = {k: float(np.mean([r[k] for r in sel])) for k in sel[0] if k not in ("seed", "inputs")}
            print(f"| {name} | {n} | {mean['train_rounds']:.0f} | {mean['heldout_error']:.3f} | "
                  f"{mean['planner_tok_s']:.2f} | {mean['oracle_tok_s']:.2f} | {mean['of_oracle']:.1%} | "
                  f"{mean['fixed_of_oracle']:.1%} |")

    every = rounds.take(np.flatnonzero(keep))
    top = reference_speeds(every, cap)["oracle"]
    print(f"\nHindsight ceilings on all {len(prompts)} prompts ({len(every)} rounds): one schedule for all "
          f"{hindsight(every, cap, np.zeros(len(every))) / top:.1%}, one per benchmark "
          f"{hindsight(every, cap, every.benchmarks) / top:.1%}, one per prompt "
          f"{hindsight(every, cap, every.prompt_ids) / top:.1%} of the per-round oracle ({top:.2f} tok/s)")
    if args.out:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
