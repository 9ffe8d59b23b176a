"""The served n-gram drafter's history (Resources.history_tokens): a request asked again drafts what the target
generated the first time, in fewer rounds, with output still exactly the target's greedy decoding; an engine
without it keeps nothing between requests."""

import time

import pytest
import ray
from tiny import char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model

from actors.engine import DistributedEngine
from actors.resources import for_device
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.models.hf import CausalLM


@pytest.fixture(scope="module")
def pair(ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    model, tok = tiny_model("llama", init=0.4), char_tokenizer()
    return model, save_tiny(folder / "target", model, tok), save_tiny(folder / "middle", perturbed_copy(model, 0.3, 1), tok)


def history(engine, want: dict | None = None) -> dict:
    """The n-gram host's history state; with `want`, waited for a while (a finished request's release reaches
    the host from the coordinator, not in order with calls from here)."""
    deadline = time.monotonic() + 30
    while True:
        state = ray.get(engine.actors()["ngram"].history_state.remote())
        if want is None or state == want or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


@pytest.mark.parametrize("method", ["all-small", "treegraft-heuristic"])
def test_a_request_asked_again_drafts_from_the_first_and_stays_exact(pair, method):
    from treegraft_dist.decoding.schedule import ShallowTreeHeuristic

    model, target, middle = pair
    policy = ShallowTreeHeuristic() if method == "treegraft-heuristic" else method
    prompt = [7, 3, 19, 40, 2, 33, 8, 15, 27, 4, 11, 5]
    want = hf_greedy(CausalLM(model), prompt, 40)
    with DistributedEngine(target, middle, resources=for_device("cpu", history_tokens=10_000), dtype="float32") as eng:
        first = eng.generate(prompt, 40, policy)
        assert history(eng, {"sequences": 1, "tokens": len(prompt) + 40}) == {"sequences": 1,
                                                                              "tokens": len(prompt) + 40}
        again = eng.generate(prompt, 40, policy)
        other = eng.generate([50, 51, 52, 53, 54], 8, policy)  # nothing of the history matches: still exact
        sampled = [eng.generate(prompt, 24, policy, seed=7, sampling=SamplingParams(temperature=0.9))
                   for _ in range(2)]
    assert first.tokens == again.tokens == want
    # A sampled request drafts from its own context only: the same seed gives the same text, whatever the
    # first left in the history.
    assert sampled[0].tokens == sampled[1].tokens
    assert other.tokens == hf_greedy(CausalLM(model), [50, 51, 52, 53, 54], 8)
    assert again.stats.rounds < first.stats.rounds and sum(again.stats.accepted) > sum(first.stats.accepted)


def test_without_a_history_nothing_is_kept(pair):
    _, target, middle = pair
    with DistributedEngine(target, middle, resources=for_device("cpu"), dtype="float32") as eng:
        eng.generate([7, 3, 19, 40], 6, "all-small")
        assert history(eng) == {"sequences": 0, "tokens": 0}


def test_a_negative_history_is_refused():
    with pytest.raises(ValueError, match="history_tokens"):
        for_device("cpu", history_tokens=-1)
