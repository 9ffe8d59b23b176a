"""The draft tree: grafting never deletes a node, pruning keeps the best ancestor-closed set, and the
derived views (mask, paths, ranking, candidate pool, next frontier) match brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treegraft_dist.decoding.tree import (
    NO_PARENT,
    ORIGIN_MIDDLE,
    ORIGIN_NGRAM,
    ORIGIN_ROOT,
    DraftTree,
    Proposal,
    next_frontier,
)

SMALL_VOCAB = 4  # few tokens, so proposals often name a child that already exists
FAST = settings(max_examples=150, deadline=None)


def proposal(base, parents, tokens, scores=None, origin=ORIGIN_NGRAM, rescore=None) -> Proposal:
    n = len(tokens)
    scores = -np.arange(1, n + 1, dtype=np.float64) if scores is None else np.asarray(scores, np.float64)
    return Proposal(base, np.asarray(parents, np.int64).reshape(n), np.asarray(tokens, np.int64).reshape(n),
                    scores, origin, None if rescore is None else np.asarray(rescore, np.float64))


def random_tree(n: int, seed: int, decreasing: bool = True) -> DraftTree:
    """A tree of n nodes (root included) with random shape; sibling tokens are unique by construction.

    decreasing: every child scores strictly below its parent (root scores 0)."""
    rng = np.random.default_rng(seed)
    tree = DraftTree(7)
    if n == 1:
        return tree
    # Entry j hangs under the root (0) or under entry v - 1 (v >= 1), whose id is base + v - 1 = v.
    parents = np.array([rng.integers(0, j + 1) for j in range(n - 1)], np.int64)
    scores = np.round(rng.normal(size=n - 1) * 2, 1)
    if decreasing:
        for j in range(n - 1):
            parent_score = 0.0 if parents[j] == 0 else scores[parents[j] - 1]
            # Coarse steps so equal scores (ties broken by id) happen between unrelated nodes.
            scores[j] = parent_score - rng.integers(1, 4) * 0.5
    tree.graft(proposal(1, parents, np.arange(100, 100 + n - 1), scores), 1)
    assert tree.size == n
    return tree


def brute_ancestors(tree: DraftTree, i: int) -> set[int]:
    out = set()
    while i != NO_PARENT:
        out.add(i)
        i = int(tree.parents[i])
    return out


# -- grafting -----------------------------------------------------------------------------------------

class ReferenceTree:
    """A dictionary model of grafting: what DraftTree.graft must do, written as plainly as possible."""

    def __init__(self, root_token: int):
        self.nodes = [dict(token=root_token, parent=NO_PARENT, depth=0, score=0.0, origin=ORIGIN_ROOT, layer=0)]
        self.child: dict[tuple[int, int], int] = {}

    def graft(self, prop: Proposal, layer: int) -> list[int]:
        if prop.rescore is not None:
            for i, s in enumerate(prop.rescore):
                self.nodes[i]["score"] = float(s)
        ids = []
        for j in range(len(prop)):
            p = int(prop.parents[j])
            parent = p if p < prop.base else ids[p - prop.base]
            key = (parent, int(prop.tokens[j]))
            if key in self.child:
                ids.append(self.child[key])
                self.nodes[ids[-1]]["score"] = float(prop.scores[j])
            else:
                self.child[key] = len(self.nodes)
                ids.append(len(self.nodes))
                self.nodes.append(dict(token=key[1], parent=parent, depth=self.nodes[parent]["depth"] + 1,
                                       score=float(prop.scores[j]), origin=prop.origin, layer=layer))
        return ids


@st.composite
def graft_rounds(draw):
    """Per graft: (parent choices, tokens, scores, origin, with_rescore, rescore seed). A parent choice
    c < 0 names entry -c - 1 of the same proposal (parent base - c - 1); c >= 0 names node c % base."""
    rounds = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 8))
        choices = []
        for j in range(n):
            if j and draw(st.booleans()):
                choices.append(-draw(st.integers(0, j - 1)) - 1)  # an earlier entry of this proposal
            else:
                choices.append(draw(st.integers(0, 10_000)))  # an existing node (reduced modulo size)
        tokens = draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=n, max_size=n))
        scores = draw(st.lists(st.floats(-20, 0, allow_nan=False), min_size=n, max_size=n))
        origin = draw(st.sampled_from([ORIGIN_NGRAM, ORIGIN_MIDDLE]))
        rescore = draw(st.booleans())
        rounds.append((choices, tokens, scores, origin, rescore, draw(st.integers(0, 2**31))))
    return rounds


@FAST
@given(graft_rounds())
def test_graft_never_removes_a_node(rounds):
    tree, ref = DraftTree(3), ReferenceTree(3)
    for layer, (choices, tokens, scores, origin, with_rescore, seed) in enumerate(rounds, start=1):
        base = tree.size
        parents = [base + (-c - 1) if c < 0 else c % base for c in choices]
        rescore = np.random.default_rng(seed).normal(size=base) if with_rescore else None
        prop = proposal(base, parents, tokens, scores, origin, rescore)

        before = {name: getattr(tree, name)[:base].copy()
                  for name in ("tokens", "parents", "depths", "origins", "layers", "scores", "expanded")}
        existing = {(int(tree.parents[i]), int(tree.tokens[i])): i for i in range(1, base)}

        ids = tree.graft(prop, layer)
        want_ids = ref.graft(prop, layer)
        np.testing.assert_array_equal(ids, want_ids)

        # Every node that existed keeps its token, parent, depth, origin and layer.
        for name in ("tokens", "parents", "depths", "origins", "layers"):
            np.testing.assert_array_equal(getattr(tree, name)[:base], before[name], err_msg=name)

        # Resolve each entry's parent the way the proposal means it.
        resolved = []
        for j, p in enumerate(parents):
            resolved.append(p if p < base else int(ids[p - base]))
        pairs = [(resolved[j], int(tokens[j])) for j in range(len(tokens))]
        new_pairs = {pair for pair in pairs if pair not in existing}
        assert tree.size == base + len(new_pairs)

        # A child that already existed keeps its id and takes the (last) proposed score.
        last_score = {}
        for j, pair in enumerate(pairs):
            last_score[pair] = scores[j]
            if pair in existing:
                assert ids[j] == existing[pair]
        for pair, s in last_score.items():
            assert tree.scores[tree.child(*pair)] == s
        # Old nodes nobody proposed keep their score, or take the rescore.
        touched = {tree.child(*pair) for pair in pairs}
        for i in range(base):
            if i not in touched:
                assert tree.scores[i] == (rescore[i] if with_rescore else before["scores"][i])

        # New nodes: right parent, token, depth, origin and layer.
        for j, pair in enumerate(pairs):
            i = int(ids[j])
            assert (int(tree.parents[i]), int(tree.tokens[i])) == pair
            assert tree.depths[i] == tree.depths[pair[0]] + 1
            if i >= base:
                assert tree.origins[i] == origin and tree.layers[i] == layer

        # Siblings always carry distinct tokens; the child lookup agrees with the arrays.
        n = tree.size
        sib = set(zip(tree.parents[1:n].tolist(), tree.tokens[1:n].tolist()))
        assert len(sib) == n - 1
        for i in range(1, n):
            assert tree.child(int(tree.parents[i]), int(tree.tokens[i])) == i

        # The drafter's bit is set on every parent it proposed under, and only bits are ever added.
        bit = 1 << origin
        for parent in set(resolved):
            assert tree.expanded[parent] & bit
        assert np.all((tree.expanded[:base] & before["expanded"]) == before["expanded"])
        for i in set(range(n)) - set(resolved):
            if i < base:
                assert tree.expanded[i] == before["expanded"][i]
            else:
                assert tree.expanded[i] == 0

        # The full reference model agrees node for node.
        assert n == len(ref.nodes)
        for i, node in enumerate(ref.nodes):
            assert (int(tree.tokens[i]), int(tree.parents[i]), int(tree.depths[i]), float(tree.scores[i]),
                    int(tree.origins[i]), int(tree.layers[i])) == (
                node["token"], node["parent"], node["depth"], node["score"], node["origin"], node["layer"])


def test_graft_grows_past_initial_capacity():
    tree = DraftTree(0, capacity=2)
    n = 300
    chain = np.concatenate([[0], 1 + np.arange(n - 1)])
    ids = tree.graft(proposal(1, chain, np.arange(n) % 5), 1)
    np.testing.assert_array_equal(ids, 1 + np.arange(n))
    np.testing.assert_array_equal(tree.depths[: tree.size], np.arange(n + 1))


def test_chain_parents_resolve_to_the_right_nodes():
    tree = DraftTree(9)
    # root -> 5 -> 6 -> 7, and root -> 8 -> 1
    ids = tree.graft(proposal(1, [0, 1, 2, 0, 4], [5, 6, 7, 8, 1]), 1)
    np.testing.assert_array_equal(ids, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tree.parents[:6], [NO_PARENT, 0, 1, 2, 0, 4])
    np.testing.assert_array_equal(tree.depths[:6], [0, 1, 2, 3, 1, 2])
    assert tree.path(3) == [0, 1, 2, 3]
    assert tree.path_tokens(3) == [9, 5, 6, 7]

    # A chain whose head already exists: the chain continues below the existing node.
    ids = tree.graft(proposal(6, [0, 6, 7, 1], [5, 6, 2, 3], origin=ORIGIN_MIDDLE), 2)
    np.testing.assert_array_equal(ids, [1, 2, 6, 7])
    assert tree.size == 8
    assert tree.parents[6] == 2 and tree.tokens[6] == 2 and tree.depths[6] == 3
    assert tree.parents[7] == 1 and tree.tokens[7] == 3 and tree.origins[7] == ORIGIN_MIDDLE
    assert tree.origins[1] == ORIGIN_NGRAM  # an existing node keeps its origin


def test_graft_refuses_a_proposal_for_another_tree_size():
    tree = DraftTree(0)
    tree.graft(proposal(1, [0, 0], [1, 2]), 1)
    for base in (1, 2, 4):
        with pytest.raises(ValueError, match="this one has 3"):
            tree.graft(proposal(base, [0], [3]), 2)
    assert tree.size == 3
    with pytest.raises(ValueError):
        tree.graft(Proposal.empty(0, ORIGIN_NGRAM), 2)
    np.testing.assert_array_equal(tree.graft(Proposal.empty(3, ORIGIN_NGRAM), 2), np.zeros(0))


# -- pruning ------------------------------------------------------------------------------------------

def _check_pruned(tree: DraftTree, budget: int):
    pruned, kept = tree.prune(budget)
    assert pruned.size == len(kept) <= budget
    assert kept[0] == 0
    assert np.all(np.diff(kept) > 0)
    keep = set(kept.tolist())
    for i in kept:
        assert brute_ancestors(tree, int(i)) <= keep
    for new, old in enumerate(kept):
        assert pruned.tokens[new] == tree.tokens[old]
        assert pruned.depths[new] == tree.depths[old]
        assert pruned.scores[new] == tree.scores[old]
        assert pruned.origins[new] == tree.origins[old]
        assert pruned.layers[new] == tree.layers[old]
        assert pruned.expanded[new] == tree.expanded[old]
        parent = int(pruned.parents[new])
        assert (kept[parent] if parent != NO_PARENT else NO_PARENT) == tree.parents[old]
        if new:
            assert pruned.child(parent, int(pruned.tokens[new])) == new
    return pruned, kept


@FAST
@given(st.integers(1, 80), st.integers(1, 90), st.integers(0, 2**31))
def test_prune_keeps_the_top_nodes_when_scores_fall_along_paths(n, budget, seed):
    tree = random_tree(n, seed, decreasing=True)
    _, kept = _check_pruned(tree, budget)
    # Reference: root plus the best (budget - 1) other nodes, score descending, then id ascending.
    others = sorted(range(1, n), key=lambda i: (-tree.scores[i], i))
    want = sorted([0] + others[: budget - 1])
    assert kept.tolist() == want
    assert len(kept) == min(budget, n)


@FAST
@given(st.integers(1, 80), st.integers(1, 90), st.integers(0, 2**31))
def test_prune_is_ancestor_closed_with_any_scores(n, budget, seed):
    tree = random_tree(n, seed, decreasing=False)
    _, kept = _check_pruned(tree, budget)
    if budget >= n:
        assert len(kept) == n
    # The best node that fits (with its ancestors) is always kept.
    best = int(tree.ranked(np.arange(1, n))[0]) if n > 1 else 0
    if len(brute_ancestors(tree, best)) <= budget:
        assert best in set(kept.tolist())


def test_prune_hand_built():
    tree = DraftTree(0)
    # root -> a(-1) -> b(-5); root -> c(-2) -> d(-0.5, better than its parent); root -> e(-3)
    tree.graft(proposal(1, [0, 1, 0, 3, 0], [1, 2, 3, 4, 5], [-1, -5, -2, -0.5, -3]), 1)
    assert tree.prune(1)[1].tolist() == [0]
    assert tree.prune(2)[1].tolist() == [0, 1]  # d needs c too: does not fit; a does
    assert tree.prune(3)[1].tolist() == [0, 3, 4]  # d with its parent c
    assert tree.prune(4)[1].tolist() == [0, 1, 3, 4]
    assert tree.prune(5)[1].tolist() == [0, 1, 3, 4, 5]
    assert tree.prune(6)[1].tolist() == [0, 1, 2, 3, 4, 5]
    pruned, kept = tree.prune(3)
    assert pruned.path_tokens(2) == [0, 3, 4]


@pytest.mark.parametrize("budget", [0, -1])
def test_prune_rejects_a_budget_below_one(budget):
    tree = random_tree(5, 0)
    with pytest.raises(ValueError, match="budget"):
        tree.prune(budget)


# -- derived views ------------------------------------------------------------------------------------

@FAST
@given(st.integers(1, 60), st.integers(0, 2**31))
def test_ancestor_mask_matches_a_parent_walk(n, seed):
    tree = random_tree(n, seed)
    mask = tree.ancestor_mask()
    assert mask.shape == (n, n) and mask.dtype == bool
    for i in range(n):
        want = np.zeros(n, bool)
        want[list(brute_ancestors(tree, i))] = True
        np.testing.assert_array_equal(mask[i], want)
    # Rows of chosen nodes only, in the order given.
    nodes = np.random.default_rng(seed).permutation(n)[: (n + 1) // 2]
    np.testing.assert_array_equal(tree.ancestor_mask(nodes), mask[nodes])
    assert tree.ancestor_mask(np.zeros(0, np.int64)).shape == (0, n)


@FAST
@given(st.integers(1, 60), st.integers(0, 2**31))
def test_levels_group_ids_by_depth(n, seed):
    tree = random_tree(n, seed)
    levels = tree.levels()
    assert len(levels) == int(tree.depths[:n].max()) + 1
    for d, ids in enumerate(levels):
        assert ids.tolist() == [i for i in range(n) if tree.depths[i] == d]


@FAST
@given(st.integers(1, 60), st.integers(0, 2**31))
def test_leaf_paths_are_root_to_leaf_paths_covering_every_leaf(n, seed):
    tree = random_tree(n, seed)
    paths = tree.leaf_paths()
    has_child = set(tree.parents[1:n].tolist())
    leaves = [i for i in range(n) if i not in has_child]
    assert paths.shape == (len(leaves), int(tree.depths[:n].max()) + 1)
    ends = []
    for row in paths:
        ids = row[row != NO_PARENT]
        assert np.all(row[len(ids):] == NO_PARENT)  # padding only at the end
        assert ids[0] == 0
        for a, b in zip(ids[:-1], ids[1:]):
            assert tree.parents[b] == a
        ends.append(int(ids[-1]))
    assert sorted(ends) == leaves


def test_path_and_path_tokens():
    tree = DraftTree(10)
    tree.graft(proposal(1, [0, 1, 2, 3, 0], [11, 12, 13, 14, 15]), 1)
    assert tree.path(0) == [0]
    assert tree.path(4) == [0, 1, 2, 3, 4]
    assert tree.path(5) == [0, 5]
    assert tree.path_tokens(0) == [10]
    assert tree.path_tokens(4) == [10, 11, 12, 13, 14]
    assert tree.path_tokens(4, limit=2) == [13, 14]
    assert tree.path_tokens(4, limit=5) == [10, 11, 12, 13, 14]
    assert tree.path_tokens(4, limit=9) == [10, 11, 12, 13, 14]
    assert tree.path_tokens(5, limit=1) == [15]


@FAST
@given(st.lists(st.sampled_from([0.0, -1.0, -2.5, -3.0]), min_size=1, max_size=30), st.integers(0, 2**31))
def test_ranked_is_score_descending_then_id_ascending(scores, seed):
    n = len(scores) + 1
    tree = DraftTree(0)
    tree.graft(proposal(1, np.zeros(n - 1), np.arange(1, n), scores), 1)
    want = sorted(range(n), key=lambda i: (-tree.scores[i], i))
    assert tree.ranked(np.arange(n)).tolist() == want
    subset = np.flatnonzero(np.random.default_rng(seed).random(n) < 0.5)
    assert tree.ranked(subset).tolist() == [i for i in want if i in set(subset.tolist())]
    # External scores override the tree's.
    ext = -tree.scores[:n]
    assert tree.ranked(np.arange(n), ext).tolist() == sorted(range(n), key=lambda i: (-ext[i], i))


def test_ranked_breaks_ties_by_id_whatever_order_the_ids_come_in():
    tree = DraftTree(0)
    tree.graft(proposal(1, [0, 0, 0], [1, 2, 3], [-1.0, -1.0, -2.0]), 1)
    # Nodes 1 and 2 tie; the docstring promises earlier insertion (lower id) first.
    assert tree.ranked(np.array([3, 2, 1, 0])).tolist() == [0, 1, 2, 3]


def _window_tree() -> DraftTree:
    """root(0) - a chain 1..6 at depths 1..6, plus side nodes 7 (depth 1), 8 (depth 3), 9 (depth 5)."""
    tree = DraftTree(0)
    chain = [0, 1, 2, 3, 4, 5]
    scores = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    tree.graft(proposal(1, chain, [1, 1, 1, 1, 1, 1], scores), 1)
    tree.graft(proposal(7, [0, 2, 4], [2, 2, 2], [-0.5, -2.5, -4.5], origin=ORIGIN_MIDDLE), 2)
    return tree


def test_expanded_pool_depth_window_and_origin():
    tree = _window_tree()
    np.testing.assert_array_equal(tree.depths[:10], [0, 1, 2, 3, 4, 5, 6, 1, 3, 5])
    # Expanded by ngram: 0..5 (chain parents); by middle: 0, 2, 4.
    frontier = np.array([5, 9])  # deepest frontier depth 5
    np.testing.assert_array_equal(tree.expanded_pool(frontier, 2, ORIGIN_MIDDLE), [3, 5, 6, 8, 9])
    np.testing.assert_array_equal(tree.expanded_pool(frontier, 2, ORIGIN_NGRAM), [6, 8, 9])
    np.testing.assert_array_equal(tree.expanded_pool(frontier, 0, ORIGIN_MIDDLE), [5, 6, 9])
    np.testing.assert_array_equal(tree.expanded_pool(frontier, 5, ORIGIN_MIDDLE), [1, 3, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(tree.expanded_pool(np.array([7]), 1, ORIGIN_MIDDLE), [1, 3, 5, 6, 7, 8, 9])
    # An empty frontier measures the window from the deepest node.
    np.testing.assert_array_equal(tree.expanded_pool(np.zeros(0, np.int64), 1, ORIGIN_MIDDLE), [5, 6, 9])


def test_reselect_is_top_k_of_the_pool_by_score():
    tree = _window_tree()
    frontier = np.array([5, 9])
    # pool for middle, lookback 2: 3(-3) 5(-5) 6(-6) 8(-2.5) 9(-4.5)
    np.testing.assert_array_equal(tree.reselect(frontier, 2, 3, ORIGIN_MIDDLE), [8, 3, 9])
    np.testing.assert_array_equal(tree.reselect(frontier, 2, 10, ORIGIN_MIDDLE), [8, 3, 9, 5, 6])
    ext = np.zeros(10)
    ext[[6, 5]] = [1.0, 0.5]
    np.testing.assert_array_equal(tree.reselect(frontier, 2, 3, ORIGIN_MIDDLE, ext), [6, 5, 3])


# -- the next frontier --------------------------------------------------------------------------------

def test_next_frontier_excludes_entries_with_a_chain_child():
    tree = DraftTree(0)
    tree.graft(proposal(1, [0, 0], [1, 2], [-1.0, -1.5]), 1)
    # Entries: 0:(1->5) 1:(chain ->6) 2:(chain ->7) 3:(2->5) 4:(root->3) 5:(root->1, exists: id 1)
    prop = proposal(3, [1, 3, 4, 2, 0, 0], [5, 6, 7, 5, 3, 1], [-2.0, -2.2, -9.0, -1.6, -0.1, -0.9])
    ids = tree.graft(prop, 2)
    np.testing.assert_array_equal(ids, [3, 4, 5, 6, 7, 1])
    # Chain ends: 5 (-9), 6 (-1.6), 7 (-0.1), 1 (-0.9); 3 and 4 have a chain child.
    np.testing.assert_array_equal(next_frontier(tree, prop, ids, 10), [7, 1, 6, 5])
    np.testing.assert_array_equal(next_frontier(tree, prop, ids, 2), [7, 1])


def test_next_frontier_excludes_a_node_that_gets_a_chain_child_from_a_duplicate_entry():
    tree = DraftTree(0)
    tree.graft(proposal(1, [0], [1], [-1.0]), 1)
    # Entry 0 and entry 1 name the same node (root -> 2); only entry 1 carries a chain below it.
    prop = proposal(2, [0, 0, 3], [2, 2, 4], [-1.0, -1.0, -2.0])
    ids = tree.graft(prop, 2)
    np.testing.assert_array_equal(ids, [2, 2, 3])
    # Node 2 has a proposed child hanging below it, so it does not end a chain.
    np.testing.assert_array_equal(next_frontier(tree, prop, ids, 10), [3])


@FAST
@given(st.integers(2, 30), st.integers(0, 30), st.integers(1, 12), st.integers(0, 2**31))
def test_next_frontier_matches_a_reference(n, m, k, seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(n, seed)
    base = tree.size
    parents = [int(rng.integers(0, base)) if j == 0 or rng.random() < 0.5 else base + int(rng.integers(0, j))
               for j in range(m)]
    # Tokens of the random tree are 100.. so some entries land on existing nodes; two entries naming the
    # same node are left to the hand-made test above, so redraw the tokens until there are none.
    for _ in range(200):
        tokens = rng.integers(100, 100 + n, size=m)
        prop = proposal(base, parents, tokens, rng.integers(-8, 0, size=m) * 0.5)
        ids = tree.subtree(np.arange(base)).graft(prop, 2)
        if len(set(ids.tolist())) == m:
            break
    else:
        return
    ids = tree.graft(prop, 2)
    # Reference: a grafted node is a chain end iff no entry of the proposal hangs below it.
    hung = {int(ids[p - base]) for p in parents if p >= base}
    ends = sorted({int(i) for i in ids} - hung)
    want = sorted(ends, key=lambda i: (-tree.scores[i], i))[:k]
    assert next_frontier(tree, prop, ids, k).tolist() == want


@FAST
@given(st.integers(2, 60), st.integers(1, 70), st.integers(0, 2**31), st.integers(0, 2**31))
def test_prune_keeps_pinned_nodes_first_shallowest_first_then_the_rest_by_score(n, budget, seed, pick):
    tree = random_tree(n, seed, decreasing=False)
    chain = brute_ancestors(tree, 1 + pick % (n - 1))  # a root-to-node path: what a copy's chain pins
    pins = sorted(set(chain) - {0})
    tree.pinned[pins] = True
    pruned, kept = _check_pruned(tree, budget)
    assert pruned.pinned.tolist() == tree.pinned[kept].tolist()
    # The pinned path's shallowest budget - 1 nodes, then the others greedily by score, each with its ancestors.
    want = np.zeros(n, bool)
    want[0] = True
    want[pins[: budget - 1]] = True
    for i in tree.ranked(np.arange(1, n)):
        missing = [j for j in brute_ancestors(tree, int(i)) if not want[j]]
        if want.sum() < budget and want.sum() + len(missing) <= budget:
            want[missing] = True
    assert kept.tolist() == np.flatnonzero(want).tolist()
    # The pins fill the budget exactly when pruning keeps nothing else; then a node drafted later, however it
    # scores, changes nothing.
    fills = tree.pins_fill(budget)
    assert fills == (want.sum() == budget and set(np.flatnonzero(want)) <= set(chain))
    if fills:
        tree.graft(Proposal(tree.size, np.array([0]), np.array([99]), np.array([5.0]), ORIGIN_MIDDLE), 9)
        assert tree.prune(budget)[1].tolist() == kept.tolist()


def test_a_grafted_proposal_pins_its_marked_entries_and_an_existing_node_it_meets():
    tree = DraftTree(7)
    tree.graft(Proposal(1, np.array([0, 0]), np.array([3, 5]), np.array([-0.1, -0.2]), ORIGIN_MIDDLE), 1)
    ids = tree.graft(Proposal(3, np.array([0, 3, 1]), np.array([3, 4, 9]), np.array([-0.3, -0.4, -9.0]),
                              ORIGIN_NGRAM, pinned=np.array([True, True, False])), 2)
    assert ids.tolist() == [1, 3, 4]
    assert tree.pinned[: tree.size].tolist() == [False, True, False, True, False]
    # Budget 3 keeps the pinned path 7 -> 3 -> 4 though 5 outscores 4.
    assert tree.prune(3)[1].tolist() == [0, 1, 3]
    assert tree.copy().pinned[: tree.size].tolist() == tree.pinned[: tree.size].tolist()
