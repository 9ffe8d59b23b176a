"""Trajectories: every enumerated schedule equals the engine's own round, and accepted lengths read off
the greedy continuation equal real verification passes."""

import random

import numpy as np
import pyarrow as pa
import pytest
from tiny import VOCAB, hf_greedy, tiny_pair

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import CostModel
from treegraft_dist.decoding.engine import Decoder, draft_tree
from treegraft_dist.decoding.neural import NeuralDrafter
from treegraft_dist.decoding.ngram import NGramDrafter
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import SCHEDULES, ReplaySchedule
from treegraft_dist.decoding.signals import Timings, context_signals
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import ORIGIN_NGRAM, DraftTree, Proposal
from treegraft_dist.decoding.verify import TargetVerifier
from treegraft_dist.scheduling.artifact import load_artifact
from treegraft_dist.scheduling.collect import Collector, Trajectories, accepted_length, records_table
from treegraft_dist.scheduling.fit import call_cap, feasible, fit, oracle_schedules
from treegraft_dist.scheduling.value import ValuePlanner, state_index

COST = CostModel("test", ngram_ms=1.0, scheduler_ms=0.3, middle_ms={1: 20.0, 8: 24.0, 64: 60.0},
                 verify_ms={1: 100.0, 4: 110.0, 16: 150.0, 32: 200.0})
BUDGETS = (4, 16, 32)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", "close", seed=3)


def prompt_of(seed, length=20):
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(7)]
    return (head * 4)[:length] if seed % 2 else [rng.randrange(VOCAB) for _ in range(length)]


def random_tree(root: int, greedy: list[int], rng: random.Random, n: int = 30) -> DraftTree:
    """Random shape; a node's token is the greedy continuation of its path half the time."""
    tree = DraftTree(root)
    for _ in range(n):
        parent = rng.randrange(tree.size)
        depth = int(tree.depths[parent])
        on_line = tree.follow(greedy[:depth]) == tree.path(parent)[1:]
        token = greedy[depth] if on_line and depth < len(greedy) and rng.random() < 0.5 else rng.randrange(VOCAB)
        if tree.child(parent, token) is None:
            tree.graft(Proposal(tree.size, np.array([parent]), np.array([token]), np.array([-rng.random()]),
                                ORIGIN_NGRAM), 1)
    return tree


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accepted_length_from_the_greedy_continuation_equals_a_verification_pass(pair, seed):
    target, _ = pair
    rng = random.Random(seed)
    for k in range(4):
        prompt = prompt_of(10 * seed + k)
        greedy = hf_greedy(target, prompt, 24)
        verifier = TargetVerifier(target, SamplingParams())
        first, _ = verifier.prefill(prompt)
        assert first == greedy[0]
        tree = random_tree(first, greedy[1:], rng)
        verdict = verifier.verify(tree)
        assert accepted_length(tree, greedy[1:]) == len(verdict.tokens)
        assert verdict.tokens == greedy[1 : 1 + len(verdict.tokens)]
        assert len(verdict.tokens) > 1 or not tree.follow(greedy[1:2])  # the random trees do hit the line


class Recorder:
    """A fixed schedule that keeps the signals the engine computes before each layer."""

    needs_signals = True
    name = "recorder"

    def __init__(self, bits):
        self.bits, self.seen = list(bits), []

    def decide(self, signals, layer):
        self.seen.append(signals.copy())
        return bool(self.bits[layer])


@pytest.mark.parametrize("seed", [1, 4])
def test_every_enumerated_schedule_equals_the_engine_round(pair, seed):
    target, middle = pair
    cfg = TreeConfig(budget=max(BUDGETS))
    prompt = prompt_of(seed)
    records = Collector(target, middle, cfg, COST, BUDGETS).rounds(prompt, 16)
    assert len(records) >= 3
    greedy = hf_greedy(target, prompt, 16 + cfg.max_tree_depth + 1)
    context = context_signals(len(prompt), COST.timings(max(BUDGETS)))
    for rec in records[:3]:
        pos = rec.position
        for s in range(32):
            verifier = TargetVerifier(target, SamplingParams())
            _, prefill = verifier.prefill(prompt)
            ngram = NGramDrafter(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth)
            mid = NeuralDrafter(middle, cfg.top_k, cfg.lookback)
            for d in (ngram, mid):
                d.start(prompt, prefill)
                d.accept([], greedy[:1])
                d.accept([0], greedy[1:pos])
            policy = Recorder(SCHEDULES[s])
            tree, calls = draft_tree(greedy[pos - 1], cfg, policy, ngram, mid, PhaseTimer(RequestStats("x")), context)
            assert calls == [bool(b) for b in SCHEDULES[s]]
            assert tree.size == rec.full_size[s]
            for layer, sig in enumerate(policy.seen):
                np.testing.assert_allclose(rec.signals[state_index(SCHEDULES[s][:layer])], sig, rtol=1e-5, atol=1e-6)
            for j, b in enumerate(BUDGETS):
                pruned, _ = tree.prune(b)
                assert pruned.size == rec.tree_size[j, s]
                assert accepted_length(pruned, greedy[pos:]) == rec.accepted[j, s]


def test_replaying_the_chosen_schedules_reproduces_rounds_and_target_output(pair):
    target, middle = pair
    cfg = TreeConfig(budget=max(BUDGETS))
    prompt = prompt_of(5)
    records = Collector(target, middle, cfg, COST, BUDGETS).rounds(prompt, 24)
    patterns = ["".join(map(str, SCHEDULES[r.behaviour])) for r in records]
    gen = Decoder(target, middle, cfg).generate(prompt, 24, ReplaySchedule(patterns))
    assert gen.tokens == hf_greedy(target, prompt, 24)
    assert gen.stats.accepted == [int(r.accepted[-1, r.behaviour]) for r in records]
    assert [r.position for r in records] == list(1 + np.cumsum([0] + gen.stats.accepted[:-1]))


def test_schedule_latency_adds_the_steps_of_each_schedule():
    forwards = np.zeros((63, 2), np.int64)
    forwards[1 * 2 + 2] = (3, 8)  # state 4: call at layer 1 after a skip at layer 0 (prefix 01)
    forwards[4 * 2 + 2] = (5, 2)  # state 10: call at layer 2 after prefix 01 (prefix 011)
    sizes = np.full((1, 32), 16)
    fixed = 5 * COST.scheduler_ms + 150.0
    lat = COST.schedule_latency(forwards, sizes, catch_up=4)[0]
    assert lat[0] == pytest.approx(5 * COST.ngram_ms + fixed)
    # 01000: the one call runs the 4 catch-up tokens in its first forward.
    assert lat[0b01000] == pytest.approx(COST.middle(3 + 4) + COST.middle(8) + 4 * COST.ngram_ms + fixed)
    # 01100: only the first call of the round pays the catch-up.
    assert lat[0b01100] == pytest.approx(COST.middle(7) + COST.middle(8) + COST.middle(5) + COST.middle(2)
                                         + 3 * COST.ngram_ms + fixed)
    # 10000: a call at layer 0 has only the root to run (processed before the round in trajectories):
    # at run time that forward is the catch-up itself.
    assert lat[0b10000] == pytest.approx(COST.middle(4) + 4 * COST.ngram_ms + fixed)
    assert COST.middle(128) == pytest.approx(60.0 + 64 * (36.0 / 56))  # linear past the last point
    assert CostModel.from_dict(COST.to_dict()) == COST


class AlwaysCall:
    needs_signals = False
    name = "always"

    def __init__(self, budgeted):
        self.budgeted = budgeted

    def decide(self, signals, layer):
        return True


@pytest.mark.parametrize("budgeted, timings, cap", [(True, (100.0, 40.0), 2), (True, (100.0, 200.0), 0),
                                                    (False, (100.0, 40.0), 5)])
def test_budgeted_policies_get_b0_middle_calls_a_round(pair, budgeted, timings, cap):
    target, middle = pair
    prompt = prompt_of(2)
    gen = Decoder(target, middle, TreeConfig(budget=16, deepen=0), timings=Timings(*timings)).generate(
        prompt, 12, AlwaysCall(budgeted))
    assert gen.tokens == hf_greedy(target, prompt, 12)
    assert set(gen.stats.middle_calls) == {cap}


def test_fit_on_collected_rounds_gives_an_artifact_the_engine_runs(pair, tmp_path):
    target, middle = pair
    cfg = TreeConfig(budget=max(BUDGETS))
    collector = Collector(target, middle, cfg, COST, BUDGETS)
    tables = []
    for k in range(6):
        prompt = prompt_of(20 + k)
        tables.append(records_table(collector.rounds(prompt, 16), "gsm8k" if k % 2 else "qa", f"q{k}", len(prompt),
                                    BUDGETS, COST))
    manifest = {"pair": ["t", "m"], "cost_model": COST.to_dict(), "budgets": list(BUDGETS), "tree": cfg.to_dict(),
                "max_new_tokens": 16}
    traj = Trajectories(manifest, pa.concat_tables(tables))
    sched, heads, report = fit(traj, tmp_path / "s.npz", heldout_fraction=0.34, value_fit={"epochs": 5},
                               scheduler_fit={"epochs": 5}, log=lambda *a: None)
    assert report.budget in BUDGETS and report.call_cap == call_cap(COST, report.budget) == 0 + int(
        COST.verify(report.budget) // COST.middle(report.budget))
    assert report.train_rounds + report.heldout_rounds == traj.table.num_rows
    assert set(report.candidates) == {"all", "context+prefix", "tree+prefix", "ratio-only"}
    assert "oracle" in report.table()
    # The oracle is the best schedule of every round: no policy beats it on any round.
    rounds = traj.rounds(report.budget)
    best = oracle_schedules(rounds, report.call_cap)
    tps = rounds.tokens_per_s() * feasible(report.call_cap)
    assert (tps[np.arange(len(rounds)), best] >= tps.max(1) - 1e-9).all()

    loaded, loaded_heads = load_artifact(tmp_path / "s.npz", expect_pair=("t", "m"))
    assert loaded.info.cost_profile["budget"] == report.budget and loaded.info.split["heldout"]
    x = rounds.decision_signals()
    assert [loaded.decide(v, 0) for v in x] == [sched.decide(v, 0) for v in x]
    prompt = prompt_of(9)
    for policy in (loaded, ValuePlanner(loaded_heads, report.call_cap)):
        gen = Decoder(target, middle, TreeConfig(budget=report.budget)).generate(prompt, 16, policy)
        assert gen.tokens == hf_greedy(target, prompt, 16)


def test_a_call_budget_skips_unreachable_schedules_and_keeps_the_others(pair):
    target, middle = pair
    cfg = TreeConfig(budget=max(BUDGETS))
    prompt = prompt_of(6)
    full = Collector(target, middle, cfg, COST, BUDGETS).rounds(prompt, 8)
    capped = Collector(target, middle, cfg, COST, BUDGETS, max_calls=1).rounds(prompt, 8)
    ok = SCHEDULES.sum(1) <= 1
    for a, b in zip(full, capped):
        if a.position != b.position:
            break  # the capped reference may advance differently from here
        np.testing.assert_array_equal(a.accepted[:, ok], b.accepted[:, ok])
        np.testing.assert_array_equal(a.tree_size[:, ok], b.tree_size[:, ok])
        assert (b.accepted[:, ~ok] == 0).all()
        assert SCHEDULES[b.behaviour].sum() <= 1
