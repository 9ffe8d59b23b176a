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
import sys
from collections.abc import Callable

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# transformers' sdpa path copies every cached key and value once per query head group (repeat_kv) for any pass
# of several tokens with a mask, which every tree pass and prefill here has; torch's own grouped-query
# attention takes the mask on a CPU and gives the same numbers without the copies (measured: the same output
# to the bit, 3-6x faster attention). transformers reads this switch at every call; on CUDA its default
# stays (a masked grouped-query pass would leave the fused kernels).
SDPA_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
# On CUDA torch ranks cuDNN's fused attention first where it applies (Hopper), and it spends about 1.2 ms of
# host time on every call: a 28-layer target's one-token step took 61 ms (median) with it and 20 ms with torch's
# memory-efficient kernel, the same kernel a masked tree pass gets (H200, torch 2.11, CUDA 13; `jobs/bench/step.py`).
# Decoding here is host-bound on a GPU, so it stays off unless this is "1".
CUDNN_SDPA_ENV = "TREEGRAFT_CUDNN_SDPA"


def _cache_kwarg(model: PreTrainedModel) -> str:
    params = inspect.signature(model.base_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class BlockPass:
    """One forward pass over several requests' blocks of rows (hidden_blocks). It stands in for both the
    cache and the attention mask the model is given: `update` hands each block's new keys and values to its
    own request's cache, and `block_attention` attends each block over that cache with its own mask, so no
    row ever computes scores for another request's positions (a joint cache with a block-diagonal mask
    would, at a cost that grows with every request's context)."""

    def __init__(self, caches: list[DynamicCache], sizes: list[int],
                 masks: list[torch.Tensor],  # per block [1, 1, n_b, past_b + n_b] additive
                 inner: Callable):
        self.caches, self.masks, self.inner = caches, masks, inner
        ends = np.cumsum(sizes).tolist()
        self.rows = list(zip([0] + ends[:-1], ends))

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        for cache, (a, b) in zip(self.caches, self.rows):  # keys, values: [1, kv heads, rows, head dim]
            cache.update(keys[..., a:b, :], values[..., a:b, :], layer_idx)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; no joint cache exists


def block_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function of a `BlockPass` (registered as BLOCK_ATTENTION): the model's own attention
    implementation, once per block, over that block's cache. query: [1, heads, rows, head dim] -> output
    [1, rows, heads, head dim]. The model hands its keyword arguments down to here, the pass among them
    (BLOCKS_KWARG)."""
    blocks = kwargs.pop(BLOCKS_KWARG, None)
    if not isinstance(blocks, BlockPass):
        raise TypeError(f"{type(module).__module__} does not pass its keyword arguments to attention: "
                        "block attention runs only inside CausalLM.hidden_blocks")
    outs = []
    for cache, (a, b), mask in zip(blocks.caches, blocks.rows, blocks.masks):
        layer = cache.layers[module.layer_idx]
        if b - a <= SMALL_BLOCK:
            out = small_block_attention(query[:, :, a:b], layer.keys, layer.values, mask, kwargs["scaling"])
        else:
            out, _ = blocks.inner(module, query[:, :, a:b], layer.keys, layer.values, mask, **kwargs)
        outs.append(out)  # [1, n_b, heads, head dim]
    return torch.cat(outs, dim=1), None


# Blocks of up to this many rows (plain steps, small trees) attend by two grouped fp32 matmuls. torch's fused
# CPU attention costs about 0.35 ms for one bf16 row over 250 cached positions and 1.3-1.9 ms over 1,000
# (measured on a Zen 4 EPYC, 2 threads); the matmuls 0.1 and 0.2 ms, with the scores and softmax in fp32.
SMALL_BLOCK = 16


def small_block_attention(
    query: torch.Tensor,  # [1, heads, m, head dim]
    keys: torch.Tensor,  # [1, kv heads, L, head dim]
    values: torch.Tensor,  # [1, kv heads, L, head dim]
    mask: torch.Tensor,  # [1, 1, m, L] additive
    scaling: float,
) -> torch.Tensor:  # [1, m, heads, head dim], query's dtype
    """Attention of a few rows, grouped-query without copying keys: each key/value head's group of query
    heads is one matmul."""
    _, heads, m, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = query[0].reshape(kv_heads, group * m, dim).float()
    scores = torch.matmul(q, keys[0].float().transpose(1, 2)).mul_(scaling)  # [kv heads, group * m, L]
    scores = scores.view(kv_heads, group, m, length).add_(mask[0, 0].float()).view(kv_heads, group * m, length)
    out = torch.bmm(scores.softmax(dim=-1), values[0].float())  # [kv heads, group * m, head dim]
    return out.view(heads, m, dim).transpose(0, 1)[None].to(query.dtype)


BLOCK_ATTENTION, BLOCKS_KWARG = "treegraft-blocks", "treegraft_blocks"
_NO_MASK = torch.zeros((1, 1, 1, 1))  # a 4D mask is passed through as given, and block attention ignores it
AttentionInterface.register(BLOCK_ATTENTION, block_attention)


def _eager_attention(base: PreTrainedModel) -> Callable:
    """The model's own eager attention (transformers keeps it in each model's module, not in the registry)."""
    return sys.modules[type(base).__module__].eager_attention_forward


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
        self.draft_head = None  # callable [n, hidden] -> [n, V'] over draft_vocab
        self.head_table = None  # the head's rows in an exact compact form, where its dense weight went (compact_tables)
        if self.device.type == "cpu":
            os.environ.setdefault(SDPA_GQA_ENV, "1")  # =0 keeps transformers' copies
        elif self.device.type == "cuda" and os.environ.get(CUDNN_SDPA_ENV) != "1":
            torch.backends.cuda.enable_cudnn_sdp(False)  # process-wide: torch has no per-module switch

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

    def compact_tables(self, folder: str | None = None) -> int:
        """On a CPU in fp32, once the linears run packed or compact: keep the input embedding and the output
        head's rows (which drafting gathers: `head_rows`) in an exact compact form where one exists (16-bit
        values, or the int8 groups prepare.py kept in the model's `folder`), in place of their dense fp32
        copies. Returns the bytes given back (0.64 GB each for the embedded target's, 0.39 GB each for its
        middle drafter's). Weights are final afterwards."""
        from . import compact

        if self.device.type != "cpu" or self.dtype != compact.DTYPE or not (self.packed or self.compact):
            return 0
        embedding = self.model.get_input_embeddings()

        def exact_rows(weight: torch.Tensor) -> compact.RowTable | None:
            # one weight's groups at a time, each dense copy given back before the next is read
            wanted = {compact.fingerprint(weight.detach()[0])}
            groups = {} if folder is None else compact.load_groups(folder, only=wanted)
            form = compact.exact_form(weight, groups)
            return None if form is None else compact.RowTable(form)

        saved, rows = 0, None
        with torch.no_grad():
            dense = getattr(embedding, "weight", None)
            tied = dense is not None and getattr(self.head, "weight", None) is dense
            # exactly nn.Embedding: a subclass may compute more than a lookup (a scaled embedding)
            if type(embedding) is torch.nn.Embedding and embedding.max_norm is None:
                rows = exact_rows(dense)
                if rows is not None:
                    self.model.set_input_embeddings(compact.CompactEmbedding(rows))
                    saved += dense.numel() * dense.element_size() - rows.nbytes
            del embedding, dense  # the dense embedding goes now (unless it stays, or the head shares it)
            weight = getattr(self.head, "weight", None)
            if weight is None or (tied and rows is None):  # a head tied to a dense embedding reads its rows
                return saved
            if tied:  # the embedding's table serves the head's rows too
                table = rows
            elif isinstance(self.head, compact.CompactLinear):  # its form is kept already
                table = compact.RowTable(self.head.form)
                saved += weight.numel() * weight.element_size()
            else:
                table = exact_rows(weight)
                if table is None:
                    return saved
                saved += weight.numel() * weight.element_size() - table.nbytes
            self.head.weight = None
            self.head_table = table
        return saved

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, hidden]
        """Rows of the output head's weight (exact: from its dense copy, or its compact table)."""
        weight = getattr(self.head, "weight", None)
        return weight[ids] if weight is not None else self.head_table[ids]

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
    def hidden_blocks(
        self,
        caches: list[DynamicCache],
        input_ids: list[torch.Tensor],  # per block [n_b] int64
        positions: list[torch.Tensor],  # per block [n_b] int64
        attends: list[torch.Tensor | None],  # per block as `hidden` takes it
    ) -> torch.Tensor:  # [sum n_b, hidden]
        """Several requests' blocks in one pass, each over its own cache: the linear layers run on all rows
        at once, attention block by block (`BlockPass`), and each block's keys and values go to its own cache.
        Every block's attention is exactly what `hidden` computes for it alone: same inputs, same mask."""
        inner = self.model.config._attn_implementation
        masks = [self._additive_mask(len(ids), cache_len(c), a)[None, None]
                 for c, ids, a in zip(caches, input_ids, attends)]
        blocks = BlockPass(caches, [len(ids) for ids in input_ids], masks,
                           ALL_ATTENTION_FUNCTIONS.get_interface(inner, _eager_attention(self.base)))
        self.model.config._attn_implementation = BLOCK_ATTENTION
        try:
            out = self.base(input_ids=torch.cat(input_ids).to(self.device)[None],
                            position_ids=torch.cat(positions).to(self.device)[None],
                            **{self._cache_kw: blocks, BLOCKS_KWARG: blocks}, use_cache=True,
                            attention_mask=_NO_MASK)  # the masks are the blocks' own, in `blocks`
        finally:
            self.model.config._attn_implementation = inner
        return out.last_hidden_state[0]

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
        The mask is explicit but for a causal block over an empty cache (a prompt). On a CPU a block of up to
        SMALL_BLOCK rows (a plain step, a small tree) attends as a batched pass's blocks do
        (`small_block_attention`: 137 against 144 ms for a one-token step of the 1.5B target over 250 cached
        tokens, 144 against 177 over 1,000).
        """
        if self.device.type == "cpu" and len(input_ids) <= SMALL_BLOCK:
            return self.hidden_blocks([cache], [input_ids], [positions], [attend])
        past = cache_len(cache)
        if attend is None and past == 0:  # a whole prompt: the model's own causal path, which runs attention as
            mask = None  # causal without a mask tensor (the same numbers, 2% faster over 709 tokens on a CPU)
        else:
            mask = self._additive_mask(len(input_ids), past, attend)[None, None]
        kwargs = {self._cache_kw: cache, "use_cache": True, "attention_mask": mask}
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
            extra_rows = self.head_rows(extra)  # [E, hidden]: a small gather, not a second packed head
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
        if self.draft_head is None:
            return self.logits(hidden)
        with torch.inference_mode():
            return self.draft_head(hidden).float()

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
        w = self.head_rows(tokens.to(self.device))
        out = (hidden * w).sum(-1)
        if getattr(self.head, "bias", None) is not None:
            out = out + self.head.bias[tokens.to(self.device)]
        return out.float()


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def compact_cache(cache: DynamicCache, start: int, slots: torch.Tensor) -> None:
    """Keep cache positions [0, start) followed by `slots` ([m] int64, ascending, all >= start); drop the rest."""
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
