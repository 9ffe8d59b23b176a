"""The learned scheduler: its size, its fast forward against the torch module, the artifact (round trip
and refusals), exact margins against brute force, distillation recovering a known rule, and the
scheduler as a policy in the engine (lossless whatever it decides, call budget respected)."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import VOCAB, hf_greedy, tiny_pair

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.scheduler import (
    LearnedScheduler,
    SchedulerArtifactError,
    SchedulerInfo,
    SchedulerMLP,
    versions,
)
from treegraft_dist.decoding.signals import NUM_SIGNALS, SIGNAL_NAMES, Timings
from treegraft_dist.scheduling import artifact, value

IDX = {name: i for i, name in enumerate(SIGNAL_NAMES)}
PAIR = ("tiny-target", "tiny-middle")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_scheduler(seed: int, subset=SIGNAL_NAMES) -> LearnedScheduler:
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SchedulerMLP(subset, rng.normal(size=NUM_SIGNALS), rng.uniform(0.5, 2.0, NUM_SIGNALS))
    with torch.no_grad():
        # Centre the margins so that calls and skips are both common on random_signals.
        model.net[4].bias -= model(torch.from_numpy(random_signals(500, seed + 100))).median()
    info = SchedulerInfo(PAIR, cost_profile={"device": "cpu", "ngram_ms": 0.9, "verify_ms": {"64": 30.0}},
                         split={"train": ["gsm8k/1", "qa/2"], "heldout": ["alpaca/3"]}, fit={"seed": seed})
    return LearnedScheduler(model, info)


def random_signals(n: int, seed: int) -> np.ndarray:  # [n, 17] float32
    return np.random.default_rng(seed).normal(size=(n, NUM_SIGNALS)).astype(np.float32) * 2


# -- the network and its fast forward -----------------------------------------------------------------

def test_parameter_count_is_3265():
    model = SchedulerMLP()
    assert sum(p.numel() for p in model.parameters()) == 3265
    assert {name for name, _ in model.named_buffers()} == {"mean", "std", "mask"}


@pytest.mark.parametrize("subset", [SIGNAL_NAMES, value.CANDIDATE_SUBSETS["ratio-only"]])
def test_fast_decide_agrees_with_the_torch_module(subset):
    sched = random_scheduler(1, subset)
    x = random_signals(2000, 2)
    with torch.no_grad():
        ref = sched.model(torch.from_numpy(x)).numpy()
    fast = np.array([sched.margin(row) for row in x])
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)
    clear = np.abs(ref) > 1e-4
    assert clear.mean() > 0.99 and 0.05 < (ref > 0).mean() < 0.95
    assert [sched.decide(row, 0) for row in x[clear]] == (ref[clear] > 0).tolist()
    # float64 signals are accepted too.
    assert sched.decide(x[0].astype(np.float64), 0) == sched.decide(x[0], 0)


def test_a_scheduler_through_rays_object_store_decides_as_before(ray_cluster):
    """What a Ray task returns, or an actor receives, is rebuilt on read-only views of the object store: the
    forward's buffers must still be writable (the served default and `fit_device_scheduler` go this way)."""
    import ray

    sched = random_scheduler(2, SIGNAL_NAMES)
    x = random_signals(200, 3)
    back = ray.get(ray.put(sched))
    remote = ray.get(ray.remote(lambda s, rows: [s.margin(r) for r in rows]).remote(sched, x))
    assert [back.margin(r) for r in x] == [sched.margin(r) for r in x] == remote


def test_signals_outside_the_subset_are_not_read():
    sched = random_scheduler(3, value.CANDIDATE_SUBSETS["ratio-only"])
    x = random_signals(50, 4)
    y = x.copy()
    y[:, [IDX["t_tgt_ms"], IDX["t_mid_ms"]]] = 1e4
    assert [sched.margin(r) for r in x] == [sched.margin(r) for r in y]


# -- the artifact -------------------------------------------------------------------------------------

def test_save_load_round_trip_keeps_decisions_and_metadata(tmp_path):
    sched = random_scheduler(5, value.CANDIDATE_SUBSETS["tree+prefix"])
    path = sched.save(tmp_path / "scheduler.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["scheduler.npz"]  # no temporary file left behind
    loaded = LearnedScheduler.load(path, expect_pair=PAIR)
    x = random_signals(1000, 6)
    assert [loaded.margin(r) for r in x] == [sched.margin(r) for r in x]
    assert loaded.subset == sched.subset == value.CANDIDATE_SUBSETS["tree+prefix"]
    assert loaded.info == sched.info
    assert (loaded.name, loaded.needs_signals) == ("treegraft", True)
    meta = json.loads(str(np.load(path)["meta_json"]))
    assert meta["versions"] == versions() and meta["signal_names"] == list(SIGNAL_NAMES)
    assert LearnedScheduler.load(path).info.pair == PAIR  # no expectation: any pair loads


def rewrite(path, **changes):
    """Rewrite an artifact with some arrays or metadata fields replaced (as another writer might)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta_json")))
    for key, new in changes.items():
        if key in arrays:
            arrays[key] = new
        else:
            meta[key] = new
    np.savez(path, **arrays, meta_json=np.array(json.dumps(meta)))


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b"not a scheduler at all" * 10), "corrupt or not a scheduler artifact"),
    (lambda p: p.write_bytes(p.read_bytes()[:-200]), "corrupt or not a scheduler artifact"),
    (lambda p: p.unlink(), "does not exist"),
    (lambda p: rewrite(p, signal_names=SIGNAL_NAMES[:16], mean=np.zeros(16, np.float32)),
     "fitted on 16 signals .* this package computes 17"),
    (lambda p: rewrite(p, signal_names=SIGNAL_NAMES[::-1]), "this package computes 17"),
    (lambda p: rewrite(p, w2=np.zeros((32, 60), np.float32)), r"wrong shape: w2 \(32, 60\) \(expected \(32, 64\)\)"),
    (lambda p: rewrite(p, b3=np.zeros(2, np.float32)), "wrong shape: b3"),
    (lambda p: rewrite(p, w1=np.full((64, 17), np.nan, np.float32)), "non-finite"),
    (lambda p: rewrite(p, subset=["t_tgt_ms", "gpu_temperature"]), "not a non-empty subset"),
    (lambda p: rewrite(p, format_version=99), "format version 99"),
    (lambda p: rewrite(p, pair=["other-target", "tiny-middle"]), "fitted for target/middle pair"),
])
def test_unusable_artifacts_are_refused_with_a_reason(tmp_path, damage, message):
    path = random_scheduler(7).save(tmp_path / "s.npz")
    damage(path)
    with pytest.raises(SchedulerArtifactError, match=message) as err:
        LearnedScheduler.load(path, expect_pair=PAIR)
    assert isinstance(err.value, ValueError)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    assert any(w in text for w in ("refit", "write it again", "pass the", "use the artifact"))


# -- exact margins ------------------------------------------------------------------------------------

def brute_force_margins(tps_of) -> dict[tuple[int, ...], float]:
    """prefix -> max tokens/s over schedules continuing prefix + [1], minus the same for prefix + [0]."""
    out = {}
    for layer in range(value.D):
        for prefix in itertools.product((0, 1), repeat=layer):
            q = [max(tps_of(prefix, a, tail) for tail in itertools.product((0, 1), repeat=value.D - layer - 1))
                 for a in (0, 1)]
            out[prefix] = q[1] - q[0]
    return out


def test_state_numbering():
    assert value.NUM_STATES == 63 and value.NUM_DECISION_STATES == 31 and value.NUM_QUERIES == 80
    for i in range(value.NUM_STATES):
        assert value.state_index(value.state_prefix(i)) == i
        if i < value.NUM_DECISION_STATES:
            assert value.state_prefix(2 * i + 1) == value.state_prefix(i) + (0,)
            assert value.state_prefix(2 * i + 2) == value.state_prefix(i) + (1,)
    for s, bits in enumerate(value.SCHEDULES):
        assert value.state_index(tuple(bits)) == value.NUM_DECISION_STATES + s


@settings(max_examples=60, deadline=None)
@given(acc=st.lists(st.integers(1, 12), min_size=32, max_size=32),
       lat=st.lists(st.floats(1.0, 500.0), min_size=32, max_size=32))
def test_oracle_margins_equal_brute_force(acc, lat):
    def tps_of(prefix, a, tail):
        s = int("".join(map(str, prefix + (a,) + tail)), 2)
        return acc[s] / (lat[s] / 1e3)

    got = value.oracle_margins(np.array([acc]), np.array([lat]))
    assert got.shape == (1, 31)
    for prefix, m in brute_force_margins(tps_of).items():
        assert got[0, value.state_index(prefix)] == pytest.approx(m, rel=1e-12, abs=1e-9), prefix


def test_value_heads_are_deterministic_with_a_seed():
    rounds = synthetic_rounds(4, seed=13)
    a, b = (value.fit_value_heads(rounds, seed=5, epochs=2, hidden=16) for _ in range(2))
    suffix = np.tile(value.QUERY_SUFFIX[:5], (2, 1))
    pa, pb = a.predict(rounds.signals[:2, :5].reshape(-1, NUM_SIGNALS), suffix), b.predict(
        rounds.signals[:2, :5].reshape(-1, NUM_SIGNALS), suffix)
    assert all(np.array_equal(pa[h], pb[h]) for h in value.HEADS)


def test_heads_trained_together_learn_what_each_learns_alone():
    """_train_together stacks several nets into batched products under one Adam: each net follows its own
    mini-batches and targets, as `_train` alone would (up to the order of floating-point sums)."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(600, 9)).astype(np.float32) for _ in range(3)]
    ys = [np.tanh(x[:, k]) + 0.1 * rng.normal(size=600) for k, x in enumerate(xs)]  # each net its own task
    alone, together = [], []
    for k in range(3):
        for out in (alone, together):
            torch.manual_seed(k)
            out.append(value._mlp(9, 16))
    for k in range(3):
        value._train(alone[k], xs[k], ys[k], 10 + k, 2, 3e-3, 128)
    value._train_together(together, xs, ys, [10 + k for k in range(3)], 2, 3e-3, 128)
    for a, b in zip(alone, together):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=1e-4)
        assert not b.training
    # Trained longer, each still learns its own target (not a neighbour's).
    value._train_together(together, xs, ys, [1, 2, 3], 30, 3e-3, 128)
    with torch.no_grad():
        fit = [float(np.mean((b(torch.from_numpy(x)).squeeze(-1).numpy() - y) ** 2) / np.var(y))
               for b, x, y in zip(together, xs, ys)]
    assert max(fit) < 0.2


def test_speed_bound_is_the_best_total_rate_of_any_schedule_choice():
    """The per-round oracle maximises each round's rate; the bound maximises total accepted / total time
    over every choice of one feasible schedule per round (brute force over 3 rounds here)."""
    from treegraft_dist.scheduling.fit import oracle_schedules, speed, speed_bound

    rounds = synthetic_rounds(3, seed=4)
    rng = np.random.default_rng(1)
    rounds.accepted = rng.integers(1, 12, size=rounds.accepted.shape).astype(np.float64)
    rounds.latency_ms = rng.uniform(20, 400, size=rounds.latency_ms.shape)
    # One slow round the per-round oracle cannot fix: a long low-rate schedule elsewhere lifts the total.
    rounds.accepted[0], rounds.latency_ms[0] = 1.0, 2000.0
    for cap in (None, 2):
        ok = np.flatnonzero(value.feasible(cap))
        best = max(speed(rounds, np.array(choice)) for choice in itertools.product(ok, repeat=len(rounds)))
        bound = speed_bound(rounds, cap)
        assert bound == pytest.approx(best, rel=1e-12)
        assert bound >= speed(rounds, oracle_schedules(rounds, cap))
    assert speed_bound(rounds, None) > speed(rounds, oracle_schedules(rounds, None))  # the case above


def test_value_head_margins_equal_brute_force():
    rounds = synthetic_rounds(3, seed=8)
    heads = value.fit_value_heads(rounds, epochs=0, seed=3)  # untrained: any function will do
    got = heads.margins(rounds.signals)
    for r in range(len(rounds)):
        def tps_of(prefix, a, tail):
            layer = len(prefix)
            suffix = np.zeros(2 * value.D, np.float32)
            suffix[layer + 1 : value.D] = tail
            suffix[value.D + layer + 1 :] = 1
            action = ("skip", "call")[a]
            p = heads.predict(rounds.signals[r, value.state_index(prefix)][None], suffix[None])
            return p[f"accepted_{action}"][0] / (np.exp(p[f"loglat_{action}"][0]) / 1e3)

        for prefix, m in brute_force_margins(tps_of).items():
            assert got[r, value.state_index(prefix)] == pytest.approx(m, rel=1e-6), prefix


# -- fitting ------------------------------------------------------------------------------------------

def test_distillation_recovers_a_known_rule():
    # True margin > 0 iff the frontier is shallow (depth < 2) and nothing was called yet.
    rng = np.random.default_rng(0)
    n = 3000
    x = rng.normal(size=(n, NUM_SIGNALS)).astype(np.float32)
    x[:, IDX["frontier_depth"]] = rng.uniform(0, 4, n)
    x[:, IDX["calls_frac"]] = rng.integers(0, 3, n) / 5
    margin = np.minimum(2.0 - x[:, IDX["frontier_depth"]], 0.5 - 5 * x[:, IDX["calls_frac"]])
    train, held = slice(0, 2000), slice(2000, n)
    model = value.fit_scheduler(x[train], margin[train], seed=0, epochs=40)
    sched = LearnedScheduler(model, SchedulerInfo(PAIR))
    decisions = np.array([sched.decide(row, 0) for row in x[held]])
    assert np.mean(decisions == (margin[held] > 0)) >= 0.95
    again = value.fit_scheduler(x[train], margin[train], seed=0, epochs=40)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def synthetic_rounds(n: int, seed: int) -> value.Rounds:
    """A world where the middle drafter's quality q (visible only in the tree signal reselect_score) sets
    what a call adds to the accepted length, and the raw target / middle milliseconds set the latency."""
    rng = np.random.default_rng(seed)
    sig = rng.normal(size=(n, value.NUM_STATES, NUM_SIGNALS)).astype(np.float32) * 0.1
    t_tgt, t_mid, q = rng.uniform(20, 80, n), rng.uniform(2, 20, n), rng.uniform(0, 1, n)
    sig[:, :, IDX["log_prompt_len"]] = np.log1p(rng.integers(10, 300, n))[:, None]
    sig[:, :, IDX["t_tgt_ms"]] = t_tgt[:, None]
    sig[:, :, IDX["t_mid_ms"]] = t_mid[:, None]
    sig[:, :, IDX["log_tgt_over_mid"]] = np.log(t_tgt / t_mid)[:, None]
    for i in range(value.NUM_STATES):
        prefix = value.state_prefix(i)
        sig[:, i, IDX["layer_frac"]] = len(prefix) / value.D
        sig[:, i, IDX["calls_frac"]] = sum(prefix) / value.D
        sig[:, i, IDX["called_0"] : IDX["called_0"] + len(prefix)] = prefix
        sig[:, i, IDX["frontier_depth"]] = len(prefix) + sum(prefix)
    sig[:, :, IDX["reselect_score"]] = q[:, None] + rng.normal(size=(n, value.NUM_STATES)) * 0.02
    calls = value.SCHEDULES.sum(1)
    accepted = 1 + 0.5 * (value.D - calls)[None] + 2.0 * q[:, None] * calls[None]
    latency = t_tgt[:, None] + calls[None] * t_mid[:, None] + (value.D - calls)[None] * 1.0
    prompts = np.array([f"p{seed}-{i // 4}" for i in range(n)])
    benchmarks = np.where(np.arange(n) % 10 == 0, "mt_bench", "gsm8k")
    return value.Rounds(sig, accepted, latency, prompts, benchmarks)


def test_split_keeps_prompts_on_one_side_and_mt_bench_out():
    rounds = synthetic_rounds(40, seed=9)
    train, held = value.split_rounds(rounds, 0.3, seed=0)
    assert not set(train.prompt_ids) & set(held.prompt_ids)
    assert "mt_bench" not in set(train.benchmarks) | set(held.benchmarks)
    assert len(train) + len(held) == int((rounds.benchmarks != "mt_bench").sum())


def test_rounds_refuse_bad_tables():
    good = synthetic_rounds(2, seed=10)
    with pytest.raises(ValueError, match="accepted must be finite and >= 1"):
        value.Rounds(good.signals, good.accepted - 1, good.latency_ms, good.prompt_ids, good.benchmarks)
    with pytest.raises(ValueError, match=r"signals has shape \(2, 31, 17\), expected \(2, 63, 17\)"):
        value.Rounds(good.signals[:, :31], good.accepted, good.latency_ms, good.prompt_ids, good.benchmarks)


def test_offline_stage_chooses_the_informative_subset_and_distils_it(tmp_path):
    rounds = synthetic_rounds(100, seed=11)
    train, held = value.split_rounds(rounds, 0.35, seed=0)
    info = SchedulerInfo(PAIR, split={"heldout": sorted(set(held.prompt_ids))})
    sched, choice = value.distil_scheduler(train, held, info, seed=0, value_fit=dict(epochs=10),
                                           scheduler_fit=dict(epochs=40))
    errors = choice.errors
    assert set(errors) == set(value.CANDIDATE_SUBSETS)
    assert choice.name == "all" and choice.subset == tuple(SIGNAL_NAMES) == sched.subset
    assert errors["all"]["mean"] == min(e["mean"] for e in errors.values())
    # Without the tree signal the accepted length is unpredictable; without raw ms, the latency is.
    assert errors["context+prefix"]["accepted_call"] > 5 * errors["all"]["accepted_call"]
    assert errors["tree+prefix"]["loglat_skip"] > 5 * errors["all"]["loglat_skip"]
    assert errors["ratio-only"]["loglat_call"] > 5 * errors["all"]["loglat_call"]
    assert sched.info.fit["subset"] == "all" and sched.info.fit["heldout_sign_agreement"] >= 0.85
    loaded = LearnedScheduler.load(sched.save(tmp_path / "s.npz"), expect_pair=PAIR)
    assert loaded.info.fit["subset_errors"] == errors


def test_signals_constant_in_training_are_left_out_so_run_time_noise_cannot_move_decisions():
    # One device's trajectories: the context timings are the same in every round (up to float noise), as
    # Trajectories.rounds writes them from one cost profile. A scheduler must not read them at run time,
    # where the engine's own measurement is a few ms off.
    rounds = synthetic_rounds(60, seed=12)
    sig = rounds.signals.copy()
    sig[:, :, IDX["t_tgt_ms"]] = 86.87 + np.float32(1e-3) * np.random.default_rng(0).normal(size=sig.shape[:2])
    sig[:, :, IDX["t_mid_ms"]] = 33.83
    sig[:, :, IDX["log_tgt_over_mid"]] = np.log(86.87 / 33.83)
    one_device = value.Rounds(sig, rounds.accepted, rounds.latency_ms, rounds.prompt_ids, rounds.benchmarks)
    heads = value.fit_value_heads(one_device, seed=0, epochs=3, hidden=32)
    states = one_device.decision_signals()
    model = value.fit_scheduler(states, heads.margins(one_device.signals, None).reshape(-1), seed=0, epochs=5)
    for fitted_subset in (heads.subset, model.subset):
        assert not {"t_tgt_ms", "t_mid_ms", "log_tgt_over_mid"} & set(fitted_subset)
        assert "reselect_score" in fitted_subset
    shifted = states.copy()
    shifted[:, IDX["t_tgt_ms"]] += 3.0
    shifted[:, IDX["t_mid_ms"]] -= 2.0
    shifted[:, IDX["log_tgt_over_mid"]] = np.log(shifted[:, IDX["t_tgt_ms"]] / shifted[:, IDX["t_mid_ms"]])
    with torch.no_grad():
        assert torch.equal(model(torch.from_numpy(states)), model(torch.from_numpy(shifted)))
    per_round = (len(one_device), value.NUM_DECISION_STATES, NUM_SIGNALS)
    assert np.array_equal(heads.margins(states.reshape(per_round)), heads.margins(shifted.reshape(per_round)))


# -- the value system online and in the artifact ------------------------------------------------------

@pytest.fixture(scope="module")
def fitted():
    """Synthetic rounds and value heads fitted a little on them (both actions are then common)."""
    rounds = synthetic_rounds(40, seed=21)
    return rounds, value.fit_value_heads(rounds, seed=2, epochs=3, hidden=32)


def planner_decisions(planner: value.ValuePlanner, rounds: value.Rounds) -> np.ndarray:  # [R, 31] bool
    layers = [len(value.state_prefix(i)) for i in range(value.NUM_DECISION_STATES)]
    return np.array([[planner.decide(rounds.signals[r, i], layers[i]) for i in range(value.NUM_DECISION_STATES)]
                     for r in range(len(rounds))])


def test_value_planner_decides_as_the_sign_of_the_margins(fitted):
    rounds, heads = fitted
    planner = value.ValuePlanner(heads)
    assert (planner.name, planner.needs_signals) == ("value-planner", True)
    margins = heads.margins(rounds.signals)
    decided = planner_decisions(planner, rounds)
    clear = margins != 0
    assert clear.mean() > 0.99 and 0.1 < decided.mean() < 0.9
    np.testing.assert_array_equal(decided[clear], margins[clear] > 0)
    with pytest.raises(ValueError, match="plans 5 drafting layers"):
        planner.decide(rounds.signals[0, 0], 5)


def test_artifact_round_trip_keeps_the_value_heads(tmp_path, fitted):
    rounds, heads = fitted
    sched = random_scheduler(12)
    path = artifact.save_artifact(tmp_path / "s.npz", sched, heads)
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]
    with np.load(path) as z:
        assert {"value.mean", "value.std", "value.target_norm", "value.accepted_skip.0.weight",
                "value.loglat_call.4.bias", "w1", "meta_json"} <= set(z.files)
    loaded_sched, loaded = artifact.load_artifact(path, expect_pair=PAIR)
    assert loaded.subset == heads.subset and loaded.target_norm == heads.target_norm
    assert loaded.hidden == heads.hidden == 32
    x = rounds.signals[:, value.QUERY_STATE].reshape(-1, NUM_SIGNALS)
    suffix = np.tile(value.QUERY_SUFFIX, (len(rounds), 1))
    before, after = heads.predict(x, suffix), loaded.predict(x, suffix)
    assert all(np.array_equal(before[h], after[h]) for h in value.HEADS)
    np.testing.assert_array_equal(planner_decisions(value.ValuePlanner(loaded), rounds),
                                  planner_decisions(value.ValuePlanner(heads), rounds))
    signals = random_signals(200, 13)
    assert [loaded_sched.margin(r) for r in signals] == [sched.margin(r) for r in signals]
    assert loaded_sched.info == sched.info
    # The scheduler alone still loads from it, and saving it again keeps the heads.
    plain = LearnedScheduler.load(path, expect_pair=PAIR)
    assert plain.extra_meta["value"]["hidden"] == 32
    again = artifact.load_artifact(plain.save(tmp_path / "again.npz"))[1]
    assert all(np.array_equal(again.predict(x, suffix)[h], before[h]) for h in value.HEADS)
    # Without heads: None, from either writer.
    assert artifact.load_artifact(artifact.save_artifact(tmp_path / "none.npz", sched, None))[1] is None
    assert artifact.load_artifact(sched.save(tmp_path / "plain.npz"))[1] is None


def drop(path, key):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != key}
    np.savez(path, **arrays)


@pytest.mark.parametrize("damage, message", [
    (lambda p: drop(p, "value.loglat_skip.2.weight"),
     r"value.loglat_skip.2.weight missing \(expected \(32, 32\)\)"),
    (lambda p: rewrite(p, **{"value.accepted_call.0.weight": np.zeros((32, 17), np.float32)}),
     r"value.accepted_call.0.weight \(32, 17\) \(expected \(32, 27\)\)"),
    (lambda p: rewrite(p, **{"value.mean": np.full(17, np.inf, np.float32)}), r"non-finite .*value.mean"),
    (lambda p: rewrite(p, **{"value.target_norm": np.zeros((4, 2))}), "target_norm std <= 0"),
    (lambda p: rewrite(p, extra={}), "value-head arrays but metadata None"),
    (lambda p: rewrite(p, extra={"value": {"subset": ["t_tgt_ms"], "hidden": 64, "heads": list(value.HEADS)}}),
     r"wrong shape or type for hidden size 64"),
    (lambda p: rewrite(p, extra={"value": {"subset": ["gpu_temperature"], "hidden": 32,
                                           "heads": list(value.HEADS)}}), "not a non-empty subset"),
])
def test_damaged_value_heads_are_refused_with_a_reason(tmp_path, fitted, damage, message):
    path = artifact.save_artifact(tmp_path / "s.npz", random_scheduler(14), fitted[1])
    damage(path)
    with pytest.raises(SchedulerArtifactError, match=message) as err:
        artifact.load_artifact(path, expect_pair=PAIR)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "damaged value-head part" in text
    assert "scheduling.artifact.save_artifact" in text


# -- in the engine ------------------------------------------------------------------------------------

def always_call() -> LearnedScheduler:
    model = SchedulerMLP()
    with torch.no_grad():
        for p in model.net.parameters():
            p.zero_()
        model.net[4].bias.fill_(1.0)
    return LearnedScheduler(model, SchedulerInfo(PAIR))


def shallow_frontier() -> LearnedScheduler:
    """margin = relu(1.5 - frontier depth) - 0.25: call iff the mean frontier depth is below 1.25."""
    model = SchedulerMLP()
    with torch.no_grad():
        for p in model.net.parameters():
            p.zero_()
        model.net[0].weight[0, IDX["frontier_depth"]] = -1.0
        model.net[0].bias[0] = 1.5
        model.net[2].weight[0, 0] = 1.0
        model.net[4].weight[0, 0] = 1.0
        model.net[4].bias.fill_(-0.25)
    return LearnedScheduler(model, SchedulerInfo(PAIR))


class Recording:
    """A policy that forwards to a scheduler and records what it decided."""

    def __init__(self, inner: LearnedScheduler):
        self.inner, self.name, self.needs_signals, self.decisions = inner, inner.name, True, []

    def decide(self, signals, layer):
        d = self.inner.decide(signals, layer)
        self.decisions.append(d)
        return d


@pytest.mark.parametrize("budget", [None, 2])
def test_learned_scheduler_in_the_engine_is_lossless_and_respects_the_call_budget(budget):
    target, mid = tiny_pair("llama", "close")
    dec = Decoder(target, mid, TreeConfig(call_budget=budget, deepen=0), timings=Timings(12.0, 3.0))
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(16)], [5, 9, 2, 6, 5, 3] * 4]
    for policy, expect_calls in ((always_call(), 5 if budget is None else budget), (shallow_frontier(), None)):
        for prompt in prompts:
            rec = Recording(policy)
            got = dec.generate(prompt, 20, rec)
            assert got.tokens == hf_greedy(target, prompt, 20)
            assert got.stats.method == "treegraft"
            if budget is not None:
                assert max(got.stats.middle_calls) <= budget
            if expect_calls is not None:
                assert set(got.stats.middle_calls) == {expect_calls}
            else:
                assert 0 < sum(rec.decisions) < len(rec.decisions)  # it really mixed calls and skips


def test_value_planner_in_the_engine_is_lossless(fitted):
    target, mid = tiny_pair("llama", "close")
    dec = Decoder(target, mid, TreeConfig(), timings=Timings(12.0, 3.0))
    prompt = [5, 9, 2, 6, 5, 3] * 4
    got = dec.generate(prompt, 20, value.ValuePlanner(fitted[1]))
    assert got.tokens == hf_greedy(target, prompt, 20)
    assert got.stats.method == "value-planner"


def test_the_engine_caps_calls_at_the_fitted_cap_at_the_fitted_budget_not_at_its_own_timings(fitted):
    """Timings taken in a busy moment (here b0 = floor(12 / 8) = 1) must not halve the cap the scheduler's
    margins were fitted for; at another budget the fitted cap does not apply and b0 does."""
    target, mid = tiny_pair("llama", "close")
    prompt = [5, 9, 2, 6, 5, 3] * 4
    scheduler = always_call()
    scheduler.info = SchedulerInfo(PAIR, {"budget": 16, "call_cap": 3})
    for budget, cap in ((16, 3), (32, 1)):
        dec = Decoder(target, mid, TreeConfig(budget=budget, deepen=0), timings=Timings(12.0, 8.0))
        got = dec.generate(prompt, 20, scheduler)
        assert got.tokens == hf_greedy(target, prompt, 20)
        assert set(got.stats.middle_calls) == {cap}, budget
    # The value planner plans for the cap it is given; without one the engine's b0 stays in place.
    assert value.ValuePlanner(fitted[1], 2).call_cap_at(16) == 2
    assert value.ValuePlanner(fitted[1]).call_cap_at(16) is None
