"""Is a method's output the target's greedy decoding? The verdict: exact, near-tie or mismatch.

`ar` (plain decoding: one prefill pass, then one token per pass) is the reference. Our methods verify a
whole tree per pass. In float32 both give the same tokens (the oracle tests hold them to that). In
bfloat16/float16 a many-token pass and a one-token pass round differently, so where the target's top two
logits nearly tie the argmax can flip: the method then follows an equally valid greedy path and the
outputs part from there on. That is rounding, not a bug; a wrong acceptance rule is.

`classify` compares a method's tokens with the reference:

- "exact": identical.
- "near-tie": at the first differing position p the target's logits of the reference token and of the
  method's token differ by at most the rounding tolerance, AND every method token from p on is within the
  tolerance of the target's best logit given the method's own prefix (after a flip the method continues
  from another context, so the reference says nothing about its later tokens; this keeps a broken rule
  that happens to first diverge at a near-tie from passing).
- "mismatch": anything else. In float32 the tolerance is 0, so any difference is a mismatch. An output
  that is a strict prefix of the other (one stopped earlier with no differing token) is a mismatch too:
  both decoders stop by the same rules (eos, which is itself a token, or max_new_tokens), so a length
  difference without a differing token cannot come from rounding; its logit gap is None. When one output
  stops at eos and the other goes on, eos is simply the differing token and is judged like any other.

The target's logits come from ONE causal pass over prompt + method[:-1], in the model's own dtype
(`CausalLM.hidden` then `CausalLM.logits`, as decoding computes them). Its row at p sees prompt +
reference[:p] (the shared prefix) and gives the reported gap; the later rows give the method's own
continuation. One pass rather than replaying `ar` token by token because it costs one prefill instead of
p sequential passes (about 2 s a token for the 1.5B target in bf16 on a 2-core CPU), and because no pass
shape is the truth here: the reference token was picked in one-token numerics, the method's token in tree
numerics, and the causal pass lies within the same rounding spread of both (measured below), which the
tolerance covers.

The tolerance: tol = ROUNDING_FACTOR[dtype] * torch.finfo(dtype).eps * max|logit| of the row (eps is the
dtype's relative rounding step; the logits' scale sets how much a relative error moves them). The spread
that matters is how much a change of pass shape can move the gap between two tokens: per position,
max(dl) - min(dl) over the vocabulary, dl = the per-token logit difference between two pass shapes over
the same positions (the worst pair of tokens, so an upper bound for the top two). Measured on CPU with
`python -m jobs.bench.flips --rounding [--real]` (greedy continuations; one token a pass as `ar`, blocks
of 8 after the prefill as a verification pass, one causal pass as here; all three pairs compared), worst
spread in units of eps * max|logit|:

    model                                  dtype  positions            worst  p99    worst in logits
    tiny llama/qwen3, 2 layers, 8 models   bf16   8 x 2 x 64           5.06   <=3.8  0.31 (max|logit| 13)
    tiny llama/qwen3, 2 layers, 8 models   fp16   8 x 2 x 64           9.78   <=5.8  0.08 (max|logit| 15)
    Qwen2.5-Coder-1.5B-Instruct, 28 layers bf16   24 + 3 x 40 (gsm8k,  4.03   <=3.7  0.56 (max|logit| 30-34)
                                                  humaneval, qa, sum)

ROUNDING_FACTOR is twice the worst figure: 10 for bf16, 20 for fp16 (fp16 measured on the tiny models
only; its figure in eps units is higher because eps is 8x smaller while part of the error is not). For the
1.5B target in bf16 that is a tolerance of about 2.3 logits (10 * 2**-7 * 30) against the 0.56 observed,
still below a genuinely different choice a few logits apart; a wrong acceptance rule is caught far more
surely than by one gap because every later token of the method is checked as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.hf import CausalLM

EXACT, NEAR_TIE, MISMATCH = "exact", "near-tie", "mismatch"
VERDICTS = (EXACT, NEAR_TIE, MISMATCH)
# The tolerance in units of eps * max|logit|: twice the worst spread measured (see the module docstring).
ROUNDING_FACTOR = {torch.bfloat16: 10.0, torch.float16: 20.0}


@dataclass(frozen=True)
class Check:
    verdict: str  # exact / near-tie / mismatch
    diverge_at: int | None = None  # first position (in generated tokens) where the outputs differ
    logit_gap: float | None = None  # target logit of the reference token minus that of the method's token at p
    tolerance: float | None = None  # the rounding tolerance at p (0 in float32)
    worst_excess: float | None = None  # max over positions >= p of (best logit - method token's logit)
    reason: str = ""


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:  # logits: [vocab]
    """How far two pass shapes may move the gap between two tokens' logits by rounding alone: 0 in
    float32 (outputs must be identical there), ROUNDING_FACTOR[dtype] * eps * max|logit| in half precision."""
    if dtype not in ROUNDING_FACTOR:
        return 0.0
    return ROUNDING_FACTOR[dtype] * torch.finfo(dtype).eps * float(logits.abs().max())


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first position where the two differ (the shorter length if one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def target_logits(lm: CausalLM, prompt: list[int], tokens: list[int], start: int) -> torch.Tensor:
    """[len(tokens) - start, vocab] fp32: the target's logits predicting tokens[start:], each given the prompt
    and the tokens before it; one causal pass in the model's dtype (see the module docstring for why)."""
    ids = torch.tensor(prompt + tokens[:-1], dtype=torch.int64)
    h = lm.hidden(lm.new_cache(), ids, torch.arange(len(ids)))
    return lm.logits(h[len(prompt) - 1 + start:])


def classify(lm: CausalLM | None, prompt: list[int], reference: list[int], tokens: list[int]) -> Check:
    """The verdict on a method's `tokens` against the `reference` (ar's tokens) for `prompt`.

    `lm` is the target; None (its weights live elsewhere) means no logits: any difference is a mismatch.
    """
    p = first_divergence(reference, tokens)
    if p is None:
        return Check(EXACT)
    if p >= min(len(reference), len(tokens)):
        which = "method" if len(tokens) < len(reference) else "reference"
        return Check(MISMATCH, p, reason=f"the {which} output stops at {p} tokens where the other goes on, "
                                          "with no differing token: not a rounding effect")
    if lm is None:
        return Check(MISMATCH, p, reason="no target weights in this process to judge the difference")
    rows = target_logits(lm, prompt, tokens, p).cpu()
    here = rows[0]
    gap = float(here[reference[p]] - here[tokens[p]])
    tol = tolerance(lm.dtype, here)
    picked = rows.gather(1, torch.tensor(tokens[p:])[:, None])[:, 0]
    excess = rows.max(dim=1).values - picked  # [len(tokens) - p] how far each method token is from the best
    room = torch.tensor([tolerance(lm.dtype, r) for r in rows])
    if tol == 0.0:
        verdict, reason = MISMATCH, f"{lm.dtype} decoding must be identical to ar"
    elif abs(gap) > tol:
        verdict, reason = MISMATCH, f"gap {gap:.3f} at token {p} exceeds the rounding tolerance {tol:.3f}"
    elif bool((excess > room).any()):
        i = int((excess > room).nonzero()[0])
        verdict, reason = MISMATCH, (f"token {p + i} is {float(excess[i]):.3f} below the target's best logit, "
                                     f"beyond the rounding tolerance {float(room[i]):.3f}")
    else:
        verdict, reason = NEAR_TIE, f"gap {gap:.3f} at token {p} within the rounding tolerance {tol:.3f}"
    return Check(verdict, p, gap, tol, float(excess.max()), reason)
