"""The training-free small drafter: n-gram matching against the context, scored by the target's prefill.

For a frontier node, the suffix of (context + path to the node) is looked up in an index of every
n-gram (n = max_n .. 1) that occurred earlier in the context; each occurrence proposes the token that
followed it. Children rank by longer match first, then more recent occurrence, then score; a child may
carry the chain of tokens that followed its occurrence (several depths in one step); only the best
match of each parent does.

Long chains (an extension beyond the published settings, `long_chain` > 0): at the first layer the
root's best match carries up to `long_chain` tokens of what followed it, past the depth the layers
would reach. Where text repeats (code edits, summaries quoting their source) a round can then accept
a whole copied span, as prompt lookup decoding does; a chain is cheap to verify, and pruning by score
drops it where the target's prefill log-probs say the copy is unlikely to continue.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .tree import ORIGIN_NGRAM, DraftTree, Proposal

# Penalty (in nats) below the lowest cached log-prob for a token outside the cached top-k.
OUTSIDE_TOPK_PENALTY = 5.0


@dataclass
class PrefillCache:
    """The target's top-k next-token log-probs at every prompt position, stored during prefill.

    Row i is the distribution of the token at position i + 1 given tokens 0..i.
    """

    tokens: np.ndarray  # [prompt_len, k] int64
    logprobs: np.ndarray  # [prompt_len, k] float64

    def __post_init__(self):
        self.floor = float(self.logprobs.min()) - OUTSIDE_TOPK_PENALTY if self.logprobs.size else 0.0
        # Nested lists, each made by one C-level conversion: searching a row's k distinct tokens in a list
        # is about as fast as a dict lookup, and building per-position dicts cost ~10x more.
        self._tokens = self.tokens.tolist()
        self._logprobs = self.logprobs.tolist()

    def logprob(self, position: int, token: int) -> float:
        """Target log-prob of `token` at context `position`; 0 beyond the prompt (nothing cached)."""
        row = position - 1
        if row < 0 or row >= len(self._tokens):
            return 0.0
        tokens = self._tokens[row]
        return self._logprobs[row][tokens.index(token)] if token in tokens else self.floor


class NGramIndex:
    """Every n-gram (1 <= n <= max_n) of a token sequence mapped to the positions that followed it."""

    def __init__(self, max_n: int = 5):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._follow: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._counts: dict[int, int] = defaultdict(int)
        self._most_frequent = -1

    def extend(self, new_tokens) -> None:
        toks = self.tokens
        for t in new_tokens:
            t = int(t)
            p = len(toks)
            # Index the n-grams that end right before position p, now that their follower is known.
            for n in range(1, min(self.max_n, p) + 1):
                self._follow[tuple(toks[p - n : p])].append(p)
            toks.append(t)
            c = self._counts[t] + 1
            self._counts[t] = c
            if self._most_frequent < 0 or c > self._counts[self._most_frequent]:
                self._most_frequent = t

    @property
    def most_frequent(self) -> int:
        return self._most_frequent

    def matches(self, suffix: list[int], k: int) -> list[tuple[int, int]]:
        """Up to k (match length, position) pairs with distinct followed tokens, best first.

        Longer matches first; within one length, the most recent occurrence first. `position` is the
        index in the context of the proposed token.
        """
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        toks = self.tokens
        for n in range(min(self.max_n, len(suffix)), 0, -1):
            positions = self._follow.get(tuple(suffix[-n:]))
            if not positions:
                continue
            for p in reversed(positions):
                t = toks[p]
                if t not in seen:
                    seen.add(t)
                    out.append((n, p))
                    if len(out) == k:
                        return out
        return out


class NGramDrafter:
    """Small drafter: proposes children of frontier nodes from context n-gram matches.

    `chain` is how many further tokens of the best match are added below its child.
    """

    origin = ORIGIN_NGRAM

    def __init__(self, top_k: int = 10, max_n: int = 5, chain: int = 4, depth: int = 5, long_chain: int = 0):
        self.top_k = top_k
        self.max_n = max_n
        self.chain = chain
        self.depth = depth
        self.long_chain = long_chain
        self.index = NGramIndex(max_n)
        self.prefill: PrefillCache | None = None

    @classmethod
    def from_config(cls, cfg) -> "NGramDrafter":
        """The drafter a TreeConfig describes."""
        return cls(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth, cfg.long_chain)

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        self.index = NGramIndex(self.max_n)
        self.index.extend(prompt)
        self.prefill = prefill

    def accept(self, path: list[int], tokens: list[int]) -> None:
        self.index.extend(tokens)

    def _logprob(self, position: int, token: int) -> float:
        return 0.0 if self.prefill is None else self.prefill.logprob(position, token)

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        """One drafting step over `frontier`; `layer` is 1-based (the layer-1 fallback applies there)."""
        k = self.top_k
        # Chains stop at the depth the last layer would reach one level at a time.
        max_chain = min(self.chain, self.depth - layer)
        root_chain = max(max_chain, self.long_chain) if layer == 1 else max_chain
        ctx = self.index.tokens
        n_ngram_children = None
        parents, tokens, scores = [], [], []
        base = tree.size
        for f in frontier:
            f = int(f)
            if tree.expanded[f] & (1 << ORIGIN_NGRAM):
                # A parent that got fewer than K n-gram children has nothing more to offer.
                if n_ngram_children is None:
                    n_ngram_children = tree.children_count(ORIGIN_NGRAM)
                if n_ngram_children[f] < k:
                    continue
            # The context ends with the root, which the path repeats.
            head = ctx[max(0, len(ctx) - self.max_n - 1) : len(ctx) - 1]
            suffix = (head + tree.path_tokens(f, self.max_n))[-self.max_n :]
            found = self.index.matches(suffix, k)
            if not found:
                if layer == 1 and f == 0 and self.index.most_frequent >= 0:
                    parents.append(f)
                    tokens.append(self.index.most_frequent)
                    scores.append(tree.scores[f] + (self.prefill.floor if self.prefill else 0.0))
                continue
            ranked = sorted(
                ((n, p, self._logprob(p, ctx[p])) for n, p in found),
                key=lambda m: (-m[0], -m[1], -m[2]),
            )
            for rank, (_, p, lp) in enumerate(ranked):
                score = tree.scores[f] + lp
                parents.append(f)
                tokens.append(ctx[p])
                scores.append(score)
                # Only the best match carries its chain: enough depth without multiplying the tree.
                chain_end = p + 1 + (root_chain if f == 0 else max_chain) if rank == 0 else p + 1
                for q in range(p + 1, min(chain_end, len(ctx))):
                    parent = base + len(tokens) - 1
                    score = score + self._logprob(q, ctx[q])
                    parents.append(parent)
                    tokens.append(ctx[q])
                    scores.append(score)
        return Proposal(base, np.asarray(parents, np.int64), np.asarray(tokens, np.int64),
                        np.asarray(scores, np.float64), ORIGIN_NGRAM)
