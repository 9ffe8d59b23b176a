"""Several requests in one target pass: the target side of batched serving.

A `Work` item is one request's next piece of target work: a chunk of its prompt, the verification of its
pruned tree, or one plain decoding step. `BatchedTarget.run` does a list of them, one request's at most
once, in a single forward pass (`verify.forward_blocks`: each request attends over its own KV cache),
and answers each as its request would have been answered alone. Which items go together (a long prompt in
chunks between other requests' rounds, the row budget of a pass) is the caller's choice; actors/target.py
makes it.

A fault stays with the item that caused it: an item that cannot be prepared or read out is answered with
an `ItemFailed` record, and when the shared forward itself raises, the items are run again one by one
(each cache first cut back to where the pass found it), so only the culprit fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed

from ..models.hf import CausalLM, cache_len, compact_cache
from .errors import RequestFailed
from .sampling import SamplingParams, check_seed
from .tree import DraftTree
from .verify import Block, TargetVerifier, forward_blocks

PREFILL, VERIFY, STEP = "prefill", "verify", "step"
# ItemFailed kinds: the request's own input cannot be run (the caller answers ValueError), or its
# computation failed (RequestFailed).
INPUT, ERROR = "input", "error"
_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


@dataclass
class Work:
    """One request's piece of target work. prefill: prompt positions [start, end) (the whole prompt rides
    with the first chunk; `seed`, `sampling` start the request); verify: `tree`; step: `token`."""

    kind: str
    rid: int
    tree: DraftTree | None = None
    token: int = 0
    prompt: list[int] | None = None
    start: int = 0
    end: int = 0
    want_prefill_cache: bool = True
    seed: int = 0
    sampling: SamplingParams | None = None

    @property
    def rows(self) -> int:
        """Rows the item adds to a pass."""
        return self.end - self.start if self.kind == PREFILL else self.tree.size if self.kind == VERIFY else 1


class InvalidInput(ValueError):
    """A request's own input (prompt ids, seed, sampling params) that the target cannot run."""


@dataclass(frozen=True)
class ItemFailed:
    """The answer to a work item that failed alone (a plain, picklable record): `kind` INPUT or ERROR."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> ItemFailed:
        return cls(INPUT if isinstance(e, InvalidInput) else ERROR, f"{type(e).__name__}: {e}")

    def error(self) -> Exception:
        """The exception the item's request raises."""
        if self.kind == INPUT:
            return ValueError(f"the target cannot run this request: {self.message}")
        return RequestFailed(f"the target failed on this request alone: {self.message}")


def input_vocab(lm: CausalLM) -> int:
    """How many token ids the model's input embedding takes (the whole vocabulary, also on a
    tensor-parallel rank holding a slice of it)."""
    rows = getattr(lm.model.get_input_embeddings(), "num_embeddings", None)
    return int(rows) if rows is not None else int(lm.model.config.vocab_size)


class BatchedTarget:
    """The target and the verifier (KV cache) of every request in flight, by request id."""

    def __init__(self, lm: CausalLM, sampling: SamplingParams):
        self.lm, self.sampling = lm, sampling
        self.vocab = input_vocab(lm)
        self.requests: dict[int, TargetVerifier] = {}
        self._prompts: dict[int, list[int]] = {}
        self.passes = 0  # forward passes run
        self.items = 0  # items they held

    def run(self, items: list[Work]) -> list:
        """One pass over `items` (distinct requests); per item: None (a prefill chunk before the last),
        (first token, prefill cache or None) (the last chunk), a Verdict (verify), the next token (step), or
        ItemFailed when that item alone failed (the others are answered as if it had not been there)."""
        if len({w.rid for w in items}) != len(items):
            raise ValueError("a batch holds one item per request")
        out: list = [None] * len(items)
        live, blocks = [], []
        for i, w in enumerate(items):
            try:
                blocks.append(self._block(w))
                live.append(i)
            except Exception as e:
                out[i] = ItemFailed.of(e)
        hidden = dict(zip(live, self._forward(blocks)))
        self.passes += 1
        self.items += len(items)
        ran = []
        for i, h in hidden.items():
            if isinstance(h, ItemFailed):
                out[i] = h
            else:
                ran.append(i)
        for i, logits in zip(ran, self._logits([items[i] for i in ran], [hidden[i] for i in ran])):
            try:
                out[i] = logits if isinstance(logits, ItemFailed) else self._done(items[i], hidden[i], logits)
            except Exception as e:
                out[i] = ItemFailed.of(e)
        return out

    def release(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self._prompts.pop(rid, None)

    # -- the pass, a fault kept to its item -----------------------------------------------------------
    def _forward(self, blocks: list[Block]) -> list:
        """Each block's [n_b, hidden] rows, or ItemFailed for a block whose forward raised. A forward that
        raises may have appended keys and values to some layers of some caches (the layers run in order,
        every block's cache is written per layer): each cache is cut back to its length before the pass,
        then the blocks run one by one. A collective that broke (a lost rank) is raised: it is no item's."""
        pasts = [cache_len(b.cache) for b in blocks]
        try:
            return forward_blocks(self.lm, blocks) if blocks else []
        except torch.distributed.DistError:
            raise
        except Exception as e:
            if len(blocks) == 1:
                _restore(blocks[0].cache, pasts[0])
                return [ItemFailed.of(e)]
        out = []
        for b, past in zip(blocks, pasts):
            _restore(b.cache, past)
            try:
                out.append(forward_blocks(self.lm, [b])[0])
            except torch.distributed.DistError:
                raise
            except Exception as e:
                _restore(b.cache, past)
                out.append(ItemFailed.of(e))
        return out

    def _logits(self, items: list[Work], hidden: list[torch.Tensor]) -> list:
        """Per item: the [m, vocab] logits of its rows that decide something (a verification's every row, a
        step's or a prompt's last chunk's last row), None for a prompt chunk before the last, or ItemFailed.
        Every such row goes through the output head at once: one read of its weights (the largest matrix of
        a small model) instead of one per request; one item at a time only if that raised."""
        rows = {i: h if w.kind == VERIFY else h[-1:] for i, (w, h) in enumerate(zip(items, hidden)) if self._decides(w)}
        out: list = [None] * len(items)
        if not rows:
            return out
        try:
            for i, lg in zip(rows, torch.split(self.lm.logits(torch.cat(list(rows.values()))),
                                               [len(r) for r in rows.values()])):
                out[i] = lg
        except torch.distributed.DistError:
            raise
        except Exception:
            for i, r in rows.items():
                try:
                    out[i] = self.lm.logits(r)
                except torch.distributed.DistError:
                    raise
                except Exception as e:
                    out[i] = ItemFailed.of(e)
        return out

    # -- one item -------------------------------------------------------------------------------------
    def _block(self, w: Work) -> Block:
        if w.kind == PREFILL:
            if w.start == 0:
                self._start(w)
            prompt = self._prompts.get(w.rid)
            if prompt is None or w.rid not in self.requests:
                raise RuntimeError(f"request {w.rid} has no prompt here: its first chunk never arrived")
            if not 0 <= w.start < w.end <= len(prompt):
                raise ValueError(f"prompt chunk [{w.start}, {w.end}) is outside the prompt of {len(prompt)} tokens")
            return self.requests[w.rid].prefill_block(prompt, w.start, w.end)
        v = self.requests.get(w.rid)
        if v is None:
            raise RuntimeError(f"request {w.rid} has no KV cache here: it was never prefilled, or released")
        if w.kind == VERIFY:
            self._check_ids(w.tree.tokens[: w.tree.size], "the tree")
            return v.verify_block(w.tree)
        if w.kind == STEP:
            self._check_ids(np.array([w.token]), "the step's token")
            return v.step_block(w.token)
        raise ValueError(f"unknown work kind {w.kind!r}")

    def _start(self, w: Work) -> None:
        """A request's first chunk: its input checked, its verifier made."""
        sampling = w.sampling or self.sampling
        try:
            check_seed(w.seed)
            sampling.check()
            ids = np.asarray(w.prompt)
            if len(ids) == 0 or ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError("the prompt must be a non-empty flat list of integer token ids")
            if ids.min() < 0 or ids.max() >= self.vocab:
                raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab})")
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        generator = torch.Generator(device=self.lm.device).manual_seed(int(w.seed))
        self.requests[w.rid] = TargetVerifier(self.lm, sampling, generator)
        self._prompts[w.rid] = [int(t) for t in w.prompt]

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(f"{what} holds token ids outside the vocabulary [0, {self.vocab})")

    def _decides(self, w: Work) -> bool:
        """Whether the item's rows go through the output head: a verification, a step, a prompt's last chunk."""
        return w.kind != PREFILL or w.end == len(self._prompts[w.rid])

    def _done(self, w: Work, h: torch.Tensor, logits: torch.Tensor | None):
        v = self.requests[w.rid]
        if w.kind == PREFILL:
            out = v.prefill_done(h, self._prompts[w.rid], w.start, w.want_prefill_cache, logits)
            if out is not None:
                self._prompts.pop(w.rid, None)
            return out
        return v.verify_done(w.tree, logits) if w.kind == VERIFY else v.step_done(logits)


def _restore(cache, past: int) -> None:
    """Cut every layer of `cache` back to its first `past` positions."""
    compact_cache(cache, past, _NO_SLOTS)


def take_pass(waiting: list[Work], max_rows: int) -> list[int]:
    """Which of the `waiting` items (oldest first; one request may have several) the next pass takes, as
    indices: the oldest always (nothing starves, and an item over `max_rows` still runs alone), then rounds
    (tree verifications, plain steps) in arrival order before prompt chunks, one item per request, while
    the rows fit. So a prompt chunk carries the rounds waiting beside it, the way chunked prefill
    schedules decodes first, instead of the rounds waiting a whole chunk's pass for the next one."""
    if not waiting:
        return []
    order = [0] + sorted(range(1, len(waiting)), key=lambda i: waiting[i].kind == PREFILL)
    taken, rows, rids = [], 0, set()
    for i in order:
        w = waiting[i]
        if w.rid not in rids and (not taken or rows + w.rows <= max_rows):
            taken.append(i)
            rows += w.rows
            rids.add(w.rid)
    return sorted(taken)
