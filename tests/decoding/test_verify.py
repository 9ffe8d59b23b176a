"""Tree attention and KV cache bookkeeping against plain forward passes."""

import random

import numpy as np
import pytest
import torch
from tiny import VOCAB, tiny_model, tiny_pair

from treegraft_dist.decoding import neural
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import draft_tree
from treegraft_dist.decoding.neural import NeuralDrafter
from treegraft_dist.decoding.ngram import NGramDrafter
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import fixed_schedule
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree, Proposal
from treegraft_dist.decoding.verify import TargetVerifier, tree_attention
from treegraft_dist.models import hf
from treegraft_dist.models.hf import CausalLM, cache_len


def random_tree(rng: random.Random, size: int) -> DraftTree:
    tree = DraftTree(rng.randrange(VOCAB))
    while tree.size < size:
        parent = rng.randrange(tree.size)
        tree.graft(Proposal(tree.size, np.array([parent]), np.array([rng.randrange(VOCAB)]), np.zeros(1),
                            ORIGIN_MIDDLE), 1)
    return tree


def chain_logits(lm: CausalLM, tokens: list[int]) -> torch.Tensor:
    cache = lm.new_cache()
    return lm.logits(lm.hidden(cache, torch.tensor(tokens), torch.arange(len(tokens))))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_attention_equals_each_branch_as_a_chain(arch, seed):
    rng = random.Random(seed)
    lm = CausalLM(tiny_model(arch))
    context = [rng.randrange(VOCAB) for _ in range(12)]
    tree = random_tree(rng, 30)
    cache = lm.new_cache()
    lm.hidden(cache, torch.tensor(context), torch.arange(len(context)))
    attend, positions = tree_attention(tree, len(context))
    tree_logits = lm.logits(lm.hidden(cache, torch.from_numpy(tree.token_list().copy()), positions, attend))
    for row in tree.leaf_paths():
        path = [int(i) for i in row if i >= 0]
        ref = chain_logits(lm, context + [int(tree.tokens[i]) for i in path])[len(context):]
        torch.testing.assert_close(tree_logits[path], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_without_copies_gives_transformers_own_tree_logits(dtype, monkeypatch):
    from treegraft_dist.models.hf import SDPA_GQA_ENV

    rng = random.Random(4)
    lm = CausalLM(tiny_model("qwen3").to(dtype))  # 4 query heads over 2 key/value heads
    assert lm.model.config.num_attention_heads > lm.model.config.num_key_value_heads
    context = [rng.randrange(VOCAB) for _ in range(20)]
    tree = random_tree(rng, 24)
    out = {}
    for flag in ("0", "1"):  # "0": transformers repeats the keys and values per head group
        monkeypatch.setenv(SDPA_GQA_ENV, flag)
        cache = lm.new_cache()
        lm.hidden(cache, torch.tensor(context), torch.arange(len(context)))
        attend, positions = tree_attention(tree, len(context))
        out[flag] = lm.logits(lm.hidden(cache, torch.from_numpy(tree.token_list().copy()), positions, attend))
    torch.testing.assert_close(out["1"], out["0"], rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_and_causal_masks_equal_their_full_width_forms(dtype):
    lm = CausalLM(tiny_model("llama").to(dtype))
    lowest = torch.finfo(dtype).min
    past, n = 7, 5
    full = torch.ones((n, past + n), dtype=torch.bool).tril_(past)
    want = torch.zeros((n, past + n), dtype=dtype).masked_fill_(~full, lowest)
    assert torch.equal(lm._additive_mask(n, past, None), want)
    assert torch.equal(lm._additive_mask(n, past, full[:, past:]), want)
    assert torch.equal(lm._additive_mask(n, past, full), want)
    # A full-width mask may hide cached positions too (the middle drafter's does).
    full[:, 2] = False
    assert torch.equal(lm._additive_mask(n, past, full), want.masked_fill(~full, lowest))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_on_the_causal_path_without_a_mask_equals_the_explicit_mask(dtype):
    lm = CausalLM(tiny_model("llama").to(dtype))
    rng = random.Random(3)
    prompt = torch.tensor([rng.randrange(VOCAB) for _ in range(3 * hf.SMALL_BLOCK)])
    positions = torch.arange(len(prompt))
    caches = [lm.new_cache(), lm.new_cache()]
    h_causal = lm.hidden(caches[0], prompt, positions)  # an empty cache: no mask tensor
    full = torch.ones((len(prompt), len(prompt)), dtype=torch.bool).tril_()
    h_mask = lm.hidden(caches[1], prompt, positions, full)  # the same mask, explicit
    torch.testing.assert_close(h_causal, h_mask, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
    # the next block sees the prompt alike either way
    step = [lm.logits(lm.hidden(c, torch.tensor([5]), torch.tensor([len(prompt)]))) for c in caches]
    torch.testing.assert_close(step[0], step[1], rtol=0, atol=1e-4 if dtype == torch.float32 else 5e-2)


def test_target_cache_after_rounds_equals_one_plain_forward():
    target, mid = tiny_pair("llama", "close")
    cfg = TreeConfig()
    prompt = [7, 3, 9, 1, 7, 3, 9, 2] * 3
    verifier = TargetVerifier(target, SamplingParams())
    first, prefill = verifier.prefill(prompt)
    ngram = NGramDrafter(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth)
    middle = NeuralDrafter(mid, cfg.top_k, cfg.lookback)
    for d in (ngram, middle):
        d.start(prompt, prefill)
        d.accept([], [first])
    context = prompt + [first]
    timer = PhaseTimer(RequestStats("t"))
    for pattern in ("11111", "00000", "10010", "01100", "00000", "11000"):
        tree, _ = draft_tree(context[-1], cfg, fixed_schedule(pattern, 5), ngram, middle, timer, None)
        pruned, kept = tree.prune(cfg.budget)
        verdict = verifier.verify(pruned)
        path = [0] + [int(kept[i]) for i in verdict.accepted]
        for d in (ngram, middle):
            d.accept(path, verdict.tokens)
        context += verdict.tokens

    # The target holds the whole context but its last token (the next root).
    ref = target.new_cache()
    target.hidden(ref, torch.tensor(context[:-1]), torch.arange(len(context) - 1))
    assert cache_len(verifier.cache) == len(context) - 1
    for got, want in zip(verifier.cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-5)

    # The middle drafter holds a prefix of the context (it catches up at its next call).
    n = middle.committed
    assert cache_len(middle.cache) == n <= len(context) - 1
    ref = mid.new_cache()
    mid.hidden(ref, torch.tensor(context[:n]), torch.arange(n))
    for got, want in zip(middle.cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-5)


def test_middle_rescore_is_cumulative_logprob_along_paths():
    target, mid = tiny_pair("qwen3", "random")
    prompt = [5, 6, 7, 8, 9] * 3
    drafter = NeuralDrafter(mid, top_k=4, lookback=5)
    drafter.start(prompt, None)
    drafter.accept([], [11])
    rng = random.Random(3)
    tree = random_tree(rng, 12)
    tree.tokens[0] = 11
    proposal = drafter.step(tree, np.array([0]), 1)
    context = prompt + [11]
    for node in range(1, tree.size):
        path = tree.path(node)
        toks = [int(tree.tokens[i]) for i in path]
        logp = torch.log_softmax(chain_logits(mid, context[:-1] + toks), -1)
        base = len(context) - 1
        expected = sum(float(logp[base + j - 1, toks[j]]) for j in range(1, len(toks)))
        assert proposal.rescore[node] == pytest.approx(expected, abs=1e-4)
    # Children proposed for each selected node are that node's top-k under the middle model.
    assert len(proposal) % 4 == 0


@pytest.mark.parametrize("leaves", [5, 60])
def test_middle_runs_parents_and_candidate_leaves_in_one_forward_when_few(monkeypatch, leaves):
    # An n-gram-like tree the middle has not seen: a chain of 3 parents below the root, then `leaves`
    # leaves under its end. Few leaves: one forward over all; many: the parents, then the K selected.
    _, mid = tiny_pair("qwen3", "random")
    prompt = [5, 6, 7, 8, 9] * 3

    def tree_and_call(max_leaves):
        monkeypatch.setattr(neural, "ONE_FORWARD_MAX_LEAVES", max_leaves)
        tree = DraftTree(11)
        n = 3 + leaves
        parents = np.array([0, 1, 2] + [3] * leaves)
        tree.graft(Proposal(1, parents, np.arange(n) % VOCAB, -np.arange(1, n + 1) / 10, ORIGIN_NGRAM), 1)
        drafter = NeuralDrafter(mid, top_k=4, lookback=0)  # candidates: the leaves (the frontier's depth)
        drafter.start(prompt, None)
        drafter.accept([], [11])
        return drafter.step(tree, np.arange(4, 4 + leaves), 2), drafter.forward_sizes

    most = neural.ONE_FORWARD_MAX_LEAVES
    got, sizes = tree_and_call(most)
    want, two = tree_and_call(-1)  # never one forward
    catch_up = len(prompt)  # the context but its last token, the root (node 0)
    assert two == [catch_up + 4, 4]
    assert sizes == ([catch_up + 4 + leaves] if leaves <= most else two)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.rescore, want.rescore, rtol=1e-5, atol=1e-5)
