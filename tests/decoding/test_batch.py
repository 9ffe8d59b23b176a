"""Several requests in one target pass (batch.py, verify.forward_blocks): linear layers over every row, attention
block by block over each request's own cache, give every request what it gets alone: the same verdicts and tokens (the target's own
greedy decoding), the same KV caches, whatever mix of prompt chunks, tree verifications and plain steps
shares a pass. An item that fails, or a pass that raises, fails only the request whose item caused it."""

import pickle
import random

import numpy as np
import pytest
import torch
from tiny import VOCAB, hf_greedy, tiny_pair

from treegraft_dist.decoding import verify
from treegraft_dist.decoding.batch import ERROR, INPUT, PREFILL, STEP, VERIFY, BatchedTarget, ItemFailed, Work
from treegraft_dist.decoding.errors import RequestFailed
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.tree import ORIGIN_NGRAM, DraftTree, Proposal
from treegraft_dist.decoding.verify import TargetVerifier, forward_blocks


def chain_tree(root: int, tokens: list[int], wrong_sibling: int | None = None) -> DraftTree:
    """root -> tokens[0] -> tokens[1] ...; optionally a wrong sibling beside tokens[0]."""
    tree = DraftTree(root)
    if tokens:
        n = len(tokens)
        parents = np.concatenate([[0], 1 + np.arange(n - 1)]).astype(np.int64)
        tree.graft(Proposal(1, parents, np.array(tokens), -np.arange(1, n + 1, dtype=np.float64), ORIGIN_NGRAM), 1)
    if wrong_sibling is not None:
        tree.graft(Proposal(tree.size, np.array([0]), np.array([wrong_sibling]), np.array([-9.0]), ORIGIN_NGRAM), 2)
    return tree


@pytest.mark.parametrize("arch,window", [("llama", 0), ("qwen3", 10)])
def test_mixed_passes_equal_each_request_alone(arch, window, monkeypatch):
    target, _ = tiny_pair(arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 30, 13, 1)]
    new = 24
    oracle = [hf_greedy(target, p, new) for p in prompts]
    whole = [TargetVerifier(target, SamplingParams()).prefill(p)[1] for p in prompts]  # every row scored
    monkeypatch.setattr(verify, "PREFILL_SCORE_WINDOW", window)  # 10: the 30-token prompt's last 10, across chunks
    batch = BatchedTarget(target, SamplingParams())
    chunk = 8
    state = [{"next": 0, "out": [], "done": False} for _ in prompts]
    passes = 0
    while not all(s["done"] for s in state):
        items = []
        for rid, (p, s) in enumerate(zip(prompts, state)):
            if s["done"] or (rid == 3 and passes < 3):  # the last request arrives late: its prefill joins rounds
                continue
            if s["next"] < len(p):
                end = min(len(p), s["next"] + chunk)
                items.append(Work(PREFILL, rid, prompt=p if s["next"] == 0 else None, start=s["next"], end=end))
                s["next"] = end
            elif rid % 2 == 0:  # plain steps
                items.append(Work(STEP, rid, token=s["out"][-1]))
            else:  # a tree: the right continuation up to a random depth, then a wrong token
                done = len(s["out"])
                truth = oracle[rid][done:done + rng.randrange(0, 4)]
                wrong = (oracle[rid][done + len(truth)] + 1) % VOCAB if done + len(truth) < new else None
                tokens = truth + ([wrong] if wrong is not None and rng.random() < 0.5 else [])
                sibling = None if not truth else (truth[0] + 2) % VOCAB
                items.append(Work(VERIFY, rid, tree=chain_tree(s["out"][-1], tokens, sibling)))
        rng.shuffle(items)
        for w, result in zip(items, batch.run(items)):
            s = state[w.rid]
            if w.kind == PREFILL:
                if result is not None:
                    first, cache = result
                    start = max(0, len(prompts[w.rid]) - window) if window else 0
                    assert cache.start == start and cache.tokens.shape == (len(prompts[w.rid]) - start, 10)
                    np.testing.assert_array_equal(cache.tokens, whole[w.rid].tokens[start:])
                    s["out"].append(first)
            elif w.kind == STEP:
                s["out"].append(result)
            else:
                s["out"].extend(result.tokens)
            s["done"] = len(s["out"]) >= new
        passes += 1
    assert batch.passes == passes and batch.items > passes  # passes were shared
    for rid, s in enumerate(state):
        assert s["out"][:new] == oracle[rid], rid


def test_a_shared_pass_leaves_each_cache_as_a_lone_pass_would():
    target, _ = tiny_pair("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 9)]
    alone, together = [], []
    for group in (alone, together):
        for p in prompts:
            v = TargetVerifier(target, SamplingParams())
            v.prefill(p)
            group.append(v)
    trees = [chain_tree(3, [4, 5]), chain_tree(6, []), chain_tree(7, [8, 9, 10], 11)]
    lone = [forward_blocks(target, [v.verify_block(t)])[0] for v, t in zip(alone, trees)]
    shared = forward_blocks(target, [v.verify_block(t) for v, t in zip(together, trees)])
    for a, b, va, vb in zip(lone, shared, alone, together):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for la, lb in zip(va.cache.layers, vb.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)


def test_one_item_per_request_in_a_pass():
    target, _ = tiny_pair("llama")
    batch = BatchedTarget(target, SamplingParams())
    batch.run([Work(PREFILL, 0, prompt=[1, 2, 3], start=0, end=3)])
    with pytest.raises(ValueError, match="one item per request"):
        batch.run([Work(STEP, 0, token=1), Work(STEP, 0, token=2)])


def test_a_pass_takes_the_oldest_then_rounds_before_prompt_chunks():
    from treegraft_dist.decoding.batch import take_pass

    def chunk(rid, rows):
        return Work(PREFILL, rid, start=0, end=rows)

    tree = chain_tree(1, [2, 3, 4])  # 4 nodes
    step, verify = (lambda rid: Work(STEP, rid, token=5)), (lambda rid: Work(VERIFY, rid, tree=tree))
    # The oldest item goes first whatever it is; steps and trees join it before a later prompt chunk.
    waiting = [chunk(0, 256), chunk(1, 256), step(2), verify(3), step(2)]
    assert take_pass(waiting, 384) == [0, 2, 3]  # request 2's second step waits: one item per request
    assert take_pass(waiting, 256) == [0]  # no room beside a full chunk
    # Rounds first: a chunk that arrived before them waits when they fill the pass ...
    waiting = [step(0)] + [chunk(1, 200)] + [verify(r) for r in range(2, 40)]
    taken = take_pass(waiting, 100)
    assert 1 not in taken and sum(waiting[i].rows for i in taken) <= 100 and len(taken) == 25
    # ... but it goes once it is the oldest, even alone over the row budget.
    assert take_pass(waiting[1:], 100) == [0]
    assert take_pass([], 8) == []


# -- faults stay with their item ------------------------------------------------------------------------------
def next_item(rid: int, prompt: list[int], s: dict, oracle: list[int], rng: random.Random, chunk: int = 8) -> Work:
    """Request `rid`'s next piece of work: a prompt chunk, else a plain step (even ids) or a tree holding the
    right continuation to a random depth and a wrong sibling (odd ids)."""
    if s["next"] < len(prompt):
        end = min(len(prompt), s["next"] + chunk)
        w = Work(PREFILL, rid, prompt=prompt if s["next"] == 0 else None, start=s["next"], end=end)
        s["next"] = end
        return w
    if rid % 2 == 0:
        return Work(STEP, rid, token=s["out"][-1])
    done = len(s["out"])
    truth = oracle[done:done + rng.randrange(0, 4)]
    return Work(VERIFY, rid, tree=chain_tree(s["out"][-1], truth, (truth[0] + 2) % VOCAB if truth else None))


def take(s: dict, w: Work, result) -> None:
    if w.kind == PREFILL:
        if result is not None:
            s["out"].append(result[0])
    elif w.kind == STEP:
        s["out"].append(result)
    else:
        s["out"].extend(result.tokens)


class Poison:
    """Every forward pass that holds `cache` raises at the target's second decoder layer: after the first
    layer has written its keys and values into every cache of the pass, as a fault deep in a real pass would."""

    def __init__(self, lm, cache):
        self.cache, self.armed, self.raised = cache, False, 0
        original = lm.hidden_blocks

        def hidden_blocks(caches, *args):
            self.armed = any(c is self.cache for c in caches)
            try:
                return original(caches, *args)
            finally:
                self.armed = False

        lm.hidden_blocks = hidden_blocks  # what every pass of a few rows, shared or not, goes through
        lm.model.model.layers[1].register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        if self.armed:
            self.raised += 1
            raise RuntimeError("injected fault in the second layer")


def test_a_pass_that_raises_midway_fails_only_its_culprit():
    """The shared forward raises after its first layer wrote every cache; the pass is rerun item by item
    from caches cut back, so only the culprit fails and the others (a late prompt among them) still decode
    the target's own greedy output."""
    target, _ = tiny_pair("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 6, 11, 40)]
    new, culprit, late = 20, 1, 4
    oracle = [hf_greedy(target, p, new) for p in prompts]
    batch = BatchedTarget(target, SamplingParams())
    state = [{"next": 0, "out": []} for _ in prompts]
    poison, failed_pass = None, None
    for passes in range(200):
        live = [r for r, s in enumerate(state)
                if (poison is None if r == culprit else len(s["out"]) < new and (r != late or passes >= 4))]
        if not live:
            break
        if passes == 4:  # the culprit is mid-request; the late request's prompt joins this pass
            assert batch.requests[culprit].cache.get_seq_length() > 0
            poison = Poison(target, batch.requests[culprit].cache)
            before = batch.requests[culprit].cache.get_seq_length()
        items = [next_item(r, prompts[r], state[r], oracle[r], rng) for r in live]
        rng.shuffle(items)
        for w, result in zip(items, batch.run(items)):
            if w.rid == culprit and passes == 4:
                failed_pass = [x.rid for x in items]
                assert isinstance(result, ItemFailed) and result.kind == ERROR and "injected" in result.message
                assert isinstance(result.error(), RequestFailed)
                assert batch.requests[culprit].cache.get_seq_length() == before  # cut back, as it was
            else:
                assert not isinstance(result, ItemFailed), (w, result)
                take(state[w.rid], w, result)
    assert poison.raised == 2  # the shared pass, then the culprit's own rerun
    assert late in failed_pass and len(failed_pass) == 5
    for rid, s in enumerate(state):
        if rid != culprit:
            assert s["out"][:new] == oracle[rid], rid


def test_items_that_cannot_be_prepared_or_read_fail_alone():
    target, _ = tiny_pair("qwen3")
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (8, 12)]
    oracle = [hf_greedy(target, p, 12) for p in prompts]
    batch = BatchedTarget(target, SamplingParams())
    state = [{"next": 0, "out": []} for _ in prompts]
    bad = [Work(PREFILL, 10, prompt=[1, VOCAB, 2], start=0, end=3),  # a prompt id outside the vocabulary
           Work(PREFILL, 11, prompt=[1, 2], start=0, end=2, seed=2**64),  # a seed manual_seed does not take
           Work(PREFILL, 12, prompt=[1, 2], start=0, end=2, sampling=object.__new__(SamplingParams)),
           Work(STEP, 13, token=5)]  # a request never prefilled
    object.__setattr__(bad[2].sampling, "temperature", float("nan"))  # unpickled params skip __init__'s check
    object.__setattr__(bad[2].sampling, "top_k", 0)
    object.__setattr__(bad[2].sampling, "top_p", 1.0)
    items = [next_item(r, prompts[r], state[r], oracle[r], rng, chunk=16) for r in (0, 1)] + bad
    results = batch.run(items)
    for w, result in zip(items[:2], results[:2]):
        take(state[w.rid], w, result)
    kinds = [(r.kind, type(r.error())) for r in results[2:]]
    assert kinds == [(INPUT, ValueError)] * 3 + [(ERROR, RequestFailed)], results[2:]
    assert "vocabulary" in results[2].message and "seed" in results[3].message
    assert set(batch.requests) == {0, 1}  # the bad requests left nothing behind
    # A verdict that cannot be read out (its _done raises) fails its request alone, in a shared pass.
    batch.requests[1].verify_done = lambda *a: 1 / 0
    while len(state[0]["out"]) < 12:
        items = [next_item(0, prompts[0], state[0], oracle[0], rng), Work(VERIFY, 1, tree=chain_tree(3, [4]))]
        first, second = batch.run(items)
        take(state[0], items[0], first)
        assert isinstance(second, ItemFailed) and "ZeroDivisionError" in second.message
    assert state[0]["out"][:12] == oracle[0]
    assert pickle.loads(pickle.dumps(second)) == second
