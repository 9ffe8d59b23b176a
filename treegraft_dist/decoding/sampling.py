"""Turning target logits into the distribution plain sampling would draw from, and drawing from it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

# Temperatures below this sample as greedy (as vLLM does): dividing logits by a smaller one leaves fp32's
# range, and the distribution it would give is the argmax's anyway.
GREEDY_BELOW = 1e-5
# What torch.Generator.manual_seed takes: a 64-bit unsigned seed, or a signed one (a negative seed draws as
# seed + 2**64 does, so -1 and 2**64 - 1 are the same seed).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or any below GREEDY_BELOW) means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the first bad field (params that crossed a process boundary skip __init__)."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if not _real(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def check_seed(seed) -> None:
    """ValueError unless `seed` is an integer torch.Generator.manual_seed takes: [SEED_MIN, SEED_MAX]."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] fp32 probabilities after temperature, top-k, then top-p; one-hot at the
    argmax when `params` are greedy."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # Shifted so that each row's largest logit is 0: however small the temperature, no row overflows.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
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
