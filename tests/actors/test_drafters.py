"""The drafter actors' client (actors/drafters.py): a lazy RemoteDrafter reaches its host only when it first drafts,
and then holds the state an eager one holds; a policy the host holds travels by name."""

import pickle

import numpy as np
import pytest
import ray
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from actors.drafters import DrafterHost, NeuralSpec, NGramSpec, RemoteDrafter, RoundSpec
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Drafting
from treegraft_dist.decoding.schedule import ReplaySchedule
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree


@pytest.fixture(scope="module")
def middle_host(ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    path = save_tiny(folder / "middle", perturbed_copy(tiny_model("llama", init=0.4), 0.3, 1), char_tokenizer())
    host = ray.remote(DrafterHost).options(num_cpus=0.1).remote(NeuralSpec(str(path), "float32", 4, 5), "cpu", 1)
    ray.get(host.ready.remote())
    yield host
    ray.kill(host)


def test_a_lazy_drafter_reaches_its_host_at_its_first_step_with_the_state_an_eager_one_has(middle_host):
    prompt = [7, 3, 19, 40, 2, 33, 8, 15, 27, 4]
    eager, lazy = (RemoteDrafter(middle_host, rid, ORIGIN_MIDDLE, timeout_s=60, lazy=rid == 2) for rid in (1, 2))
    for d in (eager, lazy):
        d.start(prompt, None)
        d.accept([], [11])
        d.accept([0], [12, 13])  # a run of plain steps, told at once
    assert not lazy.started
    with pytest.raises(ray.exceptions.RayTaskError):  # the host has never heard of it
        ray.get(middle_host.step.remote(2, DraftTree(13), np.zeros(1, np.int64), 1))
    a, b = (d.step(DraftTree(13), np.zeros(1, np.int64), 1) for d in (eager, lazy))
    assert lazy.started
    assert a.tokens.tolist() == b.tokens.tolist() and np.allclose(a.scores, b.scores)
    for d in (eager, lazy):
        d.accept([0], [a.tokens[0].item(), 5])
    a, b = (d.step(DraftTree(5), np.zeros(1, np.int64), 1) for d in (eager, lazy))
    assert a.tokens.tolist() == b.tokens.tolist() and np.allclose(a.scores, b.scores)
    for d in (eager, lazy):
        d.release()


def test_a_lazy_drafter_that_never_drafts_costs_its_host_nothing(middle_host):
    idle = RemoteDrafter(middle_host, 3, ORIGIN_MIDDLE, timeout_s=60, lazy=True)
    idle.start([1, 2, 3], None)
    idle.accept([], [4])
    idle.release()  # never started there: nothing sent
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(middle_host.step.remote(3, DraftTree(4), np.zeros(1, np.int64), 1))


@pytest.fixture(scope="module")
def ngram_host(ray_cluster):
    spec = NGramSpec(top_k=4, max_n=3, chain=2, depth=5, long_chain=0, history_tokens=1000)
    host = ray.remote(DrafterHost).options(num_cpus=0.1).remote(spec, "cpu", 1, {"named": ReplaySchedule(["10000"],
                                                                                                        "named")})
    ray.get(host.ready.remote())
    yield host
    ray.kill(host)


def test_a_lazy_ngram_drafter_that_never_drafts_leaves_only_its_text_for_the_history(ngram_host):
    prompt = [7, 3, 19, 40, 2, 33]
    idle = RemoteDrafter(ngram_host, 4, ORIGIN_NGRAM, timeout_s=60, lazy=True, remember=True)
    idle.start(prompt, None)
    idle.accept([0], [5, 6, 7])  # the plain steps of the whole request, told at its end
    idle.release()
    assert ray.get(ngram_host.history_state.remote()) == {"sequences": 1, "tokens": len(prompt) + 3}
    with pytest.raises(ray.exceptions.RayTaskError):  # it never started there
        ray.get(ngram_host.step.remote(4, DraftTree(7), np.zeros(1, np.int64), 1))


def test_a_policy_the_host_holds_travels_by_name_and_each_request_gets_its_own_copy(ngram_host):
    policy = ReplaySchedule(["10000"], "named")
    named = RoundSpec(TreeConfig(), policy, None, policy_name="named")
    sent = pickle.loads(pickle.dumps(named))
    assert sent.policy is None and sent.policy_name == "named"  # the policy stays here
    assert pickle.loads(pickle.dumps(RoundSpec(TreeConfig(), policy, None))).policy.patterns == ["10000"]
    for rid in (5, 6):  # each request's replay starts at its own first round
        ngram_host.start.remote(rid, [1, 2, 3, 1, 2], None, named)
        state, wanted = ray.get(ngram_host.draft.remote(rid, Drafting.new(3), (4,), True))
        assert wanted == "middle"  # the held policy's first round calls the middle drafter at layer 1
        ngram_host.release.remote(rid)
