"""The target side: prefill, one tree-attention verification pass per round, and acceptance.

Per round the verifier sees the pruned tree. Of its nodes, the *accepted* ones form the longest
root-to-node path the target agrees with; the *bonus* token is the target's own pick after the last
accepted node. Greedy: a child is accepted when its token is the target's argmax at its parent. With
temperature > 0: recursive rejection sampling over siblings, exact for deterministic proposals (every
drafter here proposes deterministically), so the output distribution equals the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from ..models.hf import CausalLM, cache_len, compact_cache
from .ngram import PrefillCache
from .sampling import SamplingParams, next_token, sample, target_probs
from .tree import DraftTree

PREFILL_TOPK = 10
# The prompt's last positions whose top-k scores prefill stores for the n-gram drafter (0: every position). The
# scores cost an output-head pass over those rows: 0.25-0.4 s for a 709-token prompt of the 1.5B target on a
# 2-core CPU, 5-8% of its prefill. Kept to the last 256, the n-gram drafter scores a match earlier in the prompt
# as it scores generated text; the 18 prompts of the 18 x 128 run took the same rounds either way.
PREFILL_SCORE_WINDOW = 256
_PREFILL_CHUNK = 256  # rows of vocabulary-sized logits materialised at once


@dataclass
class Verdict:
    accepted: list[int]  # node ids of the pruned tree, root excluded, root-to-leaf order
    tokens: list[int]  # their tokens followed by the bonus token: what the context grows by


def tree_attention(
    tree: DraftTree, past: int
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, n] bool, [n] int64)
    """Mask of the tree block and positions for a whole tree appended after `past` cached tokens: each
    node sees the whole cache (CausalLM.hidden's block-only mask) and its own ancestors; a node's
    position is past + depth."""
    n = tree.size
    return torch.from_numpy(tree.ancestor_mask()), torch.from_numpy(tree.depths[:n] + past)


@dataclass
class Block:
    """One request's rows in a target pass: the tokens it appends to its KV cache, their positions, and
    which of them each row sees (every row sees the request's whole cache)."""

    cache: DynamicCache
    ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    attend: torch.Tensor | None  # [n, n] bool; None = causal


def forward_blocks(lm: CausalLM, blocks: list[Block]) -> list[torch.Tensor]:  # [n_b, hidden] per block
    """One target pass over several requests' blocks, each over its own KV cache: the linear layers see every
    row at once, attention runs per block over its own cache and mask (CausalLM.hidden_blocks). Each cache
    then holds its block's keys and values, as if its block had run alone."""
    if len(blocks) == 1:
        b = blocks[0]
        return [lm.hidden(b.cache, b.ids, b.positions, b.attend)]
    h = lm.hidden_blocks([b.cache for b in blocks], [b.ids for b in blocks], [b.positions for b in blocks],
                         [b.attend for b in blocks])
    return list(torch.split(h, [len(b.ids) for b in blocks]))


class TargetVerifier:
    """Holds the target's KV cache (always the context minus its last token, the next root).

    Each kind of pass comes in two halves, so that several requests' passes can run as one
    (`forward_blocks`): `*_block` gives the rows to run, `*_done` reads the result."""

    def __init__(self, lm: CausalLM, sampling: SamplingParams, generator: torch.Generator | None = None):
        self.lm = lm
        self.sampling = sampling
        self.generator = generator
        self.cache = lm.new_cache()
        self._prefill_rows: list = []  # a chunked prefill's top-k rows so far

    # -- one request at a time ------------------------------------------------------------------------
    def prefill(self, prompt: list[int], want_prefill_cache: bool = True) -> tuple[int, PrefillCache | None]:
        """Process the prompt; return the first generated token and the top-k prefill cache."""
        block = self.prefill_block(prompt, 0, len(prompt))
        return self.prefill_done(forward_blocks(self.lm, [block])[0], prompt, 0, want_prefill_cache)

    def step(self, token: int) -> int:
        """Plain decoding: feed one token, return the next (the autoregressive baseline)."""
        return self.step_done(self.lm.logits(forward_blocks(self.lm, [self.step_block(token)])[0]))

    def verify(self, tree: DraftTree) -> Verdict:
        """One target pass over the pruned tree; keeps the KV entries of the accepted path only."""
        return self.verify_done(tree, self.lm.logits(forward_blocks(self.lm, [self.verify_block(tree)])[0]))

    # -- the halves -----------------------------------------------------------------------------------
    def prefill_block(self, prompt: list[int], start: int, end: int) -> Block:
        """Prompt positions [start, end); the first chunk (start 0) starts a new cache."""
        if start == 0:
            self.cache = self.lm.new_cache()
            self._prefill_rows = []
        return Block(self.cache, torch.tensor(prompt[start:end], dtype=torch.int64), torch.arange(start, end), None)

    def prefill_done(self, h: torch.Tensor, prompt: list[int], start: int, want_prefill_cache: bool,
                     last_logits: torch.Tensor | None = None,  # [1, vocab] of h's last row, when computed already
                     ) -> tuple[int, PrefillCache | None] | None:
        """After a chunk's pass (`h`: its [end - start, hidden] rows): None until the last chunk, then (first
        token, prefill cache or None)."""
        end = start + len(h)
        first_scored = max(0, len(prompt) - PREFILL_SCORE_WINDOW) if PREFILL_SCORE_WINDOW else 0
        if want_prefill_cache and end > first_scored:  # a drafting aid: over the draft vocabulary, not the whole one
            _, tokens, logprobs = self.lm.top_logprobs(h[max(0, first_scored - start):], PREFILL_TOPK,
                                                       _PREFILL_CHUNK, extra=self.lm.outside_draft_vocab(prompt))
            self._prefill_rows.append((tokens, logprobs))
        if end < len(prompt):
            return None
        if last_logits is None:
            last_logits = self.lm.logits(h[-1:])
        first = next_token(last_logits[0], self.sampling, self.generator)
        rows, self._prefill_rows = self._prefill_rows, []
        if not want_prefill_cache:
            return first, None
        return first, PrefillCache(np.concatenate([t for t, _ in rows]), np.concatenate([lp for _, lp in rows]),
                                   first_scored)

    def step_block(self, token: int) -> Block:
        past = cache_len(self.cache)
        return Block(self.cache, torch.tensor([token]), torch.tensor([past]), None)

    def step_done(self, logits: torch.Tensor) -> int:  # [1, vocab]
        return next_token(logits[0], self.sampling, self.generator)

    def verify_block(self, tree: DraftTree) -> Block:
        attend, positions = tree_attention(tree, cache_len(self.cache))
        return Block(self.cache, torch.from_numpy(tree.token_list().copy()), positions, attend)

    def verify_done(self, tree: DraftTree, logits: torch.Tensor) -> Verdict:  # [tree size, vocab]
        if self.sampling.greedy:
            verdict = _accept_greedy(tree, torch.argmax(logits, dim=-1).tolist())
        else:
            verdict = _accept_sampled(tree, target_probs(logits, self.sampling), self.generator)
        past = cache_len(self.cache) - tree.size
        slots = torch.tensor([past] + [past + i for i in verdict.accepted], dtype=torch.int64)
        compact_cache(self.cache, past, slots)
        return verdict


def _accept_greedy(tree: DraftTree, argmax: list[int]) -> Verdict:
    accepted, node = [], 0
    while (child := tree.child(node, argmax[node])) is not None:
        accepted.append(child)
        node = child
    tokens = [int(tree.tokens[i]) for i in accepted] + [argmax[node]]
    return Verdict(accepted, tokens)


def _children_ranked(tree: DraftTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for i in tree.ranked(np.arange(1, tree.size)):
        kids[int(tree.parents[i])].append(int(i))
    return kids


def _accept_sampled(
    tree: DraftTree,
    probs: torch.Tensor,  # [n, vocab] fp32, row i: the target's distribution after node i
    generator: torch.Generator | None,
) -> Verdict:
    """Recursive rejection sampling: at each node try its children best-first; a child is accepted
    with its probability under the residual distribution, otherwise removed from it. The bonus token
    is drawn from the residual at the last accepted node.

    Every proposal is deterministic, so after rejecting the tokens R at a node the residual is its row
    less R, renormalised: p(token) / (1 - p(R)). The walk then needs only each node's probability under
    its parent's row; those and one uniform per node reach the host in one copy, and the bonus token is
    drawn on the device: two synchronisations a round instead of one per child tried."""
    n = tree.size
    kids = _children_ranked(tree)
    parents = torch.from_numpy(tree.parents[1:n]).to(probs.device)
    tokens = torch.from_numpy(tree.tokens[1:n]).to(probs.device)
    uniform = torch.rand(n - 1, generator=generator, device=probs.device)
    # [2, n - 1]: node i's probability under its parent's row and its uniform, at i - 1
    p, u = torch.stack([probs[parents, tokens], uniform]).double().cpu().numpy()
    accepted, node = [], 0
    while True:
        mass, rejected = 1.0, []  # the residual's mass before renormalising, the tokens taken out of it
        for child in kids[node]:
            if u[child - 1] * mass < p[child - 1]:
                break
            mass -= p[child - 1]
            rejected.append(int(tree.tokens[child]))
        else:
            residual = probs[node]
            if rejected:
                residual = residual.clone()
                residual[rejected] = 0.0
            tokens = [int(tree.tokens[i]) for i in accepted] + [sample(residual, generator)]
            return Verdict(accepted, tokens)
        accepted.append(child)
        node = child
