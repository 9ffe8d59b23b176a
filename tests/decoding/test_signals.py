"""The 17 scheduler signals of hand-built trees equal values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treegraft_dist.decoding.signals import (
    MAX_LAYERS,
    NUM_SIGNALS,
    SIGNAL_NAMES,
    Timings,
    compute_signals,
    context_signals,
    prefix_signals,
    tree_signals,
)
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree, Proposal

ROOT_TOKEN = 7


def graft(tree: DraftTree, layer: int, parents, tokens, scores, origin, rescore=None) -> np.ndarray:
    return tree.graft(Proposal(tree.size, np.array(parents, np.int64), np.array(tokens, np.int64),
                               np.array(scores, np.float64), origin,
                               None if rescore is None else np.array(rescore, np.float64)), layer)


def after_ngram_step() -> DraftTree:
    """Layer 1 (n-gram): root -> 1 (tok 10, -0.5) -> 3 (tok 12, -0.7, chained); root -> 2 (tok 11, -1.0).

    id  depth layer score  children
    0   0     0      0.0   1, 2
    1   1     1     -0.5   3
    2   1     1     -1.0   -
    3   2     1     -0.7   -
    """
    tree = DraftTree(ROOT_TOKEN)
    # Entry 2 hangs under entry 0 (id base + 0 = 1): a chained match two levels deep in one step.
    ids = graft(tree, 1, [0, 0, 1], [10, 11, 12], [-0.5, -1.0, -0.7], ORIGIN_NGRAM)
    assert ids.tolist() == [1, 2, 3]
    return tree


def after_middle_step() -> DraftTree:
    """Layer 2 (middle) on the tree above: rescore, re-propose token 10 under the root (existing node 1
    keeps its id), add 4 (tok 13 under the root) and 5 (tok 14 under node 1).

    id  depth layer score  children  middle-expanded
    0   0     0      0.0   1, 2, 4   yes
    1   1     1     -0.2   3, 5      yes
    2   1     1     -1.5   -         no
    3   2     1     -0.9   -         no
    4   1     2     -2.0   -         no
    5   2     2     -0.4   -         no
    """
    tree = after_ngram_step()
    ids = graft(tree, 2, [0, 0, 1], [10, 13, 14], [-0.2, -2.0, -0.4], ORIGIN_MIDDLE,
                rescore=[0.0, -0.3, -1.5, -0.9])
    assert ids.tolist() == [1, 4, 5]
    return tree


def test_hand_trees_are_what_the_tables_say():
    tree = after_middle_step()
    n = tree.size
    assert n == 6
    assert tree.depths[:n].tolist() == [0, 1, 1, 2, 1, 2]
    assert tree.layers[:n].tolist() == [0, 1, 1, 1, 2, 2]
    assert tree.scores[:n].tolist() == [0.0, -0.2, -1.5, -0.9, -2.0, -0.4]
    middle_bit = 1 << ORIGIN_MIDDLE
    assert [(int(e) & middle_bit) != 0 for e in tree.expanded[:n]] == [True, True, False, False, False, False]


def test_context_signals():
    got = context_signals(20, Timings(t_tgt_ms=50.0, t_mid_ms=10.0))
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, [math.log(21), 50.0, 10.0, math.log(5)], rtol=1e-6)


@pytest.mark.parametrize("layer, calls, depth, expected", [
    (0, [], 5, [0.0, 0.0, 0, 0, 0, 0, 0]),
    (2, [True, False], 5, [0.4, 0.2, 1, 0, 0, 0, 0]),
    (4, [False, True, True, True], 5, [0.8, 0.6, 0, 1, 1, 1, 0]),
    (5, [True] * 5, 5, [1.0, 1.0, 1, 1, 1, 1, 1]),  # a terminal state (after the last layer)
    (1, [True], 2, [0.5, 0.5, 1, 0, 0, 0, 0]),  # shallower rounds still fill MAX_LAYERS bits
])
def test_prefix_signals(layer, calls, depth, expected):
    got = prefix_signals(layer, calls, depth)
    assert got.dtype == np.float32 and got.shape == (2 + MAX_LAYERS,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_tree_signals_of_the_root_alone():
    # Before layer 0: the frontier is the root; the middle drafter would re-select the root itself.
    got = tree_signals(DraftTree(ROOT_TOKEN), np.array([0]), 0, lookback=5, k=10)
    np.testing.assert_allclose(got, [0.0, 1.0, 0.0, 0.0, 1.0, 0.0])


@pytest.mark.parametrize("lookback, k, expected", [
    # Pool = all 4 nodes (none middle-expanded) ranked 0 (0.0), 1 (-0.5), 3 (-0.7), 2 (-1.0); top-2 =
    # {0, 1}: mean depth 0.5, so debt = 1.5 - 0.5; layers (0, 1) < 1 -> 1/2 earlier; no overlap with {2, 3}.
    (5, 2, [1.5, 0.5, 1.0, 0.5, 0.0, -0.25]),
    # top-3 = {0, 1, 3}: mean depth 1, debt 0.5; layers (0, 1, 1) -> 1/3 earlier; overlap {3} -> 1/3.
    (5, 3, [1.5, 0.5, 0.5, 1 / 3, 1 / 3, -1.2 / 3]),
    # Lookback 0 from the deepest frontier node (depth 2): pool = {3}; deeper than the frontier's mean,
    # so the debt is floored at 0.
    (0, 10, [1.5, 0.5, 0.0, 0.0, 1.0, -0.7]),
])
def test_tree_signals_after_an_ngram_step(lookback, k, expected):
    tree = after_ngram_step()
    frontier = np.array([3, 2])  # the chain ends, best first
    np.testing.assert_allclose(tree_signals(tree, frontier, 1, lookback, k), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lookback, k, expected", [
    # Leaves 2, 3, 4, 5 of 6 nodes. Pool (depth >= 2 - 1, not middle-expanded) = {2, 3, 4, 5}, ranked
    # 5 (-0.4), 3 (-0.9), 2 (-1.5), 4 (-2.0); top-3 = {5, 3, 2}: mean depth 5/3 > 1.5 -> debt 0;
    # layers (2, 1, 1) < 2 -> 2/3 earlier; overlap {5} -> 1/3; mean score -2.8/3.
    (1, 3, [1.5, 4 / 6, 0.0, 2 / 3, 1 / 3, -2.8 / 3]),
    # Lookback 0: pool = {3, 5}; top-1 = {5}: debt 0, layer 2 is the latest step, overlap 1.
    (0, 1, [1.5, 4 / 6, 0.0, 0.0, 1.0, -0.4]),
    # Lookback 2 reaches depth 0, but the root and node 1 are middle-expanded: same pool as lookback 1;
    # top-4 adds node 4 (depth 1, layer 2): mean depth 1.5 -> debt 0; earlier 2/4; overlap 1/4.
    (2, 4, [1.5, 4 / 6, 0.0, 0.5, 0.25, -4.8 / 4]),
])
def test_tree_signals_after_a_middle_step(lookback, k, expected):
    tree = after_middle_step()
    frontier = np.array([1, 5])  # the grafted middle children 1 (-0.2) and 5 (-0.4): top-2
    np.testing.assert_allclose(tree_signals(tree, frontier, 2, lookback, k), expected, rtol=1e-6, atol=1e-7)


def test_compute_signals_concatenates_the_three_groups_in_name_order():
    tree = after_middle_step()
    context = context_signals(20, Timings(50.0, 10.0))
    got = compute_signals(tree, np.array([1, 5]), 2, [False, True], 5, 1, 3, context)
    assert got.dtype == np.float32 and got.shape == (NUM_SIGNALS,)
    named = dict(zip(SIGNAL_NAMES, got.tolist()))
    expected = {"log_prompt_len": math.log(21), "t_tgt_ms": 50.0, "t_mid_ms": 10.0,
                "log_tgt_over_mid": math.log(5), "layer_frac": 0.4, "calls_frac": 0.2,
                "called_0": 0, "called_1": 1, "called_2": 0, "called_3": 0, "called_4": 0,
                "frontier_depth": 1.5, "leaf_ratio": 4 / 6, "collapse_debt": 0.0, "reselect_earlier": 2 / 3,
                "reselect_overlap": 1 / 3, "reselect_score": -2.8 / 3}
    assert list(named) == list(expected)
    for name, value in expected.items():
        assert named[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_compute_signals_refuses_more_layers_than_the_signals_describe():
    with pytest.raises(ValueError, match="at most 5 layers"):
        compute_signals(DraftTree(ROOT_TOKEN), np.array([0]), 0, [], 6, 5, 10, np.zeros(4, np.float32))
