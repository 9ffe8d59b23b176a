"""Stock Hugging Face causal LMs as used here: a forward pass with an explicit attention mask and
position ids over a KV cache, logits from hidden states, and in-place KV cache compaction.

No modeling file is forked: a 4D mask passed to a transformers model is used as given, which is all
tree attention needs.

Two kinds of logits: `logits` covers the whole vocabulary and decides what is output (verification,
plain decoding, sampling); `top_logprobs` serves drafting only (the middle drafter's proposals and
scores, the target's prefill cache for n-gram scores) and may cover a subset of the vocabulary, the
draft vocabulary (draft.py), since what a drafter proposes never changes what is output.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel


# transformers' sdpa path copies every cached key and value once per query head group (repeat_kv) for any pass
# of several tokens with a mask, which every tree pass and prefill here has; torch's own grouped-query
# attention takes the mask on a CPU and gives the same numbers without the copies (measured: the same output
# to the bit, 3-6x faster attention). transformers reads this switch at every call; on CUDA its default
# stays (a masked grouped-query pass would leave the fused kernels).
SDPA_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


def _cache_kwarg(model: PreTrainedModel) -> str:
    params = inspect.signature(model.base_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CausalLM:
    """A transformers causal LM driven token-block by token-block with an explicit mask."""

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self._cache_kw = _cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = self.head.weight.shape[0]
        self.num_params = sum(p.numel() for p in model.parameters())  # as loaded (packing drops dense copies)
        self.packed = False
        self.compact = False  # linears over exact compact weights (compact.py)
        self.quantized = False  # decoder linears in int8 (draft.py; drafters only)
        self.draft_vocab: torch.Tensor | None = None  # [V'] ascending ids top_logprobs covers; None = all
        self._draft_head = None  # callable [n, hidden] -> [n, V'] over draft_vocab
        if self.device.type == "cpu":
            os.environ.setdefault(SDPA_GQA_ENV, "1")  # =0 keeps transformers' copies

    def compact_linears(self, folder: str | None = None) -> bool:
        """On a CPU in fp32, run every linear layer whose weight has an exact compact form (16-bit values, or
        the int8 groups prepare.py kept in the model's `folder`) through the compact kernel where that is this
        processor's faster path (compact.py); the output head keeps its dense weight for row lookups.
        Returns whether any does. Weights are final afterwards."""
        from . import compact

        if not self.compact and self.device.type == "cpu" and self.dtype == compact.DTYPE and compact.choice().compact:
            groups = compact.load_groups(folder) if folder is not None else {}  # read only when used
            self.compact = compact.compress(self.model, groups, keep_dense=(self.head,)) > 0
            self.head = self.model.get_output_embeddings()
        return self.compact

    def pack_linears(self) -> bool:
        """On a CPU, run the linear layers (those not compact) through oneDNN on weights packed once where that
        is this processor's faster path (kernels.py); returns whether they now are. Weights are final afterwards."""
        from . import kernels

        if not self.packed and self.device.type == "cpu" and kernels.choice(self.dtype).packed:
            kernels.pack(self.model)
            self.packed = True
        return self.packed

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def hidden(
        self,
        cache: DynamicCache,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        attend: torch.Tensor | None = None,  # [n, cache_len + n] or [n, n] bool; None = causal
    ) -> torch.Tensor:  # [n, hidden]
        """Run the decoder over `input_ids`, appending their keys and values to `cache`.

        `attend` of width n covers the new block only: every cached position is visible to every row.
        The mask is always explicit, the causal one included, so that every pass (prefill, plain decoding,
        tree verification) takes the same attention path.
        """
        mask = self._additive_mask(len(input_ids), cache_len(cache), attend)
        kwargs = {self._cache_kw: cache, "use_cache": True, "attention_mask": mask[None, None]}
        out = self.base(input_ids=input_ids.to(self.device)[None], position_ids=positions.to(self.device)[None],
                        **kwargs)
        return out.last_hidden_state[0]

    def _additive_mask(
        self, n: int, past: int,
        attend: torch.Tensor | None,  # [n, past + n] or [n, n] bool; None = causal
    ) -> torch.Tensor:  # [n, past + n] model dtype: 0 where visible, the dtype's minimum elsewhere
        """Built on the model's device; with a block-only or causal `attend` only the block is written,
        the cached part stays zeros."""
        mask = torch.zeros((n, past + n), dtype=self.dtype, device=self.device)
        lowest = torch.finfo(self.dtype).min
        if attend is None:
            mask[:, past:].fill_(lowest).triu_(1)  # a token sees itself and the tokens before it
        else:
            target = mask if attend.shape[1] == past + n else mask[:, past:]
            target.masked_fill_(~attend.to(self.device), lowest)
        return mask

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        return self.head(hidden).float()

    @torch.inference_mode()
    def top_logprobs(
        self, hidden: torch.Tensor,  # [n, hidden]
        k: int, chunk: int = 64,
        extra: torch.Tensor | None = None,  # [E] ascending ids outside the draft vocabulary to cover too
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:  # ([n] fp32, [n, k] int64, [n, k] float64)
        """Drafting view of the next-token distribution at every row: (logsumexp of the logits, top-k token
        ids, their log-probs), over the draft vocabulary plus `extra` (a request's own tokens, say); `chunk`
        rows of logits are materialised at once."""
        vocab, extra_rows = self.draft_vocab, None
        if extra is not None and len(extra) and vocab is not None:
            extra = extra.to(self.device)
            extra_rows = self.head.weight[extra]  # [E, hidden]: a small gather, not a second packed head
            vocab = torch.cat([vocab, extra])
        lse, tokens, logprobs = [], [], []
        for s in range(0, len(hidden), chunk):
            logits = self.draft_logits(hidden[s : s + chunk])
            if extra_rows is not None:
                logits = torch.cat([logits, self._extra_logits(hidden[s : s + chunk], extra_rows, extra)], dim=-1)
            z = torch.logsumexp(logits, dim=-1)
            top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
            ids = top.indices if vocab is None else vocab.to(top.indices.device)[top.indices]
            lse.append(z)
            tokens.append(ids.cpu().numpy())
            logprobs.append((top.values - z[:, None]).double().cpu().numpy())
        if not lse:
            return torch.zeros(0, device=self.device), np.zeros((0, k), np.int64), np.zeros((0, k), np.float64)
        return torch.cat(lse), np.concatenate(tokens), np.concatenate(logprobs)

    def _extra_logits(self, hidden: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = hidden @ rows.T
        if getattr(self.head, "bias", None) is not None:
            out = out + self.head.bias[ids]
        return out.float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, V'] fp32
        """Logits over the draft vocabulary only (all of it unless draft.py set a subset)."""
        if self._draft_head is None:
            return self.logits(hidden)
        with torch.inference_mode():
            return self._draft_head(hidden).float()

    def outside_draft_vocab(self, tokens) -> torch.Tensor | None:
        """[E] ascending ids among `tokens` that the draft vocabulary lacks (None: it has every id)."""
        if self.draft_vocab is None:
            return None
        seen = torch.unique(torch.as_tensor(list(tokens), dtype=torch.int64))
        seen = seen[(seen >= 0) & (seen < self.vocab_size)]
        return seen[~torch.isin(seen, self.draft_vocab.cpu())]

    @torch.inference_mode()
    def token_logits(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        tokens: torch.Tensor,  # [n] int64
    ) -> torch.Tensor:  # [n] fp32
        """Logit of one given token per row, without materialising the whole vocabulary."""
        w = self.head.weight[tokens.to(self.device)]
        out = (hidden * w).sum(-1)
        if getattr(self.head, "bias", None) is not None:
            out = out + self.head.bias[tokens.to(self.device)]
        return out.float()


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def compact_cache(cache: DynamicCache, start: int, slots: torch.Tensor) -> None:
    """Keep cache positions [0, start) followed by `slots` (ascending, all >= start); drop the rest."""
    n = len(slots)
    contiguous = n == 0 or int(slots[0]) == start and int(slots[-1]) == start + n - 1
    index = None
    for layer in cache.layers:
        if not layer.is_initialized:
            continue  # nothing cached yet (a drafter restored before its first forward)
        if not contiguous:
            if index is None:  # one copy to the cache's device, not one per layer
                index = slots.to(layer.keys.device)
            layer.keys[..., start : start + n, :] = layer.keys[..., index, :]
            layer.values[..., start : start + n, :] = layer.values[..., index, :]
        layer.keys = layer.keys[..., : start + n, :]
        layer.values = layer.values[..., : start + n, :]
