"""Drafting made cheap (draft.py): a draft vocabulary and an int8 middle drafter change what is proposed, never
what is output."""

import copy

import numpy as np
import pytest
import torch
from tiny import VOCAB, char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model, tiny_pair

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import model_key
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.neural import NeuralDrafter
from treegraft_dist.decoding.tree import ORIGIN_NGRAM, DraftTree, Proposal
from treegraft_dist.models import draft, kernels
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import load_model

SUBSET = 40  # of the tiny vocabulary's 96 ids


def hidden_rows(lm: CausalLM, n: int = 7) -> torch.Tensor:
    return lm.hidden(lm.new_cache(), torch.arange(3, 3 + n), torch.arange(n))


def test_draft_vocabulary_is_the_first_ids_plus_the_special_ones():
    ids = draft.draft_vocabulary(VOCAB, SUBSET, {90, 5, 200})
    assert ids.tolist() == list(range(SUBSET)) + [90]  # 5 is inside already, 200 is no id of this vocabulary
    assert draft.draft_vocabulary(VOCAB, 0, {90}) is None
    assert draft.draft_vocabulary(VOCAB, VOCAB, {90}) is None


def test_top_logprobs_over_a_draft_vocabulary_only_name_its_ids():
    lm, _ = tiny_pair(seed=2)
    h = hidden_rows(lm)
    lse_full, tok_full, lp_full = lm.top_logprobs(h, 5)
    full = lm.logits(h)
    assert torch.allclose(lse_full, torch.logsumexp(full, -1))
    assert (tok_full == torch.topk(full, 5).indices.numpy()).all()
    ids = draft.draft_vocabulary(VOCAB, SUBSET, {90})
    draft.set_draft_vocabulary(lm, ids)
    lse, tok, lp = lm.top_logprobs(h, 5, chunk=3)  # chunks of rows give the same rows
    sub = full[:, torch.from_numpy(ids)]
    assert np.isin(tok, ids).all()
    assert torch.allclose(lse, torch.logsumexp(sub, -1), atol=1e-5)
    expect = torch.from_numpy(ids)[torch.topk(sub, 5).indices].numpy()
    assert (tok == expect).all()
    assert np.allclose(lp, (torch.topk(sub, 5).values - lse[:, None]).double().numpy(), atol=1e-5)
    assert (lp <= 0).all() and not np.allclose(lp, lp_full)
    # Verification still sees the whole vocabulary.
    assert lm.logits(h).shape[-1] == VOCAB


def test_a_requests_own_tokens_outside_the_draft_vocabulary_are_covered_too():
    lm, _ = tiny_pair(seed=3)
    h = hidden_rows(lm)
    full = lm.logits(h)
    ids = draft.draft_vocabulary(VOCAB, SUBSET, set())
    draft.set_draft_vocabulary(lm, ids)
    extra = lm.outside_draft_vocab([3, 50, 50, 70, 12])
    assert extra.tolist() == [50, 70]
    lse, tok, lp = lm.top_logprobs(h, 6, extra=extra)
    cover = torch.from_numpy(np.r_[ids, [50, 70]])
    sub = full[:, cover]
    assert torch.allclose(lse, torch.logsumexp(sub, -1), atol=1e-5)
    assert (tok == cover[torch.topk(sub, 6).indices].numpy()).all()
    assert np.isin(tok, cover.numpy()).all()
    draft.set_draft_vocabulary(lm, None)
    assert lm.outside_draft_vocab([3, 50]) is None


def test_a_middle_drafter_over_a_draft_vocabulary_proposes_only_its_ids_and_scores_stay_log_probs():
    target, middle = tiny_pair(seed=4)
    ids = draft.draft_vocabulary(VOCAB, SUBSET, set())
    draft.set_draft_vocabulary(middle, ids)
    d = NeuralDrafter(middle, top_k=4, lookback=5)
    prompt = list(range(50, 70))  # outside the draft vocabulary: proposed too, as the request's own tokens
    d.start(prompt, None)
    d.accept([], [70])
    tree = DraftTree(70)
    # An n-gram child outside the draft vocabulary: the middle drafter must still score it, at most log 1.
    tree.graft(Proposal(1, np.array([0, 0]), np.array([80, 12]), np.array([-0.1, -0.2]), ORIGIN_NGRAM), 1)
    proposal = d.step(tree, np.array([1, 2]), 2)
    assert np.isin(proposal.tokens, np.r_[ids, prompt]).all()
    assert not np.isin(proposal.tokens, [80, 90, 95]).any()
    assert (proposal.rescore[1:] <= 0).all() and (proposal.scores <= 0).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_speculation_with_a_cheap_middle_drafter_equals_the_targets_greedy_output(arch):
    target, middle = tiny_pair(arch, seed=5)
    if kernels.int8_unsupported(torch.float32) is None:
        kernels.quantize_int8(middle.base)
        middle.quantized = True
    draft.set_draft_vocabulary(middle, draft.draft_vocabulary(VOCAB, SUBSET, set()))
    draft.set_draft_vocabulary(target, draft.draft_vocabulary(VOCAB, SUBSET, set()))  # its prefill cache
    prompt = [7, 8, 9, 10, 7, 8, 9, 11, 12, 7, 8]
    expected = hf_greedy(target, prompt, 24)
    decoder = Decoder(target, middle, TreeConfig(budget=16))
    for method in ("all-mid", "10100", "all-small"):
        out = decoder.generate(prompt, 24, method)
        assert out.tokens == expected, method
    assert sum(decoder.generate(prompt, 24, "all-mid").stats.middle_calls) > 0


@pytest.mark.skipif(kernels.int8_unsupported(torch.float32) is not None,
                    reason=f"{kernels.int8_unsupported(torch.float32)}")
def test_int8_linears_stay_close_to_the_fp32_ones():
    model = tiny_model("qwen3", seed=6)
    ref = CausalLM(copy.deepcopy(model))
    q = CausalLM(model)
    n = kernels.quantize_int8(q.base)
    assert n == sum(type(m) is torch.nn.Linear for m in ref.base.modules())
    assert not any(type(m) is torch.nn.Linear for m in q.base.modules())
    h_ref, h_q = hidden_rows(ref, 12), hidden_rows(q, 12)
    rel = (h_q - h_ref).norm() / h_ref.norm()
    assert 0 < rel < 0.15, rel  # random tiny weights amplify rounding; a trained model far less
    # The drafter's top choice mostly survives quantisation.
    agree = (ref.logits(h_ref).argmax(-1) == q.logits(h_q).argmax(-1)).float().mean()
    assert agree >= 0.75, agree


def test_load_model_makes_the_middle_cheap_and_keys_its_profile_by_it(tmp_path, monkeypatch):
    tok = char_tokenizer()
    folder = save_tiny(tmp_path / "m", perturbed_copy(tiny_model("llama", seed=8), 0.2, 9), tok)
    monkeypatch.setenv(draft.VOCAB_ENV, str(SUBSET))
    kernels.int8_choice.cache_clear()
    monkeypatch.setenv(kernels.INT8_ENV, "on" if kernels.int8_unsupported(torch.float32) is None else "off")
    try:
        middle = load_model(folder, "cpu", "float32", drafter=True).lm
        target = load_model(folder, "cpu", "float32").lm
    finally:
        kernels.int8_choice.cache_clear()
    assert len(middle.draft_vocab) == SUBSET + 1  # the first ids and <unk>, the tokenizer's special token
    assert not target.quantized and len(target.draft_vocab) == SUBSET + 1
    key = model_key(middle, "m")
    assert key.endswith(f"-v{SUBSET + 1}")
    assert ("-int8" in key) == middle.quantized == (kernels.int8_unsupported(torch.float32) is None)
    monkeypatch.setenv(draft.VOCAB_ENV, "0")
    assert load_model(folder, "cpu", "float32", drafter=True).lm.draft_vocab is None
    monkeypatch.setenv(draft.VOCAB_ENV, "lots")
    with pytest.raises(ValueError, match="TREEGRAFT_DRAFT_VOCAB"):
        load_model(folder, "cpu", "float32")


def test_a_middle_profile_times_drafting_passes_and_one_from_before_is_measured_again(tmp_path):
    import json

    from treegraft_dist.decoding.costs import device_name, middle_profile

    _, middle = tiny_pair(seed=10)
    draft.set_draft_vocabulary(middle, draft.draft_vocabulary(VOCAB, SUBSET, set()))
    path = tmp_path / "profiles" / f"{model_key(middle, 'm')}--{device_name(middle.device)}--middle.json"
    path.parent.mkdir(parents=True)
    # Written before drafting passes were timed as such: its figures ended with the full head.
    path.write_text(json.dumps({"model": "m", "device": "d", "forward_ms": {"1": 1e-6, "2": 1e-6}}))
    profile = middle_profile(middle, "m", tmp_path)
    saved = json.loads(path.read_text())
    assert saved["pass"] == "drafting" and set(profile) == {1, 2, 4, 8, 16, 32, 64, 128}
    assert min(profile.values()) > 1e-6
    assert {int(k): v for k, v in saved["forward_ms"].items()} == profile


@pytest.mark.skipif(kernels.int8_unsupported(torch.bfloat16) is not None,
                    reason=f"{kernels.int8_unsupported(torch.bfloat16)}")
def test_int8_linears_in_a_bf16_model_keep_its_dtype_and_stay_close():
    model = tiny_model("llama", seed=6).to(torch.bfloat16)
    ref = CausalLM(copy.deepcopy(model))
    q = CausalLM(model)
    n = kernels.quantize_int8(q.base)
    assert n == sum(type(m) is torch.nn.Linear for m in ref.base.modules())
    assert sum(type(m) is kernels.Int8Linear for m in q.base.modules()) == n
    assert not any(type(m) is torch.nn.Linear for m in q.base.modules())
    h_ref, h_q = hidden_rows(ref, 12), hidden_rows(q, 12)
    assert h_q.dtype == torch.bfloat16
    rel = ((h_q.float() - h_ref.float()).norm() / h_ref.float().norm()).item()
    assert 0 < rel < 0.15, rel
    agree = (ref.logits(h_ref).argmax(-1) == q.logits(h_q).argmax(-1)).float().mean()
    assert agree >= 0.75, agree


@pytest.mark.skipif(kernels.int8_unsupported(torch.bfloat16) is not None,
                    reason=f"{kernels.int8_unsupported(torch.bfloat16)}")
def test_an_int8_bf16_middle_drafter_changes_nothing_the_fp32_target_outputs():
    target, middle = tiny_pair("qwen3", seed=5)
    middle = CausalLM(middle.model.to(torch.bfloat16))
    kernels.quantize_int8(middle.base)
    middle.quantized = True
    prompt = [7, 8, 9, 10, 7, 8, 9, 11, 12, 7, 8]
    expected = hf_greedy(target, prompt, 24)
    decoder = Decoder(target, middle, TreeConfig(budget=16))
    for method in ("all-mid", "01010"):
        assert decoder.generate(prompt, 24, method).tokens == expected, method
    assert sum(decoder.generate(prompt, 24, "all-mid").stats.middle_calls) > 0
