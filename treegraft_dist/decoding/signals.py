"""The 17 numbers a scheduler reads before each drafting layer.

Layers are 0-based here: before layer l (l = 0 .. D-1), l drafting steps have run, and nodes added by
step j carry layer j + 1 in the tree (the root carries 0).

  context (4)      log1p(prompt length), T_tgt ms, T_mid ms, log(T_tgt / T_mid)
  call prefix (7)  l / D, calls so far / D, D bits: bit j = 1 iff layer j < l called the middle drafter
  tree state (6)   mean frontier depth; leaf ratio; collapse debt (drop of mean frontier depth if the
                   frontier were re-selected from the expanded pool, floored at 0); share of that
                   re-selected frontier added before the latest step; overlap |F & F'| / |F'| of the
                   current frontier F and the re-selected F'; mean score of F'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tree import ORIGIN_MIDDLE, DraftTree

NUM_SIGNALS = 17
MAX_LAYERS = 5

SIGNAL_NAMES = (
    ["log_prompt_len", "t_tgt_ms", "t_mid_ms", "log_tgt_over_mid", "layer_frac", "calls_frac"]
    + [f"called_{j}" for j in range(MAX_LAYERS)]
    + ["frontier_depth", "leaf_ratio", "collapse_debt", "reselect_earlier", "reselect_overlap",
       "reselect_score"]
)
assert len(SIGNAL_NAMES) == NUM_SIGNALS


@dataclass(frozen=True)
class Timings:
    """Measured forward times in milliseconds (warm-up), shared by every request of an engine."""

    t_tgt_ms: float
    t_mid_ms: float
    read_ms: float = 0.0  # the middle drafter's read of context, a token (a READ_BLOCK forward's share; 0: unknown)


READ_BLOCK = 64  # tokens of the forward that prices the middle drafter's read of context it has not seen


def context_signals(prompt_len: int, timings: Timings) -> np.ndarray:  # [4]
    return np.array([math.log1p(prompt_len), timings.t_tgt_ms, timings.t_mid_ms,
                     math.log(timings.t_tgt_ms / timings.t_mid_ms)], np.float32)


def prefix_signals(layer: int, calls: list[bool], depth: int) -> np.ndarray:  # [2 + MAX_LAYERS]
    bits = np.zeros(MAX_LAYERS, np.float32)
    bits[: len(calls)] = calls
    return np.concatenate([[layer / depth, sum(calls) / depth], bits]).astype(np.float32)


def tree_signals(tree: DraftTree, frontier: np.ndarray, layer: int, lookback: int, k: int) -> np.ndarray:  # [6]
    depths = tree.depths
    f_depth = float(depths[frontier].mean()) if len(frontier) else 0.0
    leaf_ratio = float(tree.is_leaf().mean())
    re = tree.reselect(frontier, lookback, k, ORIGIN_MIDDLE)
    if len(re) == 0:
        return np.array([f_depth, leaf_ratio, 0.0, 0.0, 0.0, 0.0], np.float32)
    debt = max(0.0, f_depth - float(depths[re].mean()))
    earlier = float((tree.layers[re] < layer).mean())
    overlap = len(np.intersect1d(re, frontier)) / len(re)
    return np.array([f_depth, leaf_ratio, debt, earlier, overlap, float(tree.scores[re].mean())], np.float32)


def compute_signals(
    tree: DraftTree, frontier: np.ndarray, layer: int, calls: list[bool], depth: int, lookback: int, k: int,
    context: np.ndarray,  # [4] from context_signals, fixed per request
) -> np.ndarray:  # [17] float32
    if depth > MAX_LAYERS:
        raise ValueError(f"the scheduler signals describe at most {MAX_LAYERS} layers, got depth {depth}")
    return np.concatenate([context, prefix_signals(layer, calls, depth),
                           tree_signals(tree, frontier, layer, lookback, k)])
