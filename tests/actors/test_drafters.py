"""The drafter actors' client (actors/drafters.py): a lazy RemoteDrafter reaches its host only when it first drafts,
and then holds the state an eager one holds."""

import numpy as np
import pytest
import ray
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from actors.drafters import DrafterHost, NeuralSpec, RemoteDrafter
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, DraftTree


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
