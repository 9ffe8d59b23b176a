"""Turning target logits into the distribution plain sampling would draw from, and drawing from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] fp32 probabilities after temperature, top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The token plain decoding picks from one row of [vocab] logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(target_probs(logits[None], params)[0], generator)
