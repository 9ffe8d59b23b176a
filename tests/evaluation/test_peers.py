"""The peer methods (transformers assisted generation and prompt lookup) reproduce the target's greedy decoding,
stop at eos like plain decoding, and report per-forward statistics."""

import random

import pytest
import torch
from tiny import VOCAB, hf_greedy, perturbed_copy, tiny_model, tiny_pair

from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.evaluation.peers import PEER_METHODS, run_peer
from treegraft_dist.models.hf import CausalLM

PAIRS = {}


def pair(arch, middle="close"):
    if (arch, middle) not in PAIRS:
        PAIRS[arch, middle] = tiny_pair(arch, middle)
    return PAIRS[arch, middle]


def prompts(seed):
    rng = random.Random(seed)
    out = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(2)]
    out.append([rng.randrange(VOCAB) for _ in range(6)] * 5)
    out.append(([3, 1, 4, 1, 5, 9, 2, 6] * 4)[:-3])
    out.append([7])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("middle", ["close", "random"])
def test_peers_equal_target_greedy(arch, middle):
    target, mid = pair(arch, middle)
    for prompt in prompts(len(arch) + len(middle)):
        ref = hf_greedy(target, prompt, 30)
        assert Decoder(target).generate(prompt, 30, "ar").tokens == ref
        for method in PEER_METHODS:
            assert run_peer(method, target, mid, prompt, 30, set()).tokens == ref, (method, prompt)


@pytest.mark.parametrize("method", PEER_METHODS)
def test_eos_stops_like_plain_decoding(method):
    target, mid = pair("llama")
    prompt = [5, 6, 7, 8] * 4
    ref = hf_greedy(target, prompt, 40)
    eos = ref[17]
    expected = ref[: ref.index(eos) + 1]
    assert Decoder(target).generate(prompt, 40, "ar", eos_ids={eos}).tokens == expected
    got = run_peer(method, target, mid, prompt, 40, {eos, VOCAB + 5})
    assert got.tokens == expected
    assert got.stats.new_tokens == sum(got.stats.accepted) == len(expected)


@pytest.mark.parametrize("method", PEER_METHODS)
def test_only_the_given_eos_ids_stop_and_model_config_is_restored(method):
    # A checkpoint's own generation defaults (eos, repetition penalty, sampling) must not leak into the peers.
    target, mid = pair("qwen3")
    prompt = [2, 7, 1, 8, 2, 8] * 3
    ref = hf_greedy(target, prompt, 25)
    saved = target.model.generation_config
    original = saved.eos_token_id, saved.repetition_penalty
    saved.eos_token_id, saved.repetition_penalty = ref[4], 1.5
    try:
        assert run_peer(method, target, mid, prompt, 25, set()).tokens == ref
        assert target.model.generation_config is saved
    finally:
        saved.eos_token_id, saved.repetition_penalty = original
    assert not target.model._forward_pre_hooks and not mid.model._forward_pre_hooks


def test_statistics_count_target_forwards():
    target, mid = pair("qwen3")
    prompt = [1, 2, 3, 4, 5, 6] * 4
    for method in PEER_METHODS:
        s = run_peer(method, target, mid, prompt, 50, set()).stats
        assert s.method == method and s.prompt_tokens == len(prompt)
        assert s.new_tokens == sum(s.accepted) == 50 and s.wall_s > 0
        assert 1 <= s.rounds == len(s.accepted) == len(s.tree_sizes) == len(s.middle_calls) <= 50
        assert all(1 <= a <= t for a, t in zip(s.accepted, s.tree_sizes))
        assert s.seconds["other"] == pytest.approx(s.wall_s)
    pld = run_peer("hf-pld", target, None, prompt, 50, set()).stats
    assert set(pld.middle_calls) == {0} and max(pld.tree_sizes) <= 11


def successor_model(arch, period=6):
    """A target whose next token is a fixed function of the current one (a cycle of `period` ids): embeddings
    dominate the residual stream, and the output head maps each id's embedding to its successor."""
    model = tiny_model(arch, init=0.02)
    ids = torch.arange(VOCAB)
    successor = ids // period * period + (ids + 1) % period
    emb = torch.randn(VOCAB, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(emb)
        model.get_output_embeddings().weight[successor] = emb
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafts_are_accepted_on_repetitive_output(arch):
    model = successor_model(arch)
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.1, 1))
    prompt = [40, 13, 77, 2, 90, 51] * 2
    ref = hf_greedy(target, prompt, 40)
    assert len(set(ref)) == 6
    pld = run_peer("hf-pld", target, None, prompt, 40, set())
    assert pld.tokens == ref
    # Prompt lookup finds nothing until the output has repeated itself, then copies 10 tokens a forward.
    assert 1 <= pld.stats.rounds <= 15 and pld.stats.mean_accepted > 2.5 and max(pld.stats.accepted) == 11
    assisted = run_peer("hf-assisted", target, mid, prompt, 40, set())
    assert assisted.tokens == ref
    assert assisted.stats.rounds <= 3 and sum(assisted.stats.middle_calls) >= 30


def test_bad_requests_raise():
    target, mid = pair("llama")
    with pytest.raises(ValueError, match="middle model"):
        run_peer("hf-assisted", target, None, [1, 2, 3], 5, set())
    with pytest.raises(ValueError, match="peer method"):
        run_peer("hf-lookahead", target, mid, [1, 2, 3], 5, set())
    with pytest.raises(ValueError, match="empty"):
        run_peer("hf-pld", target, None, [], 5, set())
    g = run_peer("hf-pld", target, None, [1, 2, 3], 0, set())
    assert g.tokens == [] and g.stats.new_tokens == 0 and g.stats.rounds == 0
