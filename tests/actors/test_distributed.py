"""The actor system on CPU: fake GPUs for placement, the target tensor-parallel over 2 ranks (gloo), tiny
models loaded by the actors from saved folders.

The oracle: distributed output == single-process Decoder output == the target's own greedy decoding,
token for token, in fp32, for several prompts and schedules, with requests in flight at once; and the
same after a middle drafter or a target worker is killed mid-request.
"""

import random
import time

import numpy as np
import pytest
import ray
import torch
from tiny import VOCAB, char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model

from actors.engine import DistributedEngine
from actors.resources import PlacementError, Resources
from actors.target import TargetGroupError
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.schedule import ReplaySchedule, ShallowTreeHeuristic
from treegraft_dist.models.hf import CausalLM

# Trees at the full budget under concurrency too (adapt_budget off): concurrent requests' trees, not plain
# steps, share the passes here; the serve tests run the adaptive default.
RES = Resources(tp=2, device="cpu", target_cpus=0.1, middle_cpus=0.1, ngram_cpus=0.1, coordinator_cpus=0.1,
                torch_threads=1, placement_timeout_s=30, dist_timeout_s=60, adapt_budget=False)
METHODS = ("ar", "all-small", "all-mid", "01001", "10110")
# Policies the engines hold by name (as the server holds its fitted scheduler): a replay counts its request's rounds.
NAMED = {"replay": ReplaySchedule(["11111", "00000"], "replay")}


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The session's cluster (conftest.py)."""


class Pair:
    """A tiny target / middle pair, in memory (for the oracles) and saved (for the actors)."""

    def __init__(self, arch, folder):
        model = tiny_model(arch)
        self.target = CausalLM(model)
        self.middle = CausalLM(perturbed_copy(model, 0.3, 1))
        tok = char_tokenizer()
        self.target_path = save_tiny(folder / f"{arch}-target", model, tok)
        self.middle_path = save_tiny(folder / f"{arch}-middle", self.middle.model, tok)
        self.decoder = Decoder(self.target, self.middle)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    return {arch: Pair(arch, folder) for arch in ("llama", "qwen3")}


def prompts(seed, n=1, length=20):
    rng = random.Random(seed)
    out = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]
    out.append([rng.randrange(VOCAB) for _ in range(5)] * 4)  # repetitive: long n-gram matches
    return out


def wait_for_progress(engine, tokens, timeout=60.0):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if any(n >= tokens for n in engine.progress().values()):
            return
        time.sleep(0.02)
    raise AssertionError(f"no request reached {tokens} tokens within {timeout} s")


def kill_mid_request(engine, actor: str, prompt, tokens: int, method: str):
    """Kill the `actor` ("middle", "ngram") once a request is under way; (the killed actor, its result)."""
    ref = engine.submit(prompt, tokens, method)
    wait_for_progress(engine, 12)
    dead = engine.actors()[actor]
    ray.kill(dead)
    return dead, engine.result(ref)


def tp_logits(engine, prompt):
    """Every target rank runs the same prefill forward; rank 0's logits (a test-only look inside)."""

    def forward(worker, ids):
        lm = worker.lm
        h = lm.hidden(lm.new_cache(), torch.tensor(ids), torch.arange(len(ids)))
        return lm.logits(h).numpy()

    ranks = engine.actors()["target"]
    return ray.get([w.__ray_call__.remote(forward, prompt) for w in ranks])


def check_tp_logits(engine, pair):
    prompt = prompts(7)[0]
    ref = pair.target.logits(pair.target.hidden(pair.target.new_cache(), torch.tensor(prompt),
                                                torch.arange(len(prompt)))).numpy()
    per_rank = tp_logits(engine, prompt)
    assert len(per_rank) == 2
    for got in per_rank:
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
        assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="class")
def engine(request, cluster, pairs):
    """One engine per test class (the cluster's 4 fake GPUs hold one: target tp=2 plus the middle)."""
    eng = DistributedEngine(pairs[request.cls.ARCH].target_path, pairs[request.cls.ARCH].middle_path,
                            resources=RES, dtype="float32", policies=NAMED)
    yield eng
    eng.shutdown()


class TestLlamaTP2:
    ARCH = "llama"

    def test_tp2_logits_match_single_process(self, engine, pairs):
        check_tp_logits(engine, pairs["llama"])

    def test_concurrent_schedules_equal_single_process_and_greedy(self, engine, pairs):
        pair = pairs["llama"]
        jobs = [(p, m) for p in prompts(1) for m in METHODS]
        passes, items = engine.target_passes()
        refs = [engine.submit(p, 30, m) for p, m in jobs]  # all in flight at once
        for (p, m), ref in zip(jobs, refs):
            expected = hf_greedy(pair.target, p, 30)
            single = pair.decoder.generate(p, 30, m)
            got = engine.result(ref)
            assert got.tokens == single.tokens == expected, (m, p)
            assert got.stats.rounds == len(got.stats.accepted) > 0
            assert m == "ar" or max(got.stats.tree_sizes) > 1  # drafted trees, not plain steps, were verified
        passes, items = (a - b for a, b in zip(engine.target_passes(), (passes, items)))
        assert items > passes > 0  # requests shared the target's passes

    def test_generate_many_with_a_signal_reading_policy(self, engine, pairs):
        pair = pairs["llama"]
        ps = prompts(2)
        got = engine.generate_many(ps, 25, ShallowTreeHeuristic())
        for p, g in zip(ps, got):
            assert g.tokens == pair.decoder.generate(p, 25, ShallowTreeHeuristic()).tokens == hf_greedy(pair.target, p, 25)

    def test_requests_that_name_a_policy_the_engine_holds_each_run_their_own_copy(self, engine, pairs):
        pair = pairs["llama"]
        ps = prompts(12, n=3)
        got = [engine.result(r) for r in [engine.submit(p, 25, "replay") for p in ps]]  # in flight at once
        for p, g in zip(ps, got):
            assert g.tokens == hf_greedy(pair.target, p, 25)
            assert g.stats.method == "replay"
            # Each request replays from its own first round: a shared copy would spread the rounds over requests.
            assert g.stats.middle_calls[0] >= 1 and g.stats.middle_calls[1:] == [0] * (g.stats.rounds - 1), \
                g.stats.middle_calls
        with pytest.raises(ValueError, match="plain decoding"):
            DistributedEngine(pair.target_path, pair.middle_path, resources=RES, policies={"ar": ShallowTreeHeuristic()})

    def test_eos_and_edge_cases(self, engine, pairs):
        pair = pairs["llama"]
        p = prompts(3)[0]
        full = hf_greedy(pair.target, p, 20)
        eos = full[7]
        got = engine.generate(p, 20, "all-mid", eos_ids=[eos])
        assert got.tokens == full[: full.index(eos) + 1]
        assert 1 + sum(got.stats.accepted) == len(got.tokens)  # stopped in the round that accepted eos
        assert engine.generate(p, 0, "all-mid").tokens == []
        with pytest.raises(ValueError, match="prompt is empty"):
            engine.generate([], 5)
        with pytest.raises(ValueError, match="schedule"):
            engine.generate(p, 5, "0101")

    def test_middle_drafter_dies_mid_request(self, engine, pairs):
        pair = pairs["llama"]
        p = prompts(4)[-1]
        dead, got = kill_mid_request(engine, "middle", p, 150, "all-mid")
        assert got.tokens == hf_greedy(pair.target, p, 150) == pair.decoder.generate(p, 150, "all-mid").tokens
        calls = got.stats.middle_calls
        assert calls[0] >= 5 and calls[-1] == 0, calls  # the middle drafted before the kill, n-gram after
        restarted = engine.actors()["middle"]
        assert restarted._actor_id != dead._actor_id
        later = engine.generate(prompts(5)[0], 20, "all-mid")
        assert later.tokens == hf_greedy(pair.target, prompts(5)[0], 20)
        assert all(c >= 5 for c in later.stats.middle_calls)  # the restarted middle drafts again

    def test_drafters_killed_between_requests_are_back_for_the_next(self, engine, pairs):
        """No request in flight sees these deaths; the next request finds them and drafts on new actors."""
        pair = pairs["llama"]
        dead = engine.actors()
        ray.kill(dead["middle"])
        ray.kill(dead["ngram"])
        time.sleep(1.0)  # the deaths reach the coordinator
        q = prompts(11)[0]
        later = engine.generate(q, 20, "all-mid")
        assert later.tokens == hf_greedy(pair.target, q, 20)
        assert all(c >= 5 for c in later.stats.middle_calls)  # a live middle drafter from the first round
        now = engine.actors()
        assert now["middle"]._actor_id != dead["middle"]._actor_id
        assert now["ngram"]._actor_id != dead["ngram"]._actor_id

    def test_ngram_drafter_dies_mid_request(self, engine, pairs):
        """The coordinator drafts the n-gram layers itself: the same trees, so the same rounds and tokens."""
        pair = pairs["llama"]
        p = prompts(9)[-1]
        dead, got = kill_mid_request(engine, "ngram", p, 150, "all-small")
        single = pair.decoder.generate(p, 150, "all-small")
        assert got.tokens == single.tokens == hf_greedy(pair.target, p, 150)
        assert got.stats.accepted == single.stats.accepted  # every round drafted the single-process tree
        restarted = engine.actors()["ngram"]
        assert restarted._actor_id != dead._actor_id
        q = prompts(10)[0]
        later = engine.generate(q, 20, "01001")  # the restarted actor drafts the n-gram layers again
        assert later.tokens == pair.decoder.generate(q, 20, "01001").tokens == hf_greedy(pair.target, q, 20)


class TestQwen3TP2Faults:
    ARCH = "qwen3"

    def test_tp2_logits_match_single_process(self, engine, pairs):
        check_tp_logits(engine, pairs["qwen3"])

    def test_target_worker_dies_then_group_is_rebuilt(self, engine, pairs):
        pair = pairs["qwen3"]
        p = prompts(6)[-1]
        doomed = engine.submit(p, 300, "01001")
        wait_for_progress(engine, 8)
        old = engine.actors()["target"]
        ray.kill(old[1])
        with pytest.raises(TargetGroupError, match="target worker died.*rebuilt"):
            engine.result(doomed)
        deadline = time.monotonic() + 120  # new requests are turned away while the group is rebuilt
        while (h := engine.health())["rebuilds"] != 1 or h["state"] != "ready":
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        got = engine.generate_many(prompts(8), 25, "01001")  # later requests, concurrent, on the rebuilt group
        for q, g in zip(prompts(8), got):
            assert g.tokens == pair.decoder.generate(q, 25, "01001").tokens == hf_greedy(pair.target, q, 25)
        new = engine.actors()["target"]
        assert len(new) == 2 and not {w._actor_id for w in new} & {w._actor_id for w in old}


def test_unsatisfiable_placement_fails_fast(cluster, pairs, tmp_path):
    pair = pairs["llama"]
    # 8 attention and key/value heads: tp=8 shards it, so it is the placement that fails.
    target = save_tiny(tmp_path / "8-heads", tiny_model("llama", heads=8, kv_heads=8), char_tokenizer())
    res = Resources(tp=8, device="cpu", target_cpus=0.1, middle_cpus=0.1, ngram_cpus=0.1, coordinator_cpus=0.1,
                    placement_timeout_s=3)
    t = time.monotonic()
    with pytest.raises(PlacementError, match=r"target group \(tp=8\).*GPU 8"):
        DistributedEngine(target, pair.middle_path, resources=res, dtype="float32")
    assert time.monotonic() - t < 30
    # Nothing is left behind: the whole cluster is free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU", 0) == 4


def test_resources_are_validated():
    with pytest.raises(ValueError, match="tp"):
        Resources(tp=0)
    with pytest.raises(ValueError, match="device"):
        Resources(device="tpu")
    assert Resources(tp=4).target_bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 4


@pytest.mark.integration
def test_cli_generate_and_eval_distributed(cluster, pairs, tmp_path, capsys):
    import json

    import pyarrow.parquet as pq

    from jobs.cli import main

    p = pairs["qwen3"]
    text = "abcabcabc abc"
    common = ["--distributed", "--tp", "2", "--device", "cpu", "--target", p.target_path, "--middle", p.middle_path]
    assert main(["generate", *common, "--prompt", text, "--method", "01001", "--max-new-tokens", "16", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    assert got == hf_greedy(p.target, char_tokenizer()(text)["input_ids"], 16)

    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["xyzxyz xyz"]}) + "\n")
    out = tmp_path / "eval"
    code = main(["eval", *common, "--benchmarks", "", "--benchmark-file", str(bench), "--methods",
                 "ar,all-small,10100", "--prompts-per-benchmark", "1", "--max-new-tokens", "12", "--budget", "24",
                 "--out", str(out)])
    assert code == 0
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == 3 and all(r["lossless"] for r in rows)



DEEP_TREE = TreeConfig(deepen=6, deepen_cost=0.05)


@pytest.fixture(scope="class")
def sure(cluster, tmp_path_factory):
    """An engine over a peaky target and a middle drafter that is its exact copy (sure, and right), with
    deepening on and priced cheap; the target and the same decoding in one process."""
    folder = tmp_path_factory.mktemp("sure")
    model = tiny_model("llama", init=0.6)
    tok = char_tokenizer()
    middle = perturbed_copy(model, 0.0, 0)
    eng = DistributedEngine(save_tiny(folder / "target", model, tok), save_tiny(folder / "middle", middle, tok),
                            tree=DEEP_TREE, resources=RES, dtype="float32")
    yield eng, CausalLM(model), Decoder(CausalLM(model), CausalLM(middle), DEEP_TREE)
    eng.shutdown()


class TestDeepeningOnActors:
    """Rounds grow past the depth through the actors as in one process: after a middle layer drafted by the
    coordinator, and after n-gram layers drafted on the n-gram host (which asks for the middle's layer)."""

    @pytest.mark.parametrize("method", ["11111", "10100"])
    def test_deepened_rounds_equal_single_process_and_greedy(self, sure, method):
        eng, target, decoder = sure
        prompt = list(range(10, 30))
        got, single = eng.generate(prompt, 40, method), decoder.generate(prompt, 40, method)
        assert got.tokens == single.tokens == hf_greedy(target, prompt, 40)
        assert max(got.stats.middle_calls) > method.count("1")  # middle layers past the depth
        assert max(got.stats.accepted) > 6
