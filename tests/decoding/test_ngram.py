"""The n-gram drafter on hand-made contexts: index matching, prefill scores, whole drafting steps, and the
history of earlier requests it also matches (against a brute-force scan, bounded, least recently used out)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treegraft_dist.decoding.ngram import (
    OUTSIDE_TOPK_PENALTY,
    HistoryIndex,
    NGramDrafter,
    NGramIndex,
    PrefillCache,
)
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree, Proposal


def index_of(tokens, max_n=5) -> NGramIndex:
    index = NGramIndex(max_n)
    index.extend(tokens)
    return index


def prefill_of(rows: list[dict[int, float]]) -> PrefillCache:
    """Row i: {token: log-prob} of the token at position i + 1 (all rows the same width)."""
    width = max(len(r) for r in rows)
    toks = np.zeros((len(rows), width), np.int64)
    lps = np.zeros((len(rows), width), np.float64)
    for i, r in enumerate(rows):
        items = sorted(r.items(), key=lambda kv: -kv[1])
        toks[i], lps[i] = [t for t, _ in items], [lp for _, lp in items]
    return PrefillCache(toks, lps)


def entries(prop: Proposal) -> list[tuple[int, int]]:
    return list(zip(prop.parents.tolist(), prop.tokens.tolist()))


# -- NGramIndex.matches -------------------------------------------------------------------------------

A = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]


@pytest.mark.parametrize("suffix, k, want", [
    ([1, 2, 3], 10, [(3, 7), (3, 3)]),  # the trailing 1 2 3 has no follower yet
    ([9, 2, 3], 10, [(2, 7), (2, 3)]),
    ([3], 10, [(1, 7), (1, 3)]),
    ([2], 10, [(1, 10)]),  # three occurrences, one distinct follower: the most recent
    ([3, 5, 1], 10, [(3, 9)]),
    ([4, 1, 2, 3, 5, 1], 10, [(5, 9)]),  # only the last max_n tokens count
    ([1, 2, 3], 1, [(3, 7)]),
    ([7], 10, []),
    ([], 10, []),
])
def test_matches_on_a_repetitive_context(suffix, k, want):
    assert index_of(A).matches(suffix, k) == want


def test_longer_match_beats_a_more_recent_one():
    index = index_of([5, 6, 7, 0, 8, 7, 9])
    assert index.matches([6, 7], 10) == [(2, 3), (1, 6)]
    assert index.matches([8, 7], 10) == [(2, 6), (1, 3)]


def test_most_recent_first_and_at_most_k():
    index = index_of([0, 1, 0, 2, 0, 3, 0, 4, 0])
    assert index.matches([0], 2) == [(1, 7), (1, 5)]
    assert index.matches([0], 10) == [(1, 7), (1, 5), (1, 3), (1, 1)]


def test_an_ngram_at_the_end_of_the_context_is_not_a_match():
    index = index_of([1, 2, 3])
    assert index.matches([2, 3], 10) == []
    assert index.matches([3], 10) == []
    assert index.matches([1, 2], 10) == [(2, 2)]
    index.extend([8])  # now 2 3 and 3 have a follower
    assert index.matches([2, 3], 10) == [(2, 3)]


def test_max_n_bounds_the_match_length():
    index = index_of([1, 2, 3, 4, 9, 2, 3, 5], max_n=2)
    # "1 2 3" would pick 4; with max_n 2 only "2 3" counts, and its most recent follower is 5.
    assert index.matches([1, 2, 3], 10) == [(2, 7), (2, 3)]


def test_extend_in_pieces_equals_extend_at_once():
    whole = index_of(A)
    pieces = NGramIndex(5)
    for a, b in [(0, 3), (3, 4), (4, 11)]:
        pieces.extend(A[a:b])
    assert pieces.tokens == whole.tokens
    for suffix in ([1, 2, 3], [3], [2, 3, 5], [4, 1]):
        assert pieces.matches(suffix, 10) == whole.matches(suffix, 10)


def test_most_frequent_token():
    index = index_of([4, 5, 5, 6, 5, 4])
    assert index.most_frequent == 5
    assert NGramIndex(5).most_frequent == -1


def brute_matches(ctx, suffix, k, max_n):
    out, seen = [], set()
    for n in range(min(max_n, len(suffix)), 0, -1):
        for p in range(len(ctx) - 1, n - 1, -1):
            if ctx[p - n : p] == suffix[len(suffix) - n :] and ctx[p] not in seen:
                seen.add(ctx[p])
                out.append((n, p))
                if len(out) == k:
                    return out
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=7),
       st.integers(1, 5), st.integers(1, 5))
def test_matches_equal_a_brute_force_scan(ctx, suffix, k, max_n):
    assert index_of(ctx, max_n).matches(suffix, k) == brute_matches(ctx, suffix, k, max_n)


# -- PrefillCache -------------------------------------------------------------------------------------

def test_prefill_logprob():
    cache = prefill_of([{5: -0.1, 6: -2.0}, {7: -0.5, 8: -1.5}, {9: -0.2, 10: -3.0}])
    floor = -3.0 - OUTSIDE_TOPK_PENALTY
    assert cache.floor == floor
    assert cache.logprob(1, 5) == -0.1  # row = position - 1
    assert cache.logprob(1, 6) == -2.0
    assert cache.logprob(1, 7) == floor  # in another row's top-k, not this one's
    assert cache.logprob(2, 8) == -1.5
    assert cache.logprob(3, 9) == -0.2  # position = prompt length: the first generated token
    assert cache.logprob(3, 99) == floor
    assert cache.logprob(0, 5) == 0.0
    assert cache.logprob(4, 9) == 0.0  # beyond the prompt: nothing cached
    assert cache.logprob(100, 9) == 0.0
    later = PrefillCache(cache.tokens[1:], cache.logprobs[1:], start=1)  # row 0 not stored
    assert later.logprob(1, 5) == 0.0  # nothing stored: scored as generated text is
    assert later.logprob(2, 8) == -1.5 and later.logprob(3, 9) == -0.2 and later.logprob(3, 99) == later.floor
    assert later.logprob(4, 9) == 0.0


# -- NGramDrafter.step --------------------------------------------------------------------------------

# 0  1  2  3  4  5  6  7  8   9  10  11 12 13
P = [1, 2, 3, 4, 5, 6, 7, 8, 11, 2, 30, 5, 1, 2]


def p_prefill() -> PrefillCache:
    """Position q's true token P[q] gets -q/10 (row 9 leaves 30 out), every row also names 50 at -4."""
    rows = [{(P[r + 1] if r + 1 < len(P) else 99): -(r + 1) / 10, 50: -4.0} for r in range(len(P))]
    rows[9] = {31: -1.0, 50: -4.0}
    return prefill_of(rows)


FLOOR = -4.0 - OUTSIDE_TOPK_PENALTY


def drafter(context, prefill=None, **kw) -> NGramDrafter:
    d = NGramDrafter(**kw)
    d.start(context, prefill)
    return d


def test_step_from_the_root_children_order_scores_and_chain():
    d = drafter(P, p_prefill())
    tree = DraftTree(P[-1])
    prop = d.step(tree, np.array([0]), 1)
    # Root suffix ... 1 2: "1 2" matched at 0..1 (followed by 3 at position 2); "2" also at 9 (-> 30 at 10).
    # Best match 3 carries min(chain 4, depth 5 - layer 1) = 4 more tokens: 4 5 6 7.
    assert prop.base == 1 and prop.origin == ORIGIN_NGRAM and prop.rescore is None
    assert entries(prop) == [(0, 3), (1, 4), (2, 5), (3, 6), (4, 7), (0, 30)]
    want = np.cumsum([-0.2, -0.3, -0.4, -0.5, -0.6]).tolist() + [FLOOR]
    assert prop.scores.tolist() == pytest.approx(want)
    assert tree.size == 1  # a step never mutates the tree


@pytest.mark.parametrize("depth, chain, layer, want_chain", [
    (5, 4, 1, [4, 5, 6, 7]),
    (3, 4, 1, [4, 5]),  # depth - layer = 2
    (5, 1, 1, [4]),
    (5, 0, 1, []),
    (5, 4, 2, [4, 5, 6]),
    (5, 4, 5, []),
])
def test_chain_length_is_min_of_chain_and_remaining_depth(depth, chain, layer, want_chain):
    d = drafter(P, None, depth=depth, chain=chain)
    prop = d.step(DraftTree(P[-1]), np.array([0]), layer)
    chain_parents = [0] + [1 + i for i in range(len(want_chain))]
    assert entries(prop) == list(zip(chain_parents, [3] + want_chain)) + [(0, 30)]
    assert prop.scores.tolist() == [0.0] * len(prop)  # no prefill cache: every log-prob is 0


@pytest.mark.parametrize("long_chain, layer, f, want_chain", [
    (0, 1, 0, [4, 5, 6, 7]),  # the published settings: min(chain, depth - layer)
    (6, 1, 0, [4, 5, 6, 7, 8, 11]),  # past depth 5: the root's best match copies 6 tokens
    (2, 1, 0, [4, 5, 6, 7]),  # never shorter than the published chain
    (6, 2, 0, [4, 5, 6, 7, 8, 11]),  # at the round's first n-gram layer, whichever layer that is
])
def test_long_chain_copies_past_the_depth_from_the_root_at_layer_one(long_chain, layer, f, want_chain):
    d = drafter(P, None, long_chain=long_chain)
    prop = d.step(DraftTree(P[-1]), np.array([f]), layer)
    chain_parents = [0] + [1 + i for i in range(len(want_chain))]
    assert entries(prop) == list(zip(chain_parents, [3] + want_chain)) + [(0, 30)]


def test_long_chain_is_for_the_best_frontier_node_of_the_rounds_first_ngram_layer():
    # "7 9 1 2" ends the context and occurred before, followed by 3 4 5 6 8 11 13 ...
    ctx = [7, 9, 1, 2, 3, 4, 5, 6, 8, 11, 13, 7, 9, 1, 2]

    def after_a_middle_layer(best: int) -> Proposal:
        """Layer 2 after a middle layer that proposed 3 and 5 below the root, `best` the likelier."""
        tree = DraftTree(ctx[-1])
        tree.graft(Proposal(1, np.array([0, 0]), np.array([3, 5]),
                            np.array([-0.1, -2.0] if best == 3 else [-2.0, -0.1]), ORIGIN_MIDDLE), 1)
        return drafter(ctx, None, long_chain=6).step(tree, np.array([1, 2]), 2)

    def chain_below(prop: Proposal, node: int) -> list[int]:
        """The tokens of the chain the proposal hangs below tree node `node` (its first child, then on)."""
        out, parent = [], node
        for j, (par, tok) in enumerate(entries(prop)):
            if par == parent:
                out.append(tok)
                parent = prop.base + j
        return out

    # Below 3 the path continues a 5-token match (7 9 1 2 3): the long chain copies on past the depth.
    prop = after_a_middle_layer(best=3)
    assert chain_below(prop, 1) == [4, 5, 6, 8, 11, 13, 7] and chain_below(prop, 2) == [6, 8, 11, 13]
    # Below 5 only "5" matches: not a copy worth a long chain, even as the middle's best guess; 3 is not the best.
    prop = after_a_middle_layer(best=5)
    assert chain_below(prop, 2) == [6, 8, 11, 13] and chain_below(prop, 1) == [4, 5, 6, 8]
    # Once an n-gram layer ran in the round, later ones keep the published chain length: min(4, 5 - 3) at 3.
    tree = DraftTree(P[-1])
    tree.graft(Proposal(1, np.array([0]), np.array([30]), np.array([-0.1]), ORIGIN_MIDDLE), 1)
    tree.graft(Proposal(2, np.array([1]), np.array([5]), np.array([-0.1]), ORIGIN_NGRAM), 2)
    later = drafter(P, None, long_chain=6).step(tree, np.array([0]), 3)
    assert chain_below(later, 0) == [3, 4, 5]
    assert chain_below(drafter(P, None, long_chain=6).step(DraftTree(P[-1]), np.array([0]), 3), 0) == [
        3, 4, 5, 6, 7, 8, 11]  # the same step as the round's first n-gram layer


def test_chain_stops_at_the_end_of_the_context():
    d = drafter(A)
    prop = d.step(DraftTree(A[-1]), np.array([0]), 1)
    # "1 2 3" followed by 5 at 7 (most recent), then by 4 at 3; the chain after 7 is 1 2 3, then the end.
    assert entries(prop) == [(0, 5), (1, 1), (2, 2), (3, 3), (0, 4)]


def test_top_k_limits_the_children():
    d = drafter(P, None, top_k=1)
    assert entries(d.step(DraftTree(P[-1]), np.array([0]), 1)) == [(0, 3), (1, 4), (2, 5), (3, 6), (4, 7)]


def test_step_from_a_deeper_node_uses_its_path_and_its_score():
    d = drafter(P, p_prefill())
    tree = DraftTree(P[-1])
    tree.graft(Proposal(1, np.array([0]), np.array([3]), np.array([-0.7]), ORIGIN_MIDDLE), 1)
    prop = d.step(tree, np.array([1]), 2)
    # Path 2 -> 3 after context ... 5 1: "1 2 3" matched at 0..2, followed by 4 at 3; chain 5 6 7 (3 = 5 - 2).
    assert prop.base == 2
    assert entries(prop) == [(1, 4), (2, 5), (3, 6), (4, 7)]
    assert prop.scores.tolist() == pytest.approx((-0.7 + np.cumsum([-0.3, -0.4, -0.5, -0.6])).tolist())


def test_layer_one_fallback_is_the_most_frequent_token_for_the_root_only():
    ctx = [5, 5, 6, 7]  # the root 7 never occurred before: no match at any length
    floor = -1.0 - OUTSIDE_TOPK_PENALTY
    d = drafter(ctx, prefill_of([{5: -0.5}, {6: -1.0}, {7: -0.2}, {8: -0.3}]))
    tree = DraftTree(7)
    prop = d.step(tree, np.array([0]), 1)
    assert entries(prop) == [(0, 5)]
    assert prop.scores.tolist() == [floor]

    assert len(d.step(tree, np.array([0]), 2)) == 0  # no fallback after layer 1

    tree.graft(Proposal(1, np.array([0]), np.array([42]), np.array([-1.0]), ORIGIN_MIDDLE), 1)
    assert len(d.step(tree, np.array([1]), 1)) == 0  # no fallback below the root
    assert entries(d.step(tree, np.array([1, 0]), 1)) == [(0, 5)]

    no_cache = drafter(ctx).step(DraftTree(7), np.array([0]), 1)
    assert entries(no_cache) == [(0, 5)] and no_cache.scores.tolist() == [0.0]


def test_a_parent_with_fewer_than_k_ngram_children_is_not_expanded_again():
    d = drafter(P, None, top_k=10)
    tree = DraftTree(P[-1])
    tree.graft(Proposal(1, np.array([0, 0]), np.array([3, 30]), np.zeros(2), ORIGIN_NGRAM), 1)
    assert tree.expanded[0] & (1 << ORIGIN_NGRAM)
    assert len(d.step(tree, np.array([0]), 2)) == 0

    # With K = 2 the root has its full K n-gram children: it is expanded again (same children, chain).
    d2 = drafter(P, None, top_k=2)
    assert entries(d2.step(tree, np.array([0]), 2)) == [(0, 3), (3, 4), (4, 5), (5, 6), (0, 30)]

    # Only the n-gram bit counts: a node expanded by the middle drafter is still open to the n-gram step.
    mid = DraftTree(P[-1])
    mid.graft(Proposal(1, np.array([0, 0]), np.array([3, 30]), np.zeros(2), ORIGIN_MIDDLE), 1)
    assert entries(d.step(mid, np.array([0]), 2)) == [(0, 3), (3, 4), (4, 5), (5, 6), (0, 30)]


def test_a_closed_parent_is_skipped_but_the_rest_of_the_frontier_is_not():
    d = drafter(P, None)
    tree = DraftTree(P[-1])
    # Root -> 3 (node 1) -> 4 (node 2, a chain child), root -> 30 (node 3).
    tree.graft(Proposal(1, np.array([0, 1, 0]), np.array([3, 4, 30]), np.zeros(3), ORIGIN_NGRAM), 1)
    prop = d.step(tree, np.array([1, 2, 3]), 2)
    # Node 1 has one n-gram child (< K): skipped. Node 2: "1 2 3 4" -> 5, chain 6 7 8. Node 3: "2 30" ->
    # 5 at 11, chain 1 2 (the context ends there).
    assert prop.base == 4
    assert entries(prop) == [(2, 5), (4, 6), (5, 7), (6, 8), (3, 5), (8, 1), (9, 2)]


# -- the drafter's context ----------------------------------------------------------------------------

def test_accepted_tokens_become_matchable():
    d = drafter([1, 2, 3])
    assert d.index.matches([3], 10) == []
    d.accept([0, 1], [4, 5, 3])
    assert d.index.tokens == [1, 2, 3, 4, 5, 3]
    assert d.index.matches([3], 10) == [(1, 3)]
    # The root is the last accepted token: its suffix 3 matches at 2, followed by 4 5 3.
    assert entries(d.step(DraftTree(3), np.array([0]), 1)) == [(0, 4), (1, 5), (2, 3)]
    d.start([7, 8], None)  # a new request forgets the old context
    assert d.index.tokens == [7, 8] and d.index.matches([3], 10) == []


def test_scores_past_the_prompt_are_zero_like_the_engine_flow():
    prompt = [1, 2, 3, 1, 2]
    prefill = prefill_of([{2: -0.1}, {3: -0.2}, {1: -0.3}, {2: -0.4}, {3: -0.5}])
    d = drafter(prompt, prefill)
    d.accept([], [3])  # the prefill's first token, as Decoder does
    d.accept([0, 1], [4, 1])
    assert d.index.tokens == [1, 2, 3, 1, 2, 3, 4, 1]
    prop = d.step(DraftTree(1), np.array([0]), 1)
    # "1" was last followed by 2 at position 4; the chain 3 4 1 sits at positions 5 (= prompt length,
    # still cached), 6 and 7 (beyond the prompt: 0).
    assert entries(prop) == [(0, 2), (1, 3), (2, 4), (3, 1)]
    assert prop.scores.tolist() == pytest.approx([-0.4, -0.9, -0.9, -0.9])


# -- HistoryIndex: earlier requests ---------------------------------------------------------------------

def brute_history(seqs, suffix, k, max_n, min_n):
    """What HistoryIndex.matches must give: longest match first, then the latest occurrence (the last
    sequence added, its last position), distinct proposed tokens."""
    out, seen = [], set()
    for n in range(min(max_n, len(suffix)), min_n - 1, -1):
        for seq in reversed(seqs):
            for p in range(len(seq) - 1, n - 1, -1):
                if seq[p - n : p] == suffix[len(suffix) - n :] and seq[p] not in seen:
                    seen.add(seq[p])
                    out.append((n, p))
                    if len(out) == k:
                        return out
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=30), max_size=4),
       st.lists(st.integers(0, 3), max_size=7), st.integers(1, 5), st.integers(1, 3))
def test_history_matches_equal_a_brute_force_scan(seqs, suffix, k, min_n):
    h = HistoryIndex(10_000, 5, min_n)
    for seq in seqs:
        h.add(seq)
    got = h.matches(suffix, k)
    assert [(n, p) for n, _, p in got] == brute_history(seqs, suffix, k, 5, min_n)
    assert all(seq[p - n : p] == suffix[len(suffix) - n :] for n, seq, p in got)


def test_history_keeps_at_most_its_tokens_least_recently_used_out():
    h = HistoryIndex(25, max_n=3, min_n=3)
    a, b, c = [1, 2, 3, 10] + [0] * 6, [4, 5, 6, 20] + [0] * 6, [7, 8, 9, 30] + [0] * 6
    h.add(a)
    h.add(b)
    assert h.matches([1, 2, 3], 5)[0][2] == 3  # a is matched: now the most recently used
    h.add(c)  # 30 tokens > 25: b, the least recently used, goes
    assert h.tokens == 20 and len(h) == 2
    assert h.matches([4, 5, 6], 5) == [] and h.matches([1, 2, 3], 5) and h.matches([7, 8, 9], 5)
    for i in range(40):  # many evictions: the stale entries are dropped, matches stay right
        h.add([100 + i, 101 + i, 102 + i, 7] + [0] * 6)
    assert h.tokens <= 25 and h.matches([1, 2, 3], 5) == [] and h.matches([139, 140, 141], 5)[0][1][3] == 7
    assert len(h._keys) <= 2 * 3 * 25
    h.add(list(range(100)))  # longer than the bound: its last 25 tokens
    (_, seq, p), = h.matches([80, 81, 82], 5)
    assert h.tokens == 25 and seq[p] == 83 and seq[0] == 75 and h.matches([1, 2, 3], 5) == []
    with pytest.raises(ValueError, match="max_tokens"):
        HistoryIndex(0)


def test_drafter_proposes_from_history_after_its_own_matches_and_chains_from_there():
    h = HistoryIndex(1000, max_n=5, min_n=3)
    h.add([9, 1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47])  # an earlier request
    d = drafter([1, 2, 3, 30, 7, 1, 2, 3], chain=4, depth=5, long_chain=0, history=h)
    prop = d.step(DraftTree(3), np.array([0]), 1)
    # Own context: "1 2 3" -> 30 (n=3, the request's own wins the tie) with its chain; history: "9 1 2 3"
    # is not the suffix, "1 2 3" -> 40 (n=3) after it, no chain (only the best match carries one).
    assert entries(prop) == [(0, 30), (1, 7), (2, 1), (3, 2), (4, 3), (0, 40)]
    d = drafter([5, 5, 8, 9, 1, 2, 3], chain=4, depth=5, long_chain=8, history=h)
    prop = d.step(DraftTree(3), np.array([0]), 1)
    # Now history's match is longer (9 1 2 3): it comes first and carries the long chain, scored 0.
    assert entries(prop)[:9] == [(0, 40), (1, 41), (2, 42), (3, 43), (4, 44), (5, 45), (6, 46), (7, 47)][:9]
    assert prop.scores[:8].tolist() == [0.0] * 8
    assert drafter([5, 5, 8, 9, 1, 2, 3], long_chain=8).step(DraftTree(3), np.array([0]), 1).tokens.tolist() \
        != prop.tokens.tolist()  # without the history, nothing of it


def test_copying_needs_a_match_of_max_n_tokens_here_or_in_the_history():
    text = [4, 5, 6, 7, 8, 9, 10, 11]
    assert drafter(text + [1] + text[:5], long_chain=8).copying()  # 4 5 6 7 8 occurred before
    assert not drafter(text + [1] + text[1:5], long_chain=8).copying()  # a 4-token match only
    assert not drafter(text + [1] + text[:5], long_chain=0).copying()  # no long chain to follow: published
    assert not drafter([1, 2, 3]).copying()
    h = HistoryIndex(1000, max_n=5, min_n=3)
    h.add([20] + text)  # an earlier request said it
    assert drafter([30, 31] + text[:5], long_chain=8, history=h).copying()
    assert not drafter([30, 31] + text[1:5], long_chain=8, history=h).copying()


def test_a_copy_pins_its_long_chain_and_nothing_else():
    # "7 9 1 2" ends the context and occurred before, followed by 3 4 5 6 8 11 13 ...
    ctx = [7, 9, 1, 2, 3, 4, 5, 6, 8, 11, 13, 2, 7, 9, 1, 2]
    prop = drafter(ctx, None, long_chain=6, max_n=4).step(DraftTree(ctx[-1]), np.array([0]), 1)
    # The copy (a 4-token match, at least pin_match 2): 3 and its chain, pinned; "2" -> 7 (1 token) is not.
    assert [(par, tok) for (par, tok), pin in zip(entries(prop), prop.pinned) if pin] == [
        (0, 3), (1, 4), (2, 5), (3, 6), (4, 8), (5, 11), (6, 13)]
    assert (0, 7) in entries(prop) and prop.pinned.sum() == 7
    tree = DraftTree(ctx[-1])
    tree.graft(prop, 1)
    assert tree.prune(5)[0].token_list().tolist() == [2, 3, 4, 5, 6]  # the copy first, whatever the scores
    # No pins behind a match shorter than pin_match (the root's best match here is 4 tokens; after "... 13 8" only
    # "8" matches), without long chains, or with pinning off.
    for c, kw in ((ctx, {"pin_match": 5}), (ctx + [8], {}), (ctx, {"long_chain": 0}), (ctx, {"pin_match": 0})):
        d = drafter(c, None, **{"long_chain": 6, "max_n": 4, **kw})
        assert d.step(DraftTree(c[-1]), np.array([0]), 1).pinned is None
