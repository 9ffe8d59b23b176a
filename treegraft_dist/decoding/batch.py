"""Several requests in one target pass: the target side of batched serving.

A `Work` item is one request's next piece of target work: a chunk of its prompt, the verification of its
pruned tree, or one plain decoding step. `BatchedTarget.run` does a list of them, one request's at most
once, in a single forward pass (`verify.forward_blocks`: each request attends over its own KV cache),
and answers each as its request would have been answered alone. Which items go together (a long prompt in
chunks between other requests' rounds, the row budget of a pass) is the caller's choice; actors/target.py
makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.hf import CausalLM
from .sampling import SamplingParams
from .tree import DraftTree
from .verify import TargetVerifier, forward_blocks

PREFILL, VERIFY, STEP = "prefill", "verify", "step"


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


class BatchedTarget:
    """The target and the verifier (KV cache) of every request in flight, by request id."""

    def __init__(self, lm: CausalLM, sampling: SamplingParams):
        self.lm, self.sampling = lm, sampling
        self.requests: dict[int, TargetVerifier] = {}
        self._prompts: dict[int, list[int]] = {}
        self.passes = 0  # forward passes run
        self.items = 0  # items they held

    def run(self, items: list[Work]) -> list:
        """One pass over `items` (distinct requests); per item: None (a prefill chunk before the last),
        (first token, prefill cache or None) (the last chunk), a Verdict (verify) or the next token (step)."""
        if len({w.rid for w in items}) != len(items):
            raise ValueError("a batch holds one item per request")
        blocks = [self._block(w) for w in items]
        hidden = forward_blocks(self.lm, blocks)
        self.passes += 1
        self.items += len(items)
        # Every row whose next-token distribution decides something, through the output head at once: one
        # read of its weights (the largest matrix of a small model) instead of one per request.
        decides = [self._decides(w) for w in items]
        rows = [h if w.kind == VERIFY else h[-1:] for w, h, d in zip(items, hidden, decides) if d]
        logits = iter(torch.split(self.lm.logits(torch.cat(rows)), [len(r) for r in rows]) if rows else ())
        return [self._done(w, h, next(logits) if d else None) for w, h, d in zip(items, hidden, decides)]

    def release(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self._prompts.pop(rid, None)

    def _block(self, w: Work):
        if w.kind == PREFILL:
            if w.start == 0:
                generator = torch.Generator(device=self.lm.device).manual_seed(w.seed)
                self.requests[w.rid] = TargetVerifier(self.lm, w.sampling or self.sampling, generator)
                self._prompts[w.rid] = list(w.prompt)
            return self.requests[w.rid].prefill_block(self._prompts[w.rid], w.start, w.end)
        v = self.requests[w.rid]
        if w.kind == VERIFY:
            return v.verify_block(w.tree)
        if w.kind == STEP:
            return v.step_block(w.token)
        raise ValueError(f"unknown work kind {w.kind!r}")

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

