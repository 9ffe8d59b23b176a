"""Drafting made cheap: the middle drafter in int8 and every drafting head over a draft vocabulary.

What a drafter computes decides only which tokens are proposed and how they rank; the target's verification
decides what is output, exactly. So the drafting side may trade a little acceptance for a lot of speed:
  int8        on a CPU the middle drafter's decoder linears run in int8 (weights quantized per output
              channel once at load, activations per call; kernels.quantize_int8) where a probe finds the
              quantized product faster: a one-token pass of the 0.5B middle reads a quarter of the bytes
              of fp32, half of bf16 (in a bf16 model activations are cast to fp32 around each product:
              drafting passes of 1-32 tokens 1.25-1.4x faster on a Zen 4 EPYC than packed bf16).
              $TREEGRAFT_DRAFT_INT8=on|off overrides the probe.
  vocabulary  the middle drafter's proposals and scores and the target's prefill cache (n-gram scores)
              come from logits over the draft vocabulary: the first $TREEGRAFT_DRAFT_VOCAB ids (default
              32,768; 0 = all) plus every special and end-of-sequence id. Byte-level BPE vocabularies number
              tokens in merge order, so the first ids are the common ones (the first 32,768 of Qwen2.5's
              151,936 cover 93% of the benchmark prompts' tokens), and a head over them costs about a fifth
              of the full one. A request's own prompt tokens outside it are covered too (names and
              identifiers it may copy: a small gather of head rows per call). Verification, plain decoding
              and sampling always use the whole vocabulary.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from . import compact, kernels
from .hf import CausalLM

VOCAB_ENV = "TREEGRAFT_DRAFT_VOCAB"
DEFAULT_DRAFT_VOCAB = 32768
FULL_VOCAB = 0


def vocab_setting() -> int:
    """Ids of the draft vocabulary below the special ones ($TREEGRAFT_DRAFT_VOCAB; 0 = the whole vocabulary)."""
    raw = os.environ.get(VOCAB_ENV, str(DEFAULT_DRAFT_VOCAB))
    if not raw.isdigit():
        raise ValueError(f"${VOCAB_ENV}={raw!r}: give a number of ids (0 = the whole vocabulary)")
    return int(raw)


def draft_vocabulary(vocab_size: int, size: int, always: set[int]) -> np.ndarray | None:
    """[V'] ascending ids: the first `size` plus `always` (special and end ids); None = all of them."""
    if size == FULL_VOCAB or size >= vocab_size:
        return None
    return np.union1d(np.arange(size), np.array(sorted(i for i in always if 0 <= i < vocab_size), np.int64))


def special_ids(tokenizer, eos_ids) -> set[int]:
    """Ids a draft vocabulary always holds: end-of-sequence and the tokenizer's special and added tokens."""
    ids = {int(i) for i in eos_ids}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", None) or {})
    return ids


def set_draft_vocabulary(lm: CausalLM, ids: np.ndarray | None) -> None:
    """Give `lm` a drafting head over `ids` ([V'] ascending int64, from draft_vocabulary; compact or packed, as
    the head or the other linears are); None: the full head."""
    if ids is None:
        lm.draft_vocab, lm.draft_head = None, None
        return
    index = torch.from_numpy(ids).to(lm.device)
    head = compact.compact_head(lm.head, index)
    if head is not None:
        lm.draft_vocab, lm.draft_head = index, head
        return
    bias = getattr(lm.head, "bias", None)
    with torch.no_grad():
        weight = lm.head_rows(index)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=lm.device,
                         dtype=weight.dtype)
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias.detach()[index])
    if lm.packed:
        kernels.pack(head, pad_to=kernels.padding_of(lm.model))  # too small to measure alone: the model's
    lm.draft_vocab, lm.draft_head = index, head


def quantize_middle(lm: CausalLM) -> str:
    """Run the middle drafter's decoder linears in int8 where this device and precision gain from it; call it
    before packing (int8 replaces the dense weights). Returns what was decided and why."""
    if lm.device.type != "cpu":
        return f"no int8 drafting on {lm.device.type}"
    choice = kernels.int8_choice(lm.dtype)
    if choice.int8 and kernels.quantize_int8(lm.base):
        lm.quantized = True
    return choice.reason


def describe(lm: CausalLM) -> str:
    vocab = "all" if lm.draft_vocab is None else f"{len(lm.draft_vocab)} of {lm.vocab_size}"
    return (f"draft vocabulary {vocab} ids{', decoder linears in int8' if lm.quantized else ''}"
            f"{f', {compact.summary(lm.model)}' if lm.compact else ''}")
