"""The training-free small drafter: n-gram matching against the context, scored by the target's prefill.

For a frontier node, the suffix of (context + path to the node) is looked up in an index of every
n-gram (n = max_n .. 1) that occurred earlier in the context; each occurrence proposes the token that
followed it. Children rank by longer match first, then more recent occurrence, then score; a child may
carry the chain of tokens that followed its occurrence (several depths in one step); only the best
match of each parent does.

Long chains (an extension beyond the published settings, `long_chain` > 0): at the round's first n-gram
layer (the first layer, or the first after the middle drafter's) the best match of the best-scored frontier
node (the root at layer 1) carries up to `long_chain` tokens of what followed it, past the depth the layers
would reach. Where text repeats (code edits, summaries quoting their source) a round can then accept
a whole copied span, as prompt lookup decoding does. Where the chain follows a match of at least `pin_match`
tokens (2, as prompt lookup matches; here or in the history) it is pinned: pruning keeps it ahead of the nodes
it ranks by score, so a round verifies the copy as far as the budget reaches, however the prompt's own
log-probs score it. A chain behind a shorter match is ranked by score like any other node.

History (beyond the paper, for a server): a `HistoryIndex` holds earlier requests' prompts and outputs,
bounded in tokens, least recently used out. Where a node's suffix also occurs there (at least
`HistoryIndex.min_n` tokens of it), the token that followed is proposed too, ranked after the request's own
matches of the same length; the best match carries its chain from there, so a question asked again, a chat's
next turn or code edited in steps can accept what an earlier request generated. Verification keeps the output
exactly the target's whatever the history proposes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np

from .tree import ORIGIN_NGRAM, DraftTree, Proposal

# Penalty (in nats) below the lowest cached log-prob for a token outside the cached top-k.
OUTSIDE_TOPK_PENALTY = 5.0


@dataclass
class PrefillCache:
    """The target's top-k next-token log-probs at the prompt's positions from `start` on, stored during prefill
    (verify.PREFILL_SCORE_WINDOW: a long prompt's last positions only).

    Row i is the distribution of the token at position start + i + 1 given tokens 0..start + i. A position
    before `start` scores 0, as the context past the prompt does: nothing was stored for it.
    """

    tokens: np.ndarray  # [prompt_len - start, k] int64
    logprobs: np.ndarray  # [prompt_len - start, k] float64
    start: int = 0  # the prompt row of tokens[0]

    def __post_init__(self):
        self.floor = float(self.logprobs.min()) - OUTSIDE_TOPK_PENALTY if self.logprobs.size else 0.0
        # Nested lists, each made by one C-level conversion: searching a row's k distinct tokens in a list
        # is about as fast as a dict lookup, and building per-position dicts cost ~10x more.
        self._tokens = self.tokens.tolist()
        self._logprobs = self.logprobs.tolist()

    def logprob(self, position: int, token: int) -> float:
        """Target log-prob of `token` at context `position`; 0 where nothing was stored (before `start`, beyond
        the prompt)."""
        row = position - 1 - self.start
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


_MULT = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier for the n-gram hash


def _gram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] uint64: a hash of each window of n tokens (window p is tokens[p : p + n]); wraps mod 2**64."""
    m = len(tokens) - n + 1
    h = np.full(max(m, 0), n, np.uint64)
    for i in range(n):
        h = h * _MULT + tokens[i : i + m]
    return h


_MULT_INT, _MASK = int(_MULT), (1 << 64) - 1


def _gram_hash(gram: list[int]) -> int:
    """_gram_hashes of one window, in Python integers (no array overhead for a single lookup)."""
    h = len(gram)
    for t in gram:
        h = (h * _MULT_INT + t) & _MASK
    return h


class HistoryIndex:
    """Earlier requests' token sequences (prompt and output) for n-gram matching across requests: every
    n-gram of `min_n`..`max_n` tokens, by a 64-bit hash, maps to the positions that followed it, in one
    sorted array (about 100 bytes a token with the sequence itself; a lookup is a binary search, and a hash
    collision is checked away). At most `max_tokens` tokens are kept; the least recently added or matched
    sequences go first (a sequence longer than the bound keeps its last `max_tokens`). An evicted sequence's
    entries are skipped where met and dropped once they outnumber the live ones. Thread-safe."""

    def __init__(self, max_tokens: int, max_n: int = 5, min_n: int = 3):
        if max_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"a history needs max_tokens >= 1 and 1 <= min_n <= max_n, got {max_tokens}, "
                             f"{min_n}, {max_n}")
        self.max_tokens, self.max_n, self.min_n = max_tokens, max_n, min_n
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._keys = np.zeros(0, np.uint64)  # sorted n-gram hashes; equal ones oldest first
        self._vals = np.zeros(0, np.uint64)  # sequence id << 32 | position of the token that followed
        self._next_id = 0
        self.tokens = 0
        self._stale = 0  # entries of evicted sequences still in the arrays
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seqs)

    def _entries(self, sid: int, seq: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(hashes, values) of every window of `seq` followed by a token, sorted by hash."""
        toks = np.asarray(seq, np.uint64)
        lengths = [n for n in range(self.min_n, self.max_n + 1) if len(seq) > n]
        keys = np.concatenate([_gram_hashes(toks[:-1], n) for n in lengths])
        vals = np.concatenate([(np.uint64(sid) << np.uint64(32)) | np.arange(n, len(seq), dtype=np.uint64)
                               for n in lengths])
        order = np.argsort(keys, kind="stable")
        return keys[order], vals[order]

    def add(self, tokens) -> None:
        seq = [int(t) for t in tokens][-self.max_tokens :]
        if len(seq) <= self.min_n:
            return
        with self._lock:
            sid, self._next_id = self._next_id, self._next_id + 1
            keys, vals = self._entries(sid, seq)
            at = np.searchsorted(self._keys, keys, side="right")  # after equal keys: newest last
            self._keys, self._vals = np.insert(self._keys, at, keys), np.insert(self._vals, at, vals)
            self._seqs[sid] = seq
            self.tokens += len(seq)
            while self.tokens > self.max_tokens:
                old = self._seqs.popitem(last=False)[1]
                self.tokens -= len(old)
                self._stale += sum(len(old) - n for n in range(self.min_n, self.max_n + 1) if len(old) > n)
            if 2 * self._stale > len(self._keys):
                live = np.isin(self._vals >> np.uint64(32), np.fromiter(self._seqs, np.uint64, len(self._seqs)))
                self._keys, self._vals, self._stale = self._keys[live], self._vals[live], 0

    def matches(self, suffix: list[int], k: int) -> list[tuple[int, list[int], int]]:
        """Up to k (match length, sequence, position of the proposed token) with distinct proposed tokens,
        longest match first, then the latest occurrence; the sequences matched count as used."""
        out: list[tuple[int, list[int], int]] = []
        seen: set[int] = set()
        if len(suffix) < self.min_n:
            return out
        lengths = range(min(self.max_n, len(suffix)), self.min_n - 1, -1)
        hashes = np.array([_gram_hash(suffix[-n:]) for n in lengths], np.uint64)
        with self._lock:
            keys, vals, seqs = self._keys, self._vals, self._seqs
            los, his = np.searchsorted(keys, hashes, "left").tolist(), np.searchsorted(keys, hashes, "right").tolist()
            for n, lo, hi in zip(lengths, los, his):
                gram = suffix[-n:]
                for entry in vals[lo:hi][::-1].tolist():
                    sid, p = entry >> 32, entry & 0xFFFFFFFF
                    seq = seqs.get(sid)
                    if seq is None or seq[p] in seen or seq[p - n : p] != gram:  # evicted, proposed, a collision
                        continue
                    seen.add(seq[p])
                    out.append((n, seq, p))
                    seqs.move_to_end(sid)
                    if len(out) == k:
                        return out
        return out


class NGramDrafter:
    """Small drafter: proposes children of frontier nodes from context n-gram matches.

    `chain` is how many further tokens of the best match are added below its child.
    """

    origin = ORIGIN_NGRAM
    alive = True  # in process: never gone (drafter.Drafter)
    fallback_steps = 0

    def __init__(self, top_k: int = 10, max_n: int = 5, chain: int = 4, depth: int = 5, long_chain: int = 0,
                 history: HistoryIndex | None = None, pin_match: int = 2):
        self.top_k = top_k
        self.max_n = max_n
        self.chain = chain
        self.depth = depth
        self.long_chain = long_chain
        self.pin_match = pin_match
        self.history = history  # earlier requests' sequences, matched after this request's own context
        self.index = NGramIndex(max_n)
        self.prefill: PrefillCache | None = None

    @classmethod
    def from_config(cls, cfg) -> "NGramDrafter":
        """The drafter a TreeConfig describes."""
        return cls(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth, cfg.long_chain, pin_match=cfg.pin_match)

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        self.index = NGramIndex(self.max_n)
        self.index.extend(prompt)
        self.prefill = prefill

    def accept(self, path: list[int], tokens: list[int]) -> None:
        self.index.extend(tokens)

    def release(self) -> None:
        """Nothing to free: the next `start` forgets this request."""

    def copying(self) -> bool:
        """Whether the text is copying a span: the context's last `max_n` tokens occurred before, in this
        request or (where a history is kept) an earlier one, so that the root's best match carries a long
        chain (`long_chain` > 0). A schedule that `copies_first` leaves such a round's first layer to this
        drafter (engine.draft_layers): a middle layer first would put the middle drafter's guesses above
        the copy and reach it only behind a match of max_n tokens from them."""
        ctx = self.index.tokens
        if not self.long_chain or len(ctx) < self.max_n:
            return False
        suffix = ctx[-self.max_n :]
        own = self.index.matches(suffix, 1)
        if own and own[0][0] >= self.max_n:
            return True
        if self.history is None:
            return False
        seen = self.history.matches(suffix, 1)
        return bool(seen) and seen[0][0] >= self.max_n

    def _logprob(self, position: int, token: int) -> float:
        return 0.0 if self.prefill is None else self.prefill.logprob(position, token)

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        """One drafting step over `frontier`; `layer` is 1-based (the layer-1 fallback applies there)."""
        k = self.top_k
        # Chains stop at the depth the last layer would reach one level at a time, except the long chain: at
        # the round's first n-gram layer, from its best-scored frontier node (the root at layer 1; after a
        # middle layer, the middle drafter's best guess, and there only behind a match of max_n tokens: a
        # copy the middle's token continues, not a short match in generated text whose unscored chain would
        # outrank the middle's other guesses), so that a schedule that calls the middle drafter first still
        # copies a whole span where the text repeats.
        max_chain = min(self.chain, self.depth - layer)
        long_from = -1
        first_ngram_layer = not (tree.expanded[: tree.size] & (1 << ORIGIN_NGRAM)).any()
        if self.long_chain > max_chain and len(frontier) and first_ngram_layer:
            long_from = int(frontier[np.argmax(tree.scores[frontier])])
        ctx = self.index.tokens
        n_ngram_children = None
        parents, tokens, scores, pins = [], [], [], []
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
            # (match length, own context first, recency, prefill log-prob, sequence, position)
            ranked = sorted(((n, 1, p, self._logprob(p, ctx[p]), ctx, p) for n, p in self.index.matches(suffix, k)),
                            key=lambda m: (-m[0], -m[2], -m[3]))
            if self.history is not None:  # a token both propose keeps its longer match, its own at a tie
                both = sorted(ranked + [(n, 0, -i, 0.0, seq, p) for i, (n, seq, p)
                                        in enumerate(self.history.matches(suffix, k))],
                              key=lambda m: (-m[0], -m[1]))  # stable: each source keeps its own order
                seen: set[int] = set()
                ranked = [m for m in both if m[4][m[5]] not in seen and not seen.add(m[4][m[5]])][:k]
            if not ranked:
                if layer == 1 and f == 0 and self.index.most_frequent >= 0:
                    parents.append(f)
                    tokens.append(self.index.most_frequent)
                    scores.append(tree.scores[f] + (self.prefill.floor if self.prefill else 0.0))
                    pins.append(False)
                continue
            long = f == long_from and (f == 0 or ranked[0][0] >= self.max_n)
            # A copy (a match of at least pin_match tokens) under way: its chain is pinned, verified ahead of the
            # nodes ranked by score, whose scores (the prompt's own log-probs where it was written) say little of
            # whether the copy goes on.
            copy = long and 0 < self.pin_match <= ranked[0][0]
            for rank, (_, is_own, _, lp, seq, p) in enumerate(ranked):
                score = tree.scores[f] + lp
                parents.append(f)
                tokens.append(seq[p])
                scores.append(score)
                pins.append(copy and rank == 0)
                # Only the best match carries its chain: enough depth without multiplying the tree.
                chain_end = p + 1 + (self.long_chain if long else max_chain) if rank == 0 else p + 1
                for q in range(p + 1, min(chain_end, len(seq))):
                    parent = base + len(tokens) - 1
                    score = score + (self._logprob(q, seq[q]) if is_own else 0.0)
                    parents.append(parent)
                    tokens.append(seq[q])
                    scores.append(score)
                    pins.append(copy)
        return Proposal(base, np.asarray(parents, np.int64), np.asarray(tokens, np.int64),
                        np.asarray(scores, np.float64), ORIGIN_NGRAM,
                        pinned=np.asarray(pins, bool) if any(pins) else None)
