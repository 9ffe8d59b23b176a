"""The neural middle drafter: a small causal LM with its own KV cache, called at some layers of a round.

A call runs the model (tree attention) over the nodes it needs and has not processed yet, plus the context
tokens its cache still lacks: the parents of nodes, to rescore them, and the selected nodes, to expand them
(with the parents in one forward when few leaves could be selected, else in a second one); then
  rescore   every node's score becomes the drafter's cumulative log-prob along its path;
  reselect  the frontier becomes the top-K by score of the expanded pool (nodes within `lookback`
            layers of the frontier depth that this drafter has not expanded yet);
  graft     each selected node proposes its top-K children (existing children keep their node).

Cache layout during a round: [context tokens | tree nodes in the order they were processed]. After the
round only the context plus the accepted path (as far as it was processed) stay.

Prompt window (beyond the paper, `window` > 0): the drafter reads only the prompt's last `window` tokens (its
positions count from the window's start). A long prompt (a document to summarise) costs the middle drafter a
read of its own before its first call, about a third of the target's prefill for the embedded pair, which its
guesses at the few tokens after the root rarely need; the n-gram drafter still matches the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.hf import CausalLM, cache_len, compact_cache
from .ngram import PrefillCache
from .tree import ORIGIN_MIDDLE, DraftTree, Proposal

NO_SLOT = -1
# Most unseen candidate leaves a call runs in the same forward as the unseen parents. A forward's fixed cost
# (reading the weights) is about what 50 more tokens cost on a 2-core CPU in bf16 (the 0.5B middle: ~105 ms,
# then ~2 ms a token), and far more on a GPU; the selected leaves alone are at most K tokens.
ONE_FORWARD_MAX_LEAVES = 32


@dataclass(frozen=True)
class DrafterState:
    """A point within a round of NeuralDrafter (see `snapshot`)."""

    cache_len: int
    committed: int
    slot: np.ndarray  # [tree size] int64
    row_of: np.ndarray  # [tree size] int64
    hidden_calls: int
    lse: torch.Tensor  # [processed] fp32
    topk_tokens: np.ndarray  # [processed, K] int64
    topk_logprobs: np.ndarray  # [processed, K] float64


class NeuralDrafter:
    origin = ORIGIN_MIDDLE
    alive = True  # in process: never gone (drafter.Drafter)
    fallback_steps = 0

    def __init__(self, lm: CausalLM, top_k: int = 10, lookback: int = 5, window: int = 0):
        if window < 0:
            raise ValueError(f"window must be >= 0 (0: the whole prompt), got {window}")
        self.lm = lm
        self.top_k = min(top_k, lm.vocab_size)
        self.lookback = lookback
        self.window = window
        self.start([], None)

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        self.context: list[int] = list(prompt[-self.window :] if self.window else prompt)
        # The prompt's own tokens outside the draft vocabulary are proposed too (names, identifiers to copy).
        self.extra_vocab = self.lm.outside_draft_vocab(prompt)  # [E] ascending ids, or None
        self.cache = self.lm.new_cache()
        self.committed = 0  # context tokens held in the cache
        self.forward_sizes: list[int] = []  # tokens of every forward so far (context catch-up + tree nodes)
        self._new_round()

    def _new_round(self) -> None:
        self.slot = np.zeros(0, np.int64)  # [tree size] cache position of each processed node
        self.hidden_rows: list[torch.Tensor] = []  # per call, [processed, hidden]
        self.row_of = np.zeros(0, np.int64)  # [tree size] row in cat(hidden_rows)
        self.lse = torch.zeros(0)  # [processed] logsumexp of each processed node's logits
        self.topk_tokens = np.zeros((0, self.top_k), np.int64)  # [processed, K]: each processed node's top-K
        self.topk_logprobs = np.zeros((0, self.top_k), np.float64)  # [processed, K]
        self._hidden = None

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        n = tree.size
        self._grow(n)
        unseen = self.slot[:n] == NO_SLOT
        # Rescoring needs the logits at every parent; expanding needs them at the selected nodes, known only
        # after rescoring. A leaf that cannot be selected is never run, so a call costs about the internal
        # nodes plus K tokens, not the whole tree (an n-gram layer can add hundreds of leaves).
        parents = np.flatnonzero(unseen & (tree.children_count() > 0))
        pool = tree.expanded_pool(frontier, self.lookback, ORIGIN_MIDDLE)
        leaves = np.setdiff1d(pool[unseen[pool]], parents)  # [m] the unseen leaves that may be selected
        if len(parents) and len(leaves) <= ONE_FORWARD_MAX_LEAVES:
            # All of them with the parents: one forward instead of a second one for the selected leaves.
            self.process(tree, np.union1d(parents, leaves))
        else:
            self.process(tree, parents)
        scores = self._rescore(tree)
        selected = tree.reselect(frontier, self.lookback, self.top_k, ORIGIN_MIDDLE, scores)
        self.process(tree, np.sort(selected[self.slot[selected] == NO_SLOT]))
        rows = self.row_of[selected]
        parents = np.repeat(selected, self.top_k)
        tokens = self.topk_tokens[rows].reshape(-1)
        child_scores = (scores[selected][:, None] + self.topk_logprobs[rows]).reshape(-1)
        return Proposal(tree.size, parents, tokens, child_scores, ORIGIN_MIDDLE, rescore=scores)

    def prefetch(self, root: int) -> None:
        """Process the context this drafter lags behind, plus the next round's root, now (a coordinator
        does it while the round's first n-gram steps run elsewhere); the next step only runs new nodes."""
        self._grow(1)
        if self.slot[0] == NO_SLOT:
            self.process(DraftTree(root), np.zeros(1, np.int64))

    def snapshot(self) -> "DrafterState":
        """This round's state so far, to come back to with `restore` (trajectory collection builds every
        schedule of a round from shared prefixes). Cheap: arrays are copied, the cache only measured."""
        return DrafterState(cache_len(self.cache), self.committed, self.slot.copy(), self.row_of.copy(),
                            len(self.hidden_rows), self.lse, self.topk_tokens, self.topk_logprobs)

    def restore(self, state: "DrafterState") -> None:
        """Return to a snapshot of this round: cache entries appended since are dropped."""
        compact_cache(self.cache, state.cache_len, torch.zeros(0, dtype=torch.int64))
        self.committed = state.committed
        self.slot, self.row_of = state.slot.copy(), state.row_of.copy()
        del self.hidden_rows[state.hidden_calls :]
        self.lse, self.topk_tokens, self.topk_logprobs = state.lse, state.topk_tokens, state.topk_logprobs
        self._hidden = None

    def accept(self, path: list[int], tokens: list[int]) -> None:
        """End of a round: `path` = accepted node ids (root first) of this round's tree, `tokens` = what
        the context grows by. Keeps the cache slots of the accepted path as far as it was processed."""
        if len(self.slot):
            keep = []
            for node in path:
                if node >= len(self.slot) or self.slot[node] == NO_SLOT:
                    break
                keep.append(int(self.slot[node]))
            compact_cache(self.cache, self.committed, torch.tensor(keep, dtype=torch.int64))
            self.committed += len(keep)
        self.context.extend(tokens)
        self._new_round()

    def release(self) -> None:
        """Nothing to free: the next `start` forgets this request (and replaces its cache)."""

    def _grow(self, n: int) -> None:
        if len(self.slot) < n:
            self.slot = np.concatenate([self.slot, np.full(n - len(self.slot), NO_SLOT, np.int64)])
            self.row_of = np.concatenate([self.row_of, np.full(n - len(self.row_of), NO_SLOT, np.int64)])

    def process(self, tree: DraftTree, unseen: np.ndarray) -> None:
        """Run the model over `unseen` nodes (ascending ids, ancestors already processed or included),
        after any context tokens the cache still lacks."""
        if len(unseen) == 0:
            return
        root_pos = len(self.context) - 1
        n = tree.size
        catch_up = self.context[self.committed : root_pos]
        past = cache_len(self.cache)
        if catch_up and past != self.committed:
            raise RuntimeError("middle drafter cache holds tree slots while it lags the context")
        m = len(catch_up) + len(unseen)
        self.forward_sizes.append(m)

        # Cache column of every node once this call has appended its inputs.
        col = self.slot[:n].copy()
        col[unseen] = past + len(catch_up) + np.arange(len(unseen))
        attend = np.zeros((m, past + m), bool)
        c = len(catch_up)
        attend[:c, : self.committed] = True
        attend[:c, past : past + c] = np.tril(np.ones((c, c), bool))
        attend[c:, : self.committed] = True
        attend[c:, past : past + c] = True
        anc = tree.ancestor_mask(unseen)  # [unseen, n]
        r, a = np.nonzero(anc)
        if (col[a] == NO_SLOT).any():
            raise RuntimeError("middle drafter asked to run a node before its ancestors")
        attend[c + r, col[a]] = True

        ids = torch.tensor(catch_up + tree.tokens[unseen].tolist(), dtype=torch.int64)
        positions = torch.from_numpy(
            np.concatenate([np.arange(self.committed, root_pos), root_pos + tree.depths[unseen]]))
        hidden = self.lm.hidden(self.cache, ids, positions, torch.from_numpy(attend))[c:]
        self.committed = root_pos

        lse, top_t, top_lp = self.lm.top_logprobs(hidden, self.top_k, extra=self.extra_vocab)
        first_row = sum(len(h) for h in self.hidden_rows)
        self.hidden_rows.append(hidden)
        self._hidden = None
        self.lse = torch.cat([self.lse.to(hidden.device), lse])
        self.topk_tokens = np.concatenate([self.topk_tokens, top_t])
        self.topk_logprobs = np.concatenate([self.topk_logprobs, top_lp])
        self.slot[unseen] = col[unseen]
        self.row_of[unseen] = first_row + np.arange(len(unseen))

    def _rescore(self, tree: DraftTree) -> np.ndarray:
        """[tree size] cumulative drafter log-probs along every path (root = 0)."""
        n = tree.size
        if n == 1:
            return np.zeros(1, np.float64)
        if self._hidden is None:
            self._hidden = torch.cat(self.hidden_rows)
        parent_rows = torch.from_numpy(self.row_of[tree.parents[1:n]])
        edge = (self.lm.token_logits(self._hidden[parent_rows], torch.from_numpy(tree.tokens[1:n].copy()))
                - self.lse[parent_rows.to(self.lse.device)]).double().cpu().numpy()
        # Over a draft vocabulary subset the normaliser misses the tokens outside it, so a token outside can
        # come out above 0: a log-prob is <= 0, and pruning relies on scores falling down a path.
        np.minimum(edge, 0.0, out=edge)
        scores = np.zeros(n, np.float64)
        for ids in tree.levels()[1:]:
            scores[ids] = scores[tree.parents[ids]] + edge[ids - 1]
        return scores
