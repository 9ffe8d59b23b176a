"""Trajectories for the scheduler: every round of a reference decode, drafted under all 32 schedules.

For one prompt the target first decodes greedily (the reference). Each round then starts from a point
of that reference (root = the last accepted token) and grows the tree under every D-bit schedule,
depth-first, so schedules share prefixes: 63 prefix states, 31 middle calls and 31 n-gram steps a round
instead of 32 x 5 steps. At every prefix state the 17 signals are recorded; for every complete schedule,
at every recorded budget, the tree is pruned as the engine would and its accepted length is read off the
reference: the longest prefix of the target's greedy continuation that is a path in the pruned tree,
plus the bonus token. No target pass per schedule is needed (tests check this equals a real
verification pass).

How the reference advances between rounds: by the accepted length of the round's best schedule (most
tokens per second under the cost model) at the largest recorded budget, which is where a good scheduler
would be next. The middle drafter's cache then keeps only the context, as at the start of any round.

Latency of a schedule comes from the cost model measured on this device (`CostModel`): per layer one
scheduler call plus either an n-gram step or the middle drafter's forwards (priced by the tokens each
processes), then one verification of the pruned tree (priced by its size). Recorded are the raw
quantities (forward sizes, pruned sizes), so latencies can be recomputed under another cost model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from ..decoding.config import TreeConfig
from ..decoding.costs import CostModel
from ..decoding.engine import check_request, truncate
from ..decoding.neural import NeuralDrafter
from ..decoding.ngram import NGramDrafter
from ..decoding.sampling import SamplingParams
from ..decoding.schedule import NUM_SCHEDULES
from ..decoding.signals import MAX_LAYERS, NUM_SIGNALS, compute_signals, context_signals
from ..decoding.tree import DraftTree, next_frontier
from ..decoding.verify import TargetVerifier
from ..models.hf import CausalLM
from .value import NUM_DECISION_STATES, NUM_STATES

D = MAX_LAYERS
FORWARDS_PER_CALL = 2  # a middle call runs the unseen internal nodes, then the unseen selected nodes


# -- one round, every schedule ------------------------------------------------------------------------

@dataclass
class RoundRecord:
    """One round of one prompt under all 32 schedules (prefix states in heap order, see value.py)."""

    position: int  # tokens generated before the round; the root is the last of them
    signals: np.ndarray  # [63, 17] float32
    forwards: np.ndarray  # [63, 2] int64: middle forward sizes of the step into each state (0, 0 = n-gram)
    full_size: np.ndarray  # [32] int64: tree size before pruning
    tree_size: np.ndarray  # [B, 32] int64: pruned size per recorded budget
    accepted: np.ndarray  # [B, 32] int64: accepted length (bonus included) per recorded budget
    behaviour: int = -1  # schedule whose accepted length advanced the reference


def accepted_length(tree: DraftTree, continuation) -> int:
    """Accepted length of a (pruned) tree under greedy verification, bonus token included: the longest
    root path spelling a prefix of the target's greedy continuation after the root, plus one."""
    return len(tree.follow(continuation)) + 1


def enumerate_round(root: int, cfg: TreeConfig, ngram: NGramDrafter, middle: NeuralDrafter,
                    context: np.ndarray, continuation: list[int], budgets: tuple[int, ...],
                    max_calls: int | None = None) -> RoundRecord:
    """Draft one round under every schedule from shared prefixes. `context`: the request's 4 context
    signals; `continuation`: the target's greedy tokens after the root. With `max_calls`, schedules with
    more middle calls are not built (their states keep zero signals, their accepted length 0). Drafter
    states are left as at the start of the round (the middle drafter may have processed the root)."""
    if cfg.depth != D:
        raise ValueError(f"trajectories enumerate {D}-layer schedules; the tree config has depth {cfg.depth}")
    signals = np.zeros((NUM_STATES, NUM_SIGNALS), np.float32)
    forwards = np.zeros((NUM_STATES, FORWARDS_PER_CALL), np.int64)
    full = np.zeros(NUM_SCHEDULES, np.int64)
    sizes = np.zeros((len(budgets), NUM_SCHEDULES), np.int64)
    accepted = np.zeros((len(budgets), NUM_SCHEDULES), np.int64)
    middle.prefetch(root)

    def visit(state: int, tree: DraftTree, frontier: np.ndarray, calls: list[bool]) -> None:
        layer = len(calls)
        signals[state] = compute_signals(tree, frontier, layer, calls, cfg.depth, cfg.lookback, cfg.top_k, context)
        if layer == cfg.depth:
            s = state - NUM_DECISION_STATES
            full[s] = tree.size
            for j, b in enumerate(budgets):
                pruned, _ = tree.prune(b)
                sizes[j, s] = pruned.size
                accepted[j, s] = accepted_length(pruned, continuation)
            return
        saved = middle.snapshot()
        for call in (False, True) if max_calls is None or sum(calls) < max_calls else (False,):
            child, drafter = tree.copy(), middle if call else ngram
            if call:
                middle.restore(saved)
                first = len(middle.forward_sizes)
            proposal = drafter.step(child, frontier, layer + 1)
            if call:
                done = middle.forward_sizes[first:]
                forwards[2 * state + 2, : len(done)] = done
            ids = child.graft(proposal, layer + 1)
            nxt = next_frontier(child, proposal, ids, cfg.top_k) if len(proposal) else frontier
            visit(2 * state + 1 + int(call), child, nxt, calls + [call])
        middle.restore(saved)

    visit(0, DraftTree(root), np.zeros(1, np.int64), [])
    return RoundRecord(0, signals, forwards, full, sizes, accepted)


def reference_decode(target: CausalLM, prompt: list[int], n: int, eos: set[int]):
    """The target's greedy continuation (n tokens, cut after eos) and its prefill cache."""
    verifier = TargetVerifier(target, SamplingParams())
    tok, prefill = verifier.prefill(prompt)
    out = [tok]
    while len(out) < n and tok not in eos:
        tok = verifier.step(tok)
        out.append(tok)
    return truncate(out, n, eos), prefill


class Collector:
    """Trajectories of whole prompts on one model pair."""

    def __init__(self, target: CausalLM, middle: CausalLM, cfg: TreeConfig, cost: CostModel,
                 budgets: tuple[int, ...] | None = None, max_calls: int | None = None):
        """`max_calls`: schedules with more middle calls are neither built nor chosen to advance the
        reference (a call budget)."""
        self.target, self.middle, self.cfg, self.cost = target, middle, cfg, cost
        self.max_calls = max_calls
        self.budgets = tuple(sorted(budgets or cost.verify_ms))
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be sizes >= 1, got {self.budgets}")

    def rounds(self, prompt: list[int], max_new_tokens: int, eos=(), progress: bool = False) -> list[RoundRecord]:
        check_request(prompt, max_new_tokens)
        cfg, eos = self.cfg, set(eos)
        lookahead = cfg.max_tree_depth + 1
        ref, prefill = reference_decode(self.target, prompt, max_new_tokens + lookahead, eos)
        limit = len(truncate(ref, max_new_tokens, eos))
        # The context signals use the timings of the largest budget; fitting rewrites them per budget.
        context = context_signals(len(prompt), self.cost.timings(max(self.budgets)))
        ngram = NGramDrafter.from_config(cfg)
        middle = NeuralDrafter(self.middle, cfg.top_k, cfg.lookback, cfg.middle_window)
        for d in (ngram, middle):
            d.start(prompt, prefill)
            d.accept([], ref[:1])
        out, pos, catch_up = [], 1, 1
        bar = tqdm(total=limit, desc="tokens", unit="tok", file=sys.stderr, disable=not progress, leave=False)
        bar.update(1)
        while pos < limit and ref[pos - 1] not in eos:
            rec = enumerate_round(ref[pos - 1], cfg, ngram, middle, context, ref[pos:], self.budgets, self.max_calls)
            rec.position = pos
            lat = self.cost.schedule_latency(rec.forwards, rec.tree_size[-1:], catch_up)[0]
            rate = rec.accepted[-1] / lat  # schedules over max_calls were not built: accepted 0
            rec.behaviour = int(np.flatnonzero(rate == rate.max())[0])
            out.append(rec)
            step = int(rec.accepted[-1, rec.behaviour])
            tokens = ref[pos : pos + step]
            for d in (ngram, middle):
                d.accept([0], tokens)
            pos += len(tokens)
            catch_up = len(tokens)
            bar.update(len(tokens))
        bar.close()
        return out


# -- storage: one Parquet file per prompt ---------------------------------------------------------------

SCHEMA_VERSION = 1
MANIFEST = "collect.json"
ROUNDS_DIR = "rounds"
HELD_OUT_BENCHMARKS = ("mt_bench",)  # never collected, never fitted on

ROUND_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),  # question id within its benchmark
    ("benchmark", pa.string()),
    ("round", pa.int32()),  # 0-based round of the reference decode
    ("position", pa.int32()),  # tokens generated before the round (the root is the last of them)
    ("prompt_len", pa.int32()),
    ("signals", pa.list_(pa.float32(), NUM_STATES * NUM_SIGNALS)),  # [63, 17], heap-ordered states
    ("forwards", pa.list_(pa.int32(), NUM_STATES * FORWARDS_PER_CALL)),  # [63, 2] middle forward sizes
    ("full_size", pa.list_(pa.int32(), NUM_SCHEDULES)),  # [32] tree size before pruning
    ("budgets", pa.list_(pa.int32())),  # [B] recorded budgets
    ("tree_size", pa.list_(pa.int32())),  # [B, 32] pruned size
    ("accepted", pa.list_(pa.int32())),  # [B, 32] accepted length, bonus token included
    ("latency_ms", pa.list_(pa.float64())),  # [B, 32] under the run's cost model
    ("behaviour", pa.int8()),  # schedule that advanced the reference
])


def part_name(benchmark: str, prompt_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{benchmark}--{prompt_id}")
    return f"{safe}.parquet"


def catch_up_tokens(records, r: int) -> int:
    """Tokens the middle drafter has to catch up on at the start of round r: the root plus what the previous
    round accepted before it. The prompt itself, processed by the first call of a request whatever the
    schedule, is a per-request cost and not charged to round 0."""
    return 1 if r == 0 else records[r].position - records[r - 1].position


def records_table(records: list[RoundRecord], benchmark: str, prompt_id: str, prompt_len: int,
                  budgets: tuple[int, ...], cost: CostModel) -> pa.Table:
    rows = []
    for r, rec in enumerate(records):
        rows.append({
            "prompt_id": prompt_id, "benchmark": benchmark, "round": r, "position": rec.position,
            "prompt_len": prompt_len, "signals": rec.signals.reshape(-1).tolist(),
            "forwards": rec.forwards.reshape(-1).tolist(), "full_size": rec.full_size.tolist(),
            "budgets": list(budgets), "tree_size": rec.tree_size.reshape(-1).tolist(),
            "accepted": rec.accepted.reshape(-1).tolist(),
            "latency_ms": cost.schedule_latency(rec.forwards, rec.tree_size,
                                                catch_up_tokens(records, r)).reshape(-1).tolist(),
            "behaviour": rec.behaviour,
        })
    return pa.Table.from_pylist(rows, schema=ROUND_SCHEMA)


@dataclass
class Trajectories:
    """A collection run read back: its manifest and all rounds."""

    manifest: dict
    table: pa.Table

    @property
    def cost(self) -> CostModel:
        return CostModel.from_dict(self.manifest["cost_model"])

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(self.manifest["budgets"])

    def rounds(self, budget: int):
        """The value system's view (value.Rounds) at one recorded budget: accepted lengths and latencies of
        that budget; context timings rewritten to what the engine measures at that budget."""
        from .value import Rounds

        if budget not in self.budgets:
            raise ValueError(f"budget {budget} was not recorded; this collection has {list(self.budgets)}")
        j = self.budgets.index(budget)
        t, cost, b = self.table, self.cost, len(self.budgets)
        n = t.num_rows
        signals = _column(t, "signals", np.float32).reshape(n, NUM_STATES, NUM_SIGNALS).copy()
        timings = cost.timings(budget)
        ctx = context_signals(1, timings)
        signals[:, :, 1:4] = ctx[1:4]
        forwards = _column(t, "forwards", np.int64).reshape(n, NUM_STATES, FORWARDS_PER_CALL)
        sizes = _column(t, "tree_size", np.int64).reshape(n, b, NUM_SCHEDULES)[:, j]
        accepted = _column(t, "accepted", np.int64).reshape(n, b, NUM_SCHEDULES)[:, j]
        rounds_col = t.column("round").to_numpy()
        position = t.column("position").to_numpy()
        catch_up = np.where(rounds_col == 0, 1, position - np.r_[0, position[:-1]])
        latency = np.stack([cost.schedule_latency(f, s[None], int(c))[0]
                            for f, s, c in zip(forwards, sizes, catch_up)])
        benchmarks = t.column("benchmark").to_numpy(zero_copy_only=False)
        # Question ids repeat across benchmarks (question 20 of gsm8k and of alpaca): a prompt is both.
        prompts = np.char.add(np.char.add(benchmarks.astype(str), "/"),
                              t.column("prompt_id").to_numpy(zero_copy_only=False).astype(str))
        return Rounds(signals, accepted, latency, prompts, benchmarks)


def _column(t: pa.Table, name: str, dtype) -> np.ndarray:
    return np.asarray(pc.list_flatten(t.column(name)).to_numpy(zero_copy_only=False), dtype)


def read_trajectories(folder: str | Path) -> Trajectories:
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{folder} has no {MANIFEST}: it is not a `treegraft collect` output folder")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{folder} was written with trajectory schema {manifest.get('schema_version')!r}; this "
                         f"version reads {SCHEMA_VERSION}: collect again")
    parts = sorted((folder / ROUNDS_DIR).glob("*.parquet"))
    if not parts:
        raise ValueError(f"{folder / ROUNDS_DIR} holds no rounds yet: run `treegraft collect` first")
    table = pa.concat_tables([pq.read_table(p, schema=ROUND_SCHEMA) for p in parts])
    return Trajectories(manifest, table)
