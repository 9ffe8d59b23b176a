"""The draft tree: the one structure that drafters, grafting, scheduler signals and verification share.

Vocabulary used throughout the package:
  root      the last accepted token (the previous round's bonus token); node 0, depth 0; the target
            has not seen it yet.
  node      a proposed token with a parent; ids are assigned in insertion order, so every parent id is
            smaller than its children's ids (id order is a topological order).
  frontier  the nodes the next drafting step expands: [<= K] int64 node ids (K = TreeConfig.top_k).
  score     cumulative log-probability along the root-to-node path, as last assigned by a drafter.

Nothing is ever deleted from a tree while it is being built: grafting a child that already exists under
its parent keeps that node (and its subtree) and only updates its score. Pruning for verification
returns a new, smaller tree plus the ids it kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_PARENT = -1

ORIGIN_ROOT = 0
ORIGIN_NGRAM = 1
ORIGIN_MIDDLE = 2
ORIGIN_NAMES = {ORIGIN_ROOT: "root", ORIGIN_NGRAM: "ngram", ORIGIN_MIDDLE: "middle"}

_INITIAL_CAPACITY = 128
_ARRAYS = ("tokens", "parents", "depths", "scores", "origins", "layers", "expanded", "pinned")


@dataclass
class Proposal:
    """Nodes a drafter wants grafted, as plain arrays (this is what crosses process boundaries).

    `parents[j]` is either an existing node id (< `base`) or `base + i` for an earlier entry i < j of the
    same proposal, so a drafter can propose whole chains. `rescore`, when set, replaces the scores of
    the first `base` nodes before anything is grafted. `pinned`, when set, marks the entries pruning keeps
    before any other node (a copied span, NGramDrafter.step; DraftTree.prune).
    """

    base: int
    parents: np.ndarray  # [n] int64
    tokens: np.ndarray  # [n] int64
    scores: np.ndarray  # [n] float64
    origin: int
    rescore: np.ndarray | None = None  # [base] float64
    pinned: np.ndarray | None = None  # [n] bool

    @classmethod
    def empty(cls, base: int, origin: int) -> "Proposal":
        return cls(base, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64), origin)

    def __len__(self) -> int:
        return len(self.tokens)


class DraftTree:
    """A growable token tree stored as parallel arrays (struct of arrays)."""

    def __init__(self, root_token: int, capacity: int = _INITIAL_CAPACITY):
        self.size = 0
        # Parallel [capacity] arrays, doubled when full; entries [:size] are the nodes.
        self.tokens = np.zeros(capacity, np.int64)
        self.parents = np.zeros(capacity, np.int64)
        self.depths = np.zeros(capacity, np.int64)
        self.scores = np.zeros(capacity, np.float64)
        self.origins = np.zeros(capacity, np.int8)
        self.layers = np.zeros(capacity, np.int8)
        # Bit (1 << origin) is set once a drafter of that origin has expanded the node.
        self.expanded = np.zeros(capacity, np.int8)
        # Kept by pruning before any node ranked by score: a copied span's chain (Proposal.pinned).
        self.pinned = np.zeros(capacity, bool)
        self._child: dict[tuple[int, int], int] = {}
        self._append(NO_PARENT, int(root_token), 0.0, ORIGIN_ROOT, 0)

    # -- construction ---------------------------------------------------------------------------------
    def _append(self, parent: int, token: int, score: float, origin: int, layer: int) -> int:
        if self.size == len(self.tokens):
            self._grow()
        i = self.size
        self.tokens[i] = token
        self.parents[i] = parent
        self.depths[i] = 0 if parent == NO_PARENT else self.depths[parent] + 1
        self.scores[i] = score
        self.origins[i] = origin
        self.layers[i] = layer
        self.expanded[i] = 0
        self.pinned[i] = False
        if parent != NO_PARENT:
            self._child[(parent, token)] = i
        self.size += 1
        return i

    def copy(self) -> "DraftTree":
        out = DraftTree.__new__(DraftTree)
        out.size = self.size
        for name in _ARRAYS:
            setattr(out, name, getattr(self, name).copy())
        out._child = dict(self._child)
        return out

    def _grow(self) -> None:
        for name in _ARRAYS:
            old = getattr(self, name)
            new = np.zeros(2 * len(old), old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def child(self, parent: int, token: int) -> int | None:
        return self._child.get((parent, token))

    def graft(self, proposal: Proposal, layer: int) -> np.ndarray:
        """Apply a proposal non-destructively; returns the node id of every proposal entry ([len(proposal)]).

        A proposed child whose token already exists under its parent keeps its node (and subtree) and
        takes the proposed score; otherwise a new node is appended.
        """
        if proposal.base != self.size:
            raise ValueError(f"proposal was made for a tree of {proposal.base} nodes, this one has {self.size}")
        if proposal.rescore is not None:
            self.scores[: self.size] = proposal.rescore
        ids = np.empty(len(proposal), np.int64)
        bit = np.int8(1 << proposal.origin)
        for j in range(len(proposal)):
            p = int(proposal.parents[j])
            parent = p if p < proposal.base else int(ids[p - proposal.base])
            tok = int(proposal.tokens[j])
            self.expanded[parent] |= bit
            existing = self._child.get((parent, tok))
            if existing is None:
                ids[j] = self._append(parent, tok, float(proposal.scores[j]), proposal.origin, layer)
            else:
                ids[j] = existing
                self.scores[existing] = proposal.scores[j]
        if proposal.pinned is not None:
            self.pinned[ids[proposal.pinned]] = True
        return ids

    # -- views ----------------------------------------------------------------------------------------
    def token_list(self) -> np.ndarray:  # [size] int64, a view
        return self.tokens[: self.size]

    def path(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        out = []
        while node != NO_PARENT:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def path_tokens(self, node: int, limit: int | None = None) -> list[int]:
        """Tokens on the root-to-node path (root included); only the last `limit` when given."""
        out = []
        while node != NO_PARENT and (limit is None or len(out) < limit):
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]

    def follow(self, tokens) -> list[int]:
        """Node ids of the longest root path whose tokens (after the root) are a prefix of `tokens`."""
        path, node = [], 0
        for t in tokens:
            node = self._child.get((node, int(t)))
            if node is None:
                break
            path.append(node)
        return path

    def children_count(self, origin: int | None = None) -> np.ndarray:
        """[size] number of children of each node (only those of `origin` when given)."""
        par = self.parents[1 : self.size]
        if origin is not None:
            par = par[self.origins[1 : self.size] == origin]
        return np.bincount(par, minlength=self.size)

    def is_leaf(self) -> np.ndarray:  # [size] bool
        return self.children_count() == 0

    def ancestor_mask(self, nodes: np.ndarray | None = None) -> np.ndarray:
        """[size, size] bool: entry (i, j) is True iff j is i or an ancestor of i; with `nodes` ([m] ids),
        only their rows ([m, size])."""
        node = np.arange(self.size) if nodes is None else np.asarray(nodes, np.int64)
        rows = np.arange(len(node))
        mask = np.zeros((len(node), self.size), bool)
        up = self._parents_of_root_as_root()
        # One step up every row's path at a time: depth + 1 steps reach the root from every node.
        for _ in range(int(self.depths[node].max(initial=0)) + 1):
            mask[rows, node] = True
            node = up[node]
        return mask

    def leaf_paths(self) -> np.ndarray:
        """[n_leaves, max_depth + 1] node ids of every root-to-leaf path, padded with NO_PARENT."""
        leaves = np.flatnonzero(self.is_leaf())
        depth = self.depths[leaves]
        out = np.full((len(leaves), int(self.depths[: self.size].max()) + 1), NO_PARENT, np.int64)
        rows = np.arange(len(leaves))
        up = self._parents_of_root_as_root()
        node = leaves
        # Fill every path from its leaf's column back to column 0 (the root), one step up at a time.
        for step in range(out.shape[1]):
            col = depth - step
            on = col >= 0
            out[rows[on], col[on]] = node[on]
            node = up[node]
        return out

    def levels(self) -> list[np.ndarray]:
        """Node ids by depth, ascending within each: [[0], depth-1 ids, depth-2 ids, ...]. Every node's
        parent lies in the level before its own, so a level can be computed from the previous one at once."""
        depth = self.depths[: self.size]
        order = np.argsort(depth, kind="stable")
        return np.split(order, np.cumsum(np.bincount(depth))[:-1])

    def _parents_of_root_as_root(self) -> np.ndarray:
        """[size] parent of every node, with the root its own parent: walking up stays at the root."""
        up = self.parents[: self.size].copy()
        up[0] = 0
        return up

    # -- selection ------------------------------------------------------------------------------------
    def ranked(self, ids: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
        """`ids` ([m]) ordered best first: higher score, then earlier insertion (stable). `scores` ([size]),
        when given, stand in for the tree's own."""
        s = self.scores if scores is None else scores
        ids = np.asarray(ids, np.int64)
        return ids[np.lexsort((ids, -s[ids]))]

    def expanded_pool(self, frontier: np.ndarray, lookback: int, origin: int) -> np.ndarray:
        """Candidates a neural step may expand ([m] ascending ids): nodes at most `lookback` layers shallower
        than the deepest frontier node (deeper nodes too) that the drafter of `origin` has not expanded yet."""
        depth = self.depths[: self.size]
        fd = int(depth[frontier].max()) if len(frontier) else int(depth.max())
        not_done = (self.expanded[: self.size] & (1 << origin)) == 0
        return np.flatnonzero((depth >= fd - lookback) & not_done)

    def reselect(self, frontier: np.ndarray, lookback: int, k: int, origin: int,
                 scores: np.ndarray | None = None) -> np.ndarray:
        """The top-k of the expanded pool by score ([<= k] ids): the frontier a neural step would expand."""
        return self.ranked(self.expanded_pool(frontier, lookback, origin), scores)[:k]

    def prune(self, budget: int) -> tuple["DraftTree", np.ndarray]:
        """Keep at most `budget` nodes (root included) by score, always with all their ancestors; pinned
        nodes (a copied span) first, shallowest first, then the others by score.

        Returns the pruned tree (ids renumbered, order preserved) and `kept`, the original id of each
        of its nodes ([pruned size] int64, ascending).
        """
        if budget < 1:
            raise ValueError(f"tree budget must be at least 1 (the root), got {budget}")
        ranked = self.ranked(np.arange(1, self.size))
        pins = np.flatnonzero(self.pinned[1 : self.size]) + 1  # ascending ids: every pin after its ancestors
        if len(pins):
            kept = np.flatnonzero(self._keep_greedy(np.concatenate([pins, ranked]), budget))
            return self.subtree(kept), kept
        keep = np.zeros(self.size, bool)
        keep[0] = True
        top = ranked[: budget - 1]
        keep[top] = True
        # When the best budget - 1 nodes hold all their ancestors, the greedy walk below keeps exactly
        # them; it is only needed when a node outranks one of its ancestors.
        if not keep[self.parents[top]].all():
            keep = self._keep_greedy(ranked, budget)
        kept = np.flatnonzero(keep)
        return self.subtree(kept), kept

    def pins_fill(self, budget: int) -> bool:
        """Whether pruning to `budget` keeps pinned nodes (with their ancestors) alone. Pins go first whatever
        the scores (prune), and only a round's first n-gram layer pins (ngram.py), so then nothing drafted
        later, nor any rescoring, changes which nodes the pruned tree holds (a budget of 1: the root alone)."""
        pins = np.flatnonzero(self.pinned[1 : self.size]) + 1
        return len(pins) >= budget - 1 and int(self._keep_greedy(pins, budget).sum()) >= budget

    def _keep_greedy(self, ranked: np.ndarray, budget: int) -> np.ndarray:
        """[size] bool: nodes taken in the order of `ranked`, each with its missing ancestors when all of
        them fit."""
        keep = np.zeros(self.size, bool)
        keep[0] = True
        count = 1
        for i in ranked:
            if count >= budget:
                break
            if keep[i]:
                continue
            missing = []
            j = int(i)
            while not keep[j]:
                missing.append(j)
                j = int(self.parents[j])
            if count + len(missing) <= budget:
                keep[missing] = True
                count += len(missing)
        return keep

    def subtree(self, kept: np.ndarray) -> "DraftTree":
        """A new tree of the nodes `kept` ([m] ascending ids, closed under ancestors, root first)."""
        m = len(kept)
        remap = np.full(self.size, NO_PARENT, np.int64)
        remap[kept] = np.arange(m)
        out = DraftTree(int(self.tokens[0]), capacity=max(m, 1))
        for name in _ARRAYS:
            if name != "parents":  # renumbered below
                getattr(out, name)[:m] = getattr(self, name)[kept]
        out.parents[1:m] = remap[self.parents[kept[1:]]]
        out.size = m
        out._child = dict(zip(zip(out.parents[1:m].tolist(), out.tokens[1:m].tolist()), range(1, m)))
        return out

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"DraftTree(size={self.size}, max_depth={int(self.depths[: self.size].max())})"


def next_frontier(tree: DraftTree, proposal: Proposal, ids: np.ndarray, k: int) -> np.ndarray:
    """The top-k ([<= k] ids) of the grafted nodes `ids` (graft's [len(proposal)] result) that end a proposed
    chain (no proposed entry hangs below them)."""
    hung = ids[proposal.parents[proposal.parents >= proposal.base] - proposal.base]
    return tree.ranked(np.setdiff1d(ids, hung))[:k]
