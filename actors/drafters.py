"""Drafters as actors: one host actor holds a drafter per in-flight request, and client-side proxies
speak the `Drafter` protocol, so the engine's own `draft_tree` drives them unchanged.

Messages: prompts and accepted token ids in, the tree (plain arrays) in, a `Proposal` (plain arrays) out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from treegraft_dist.budget import forward_ms
from treegraft_dist.models import load_model
from treegraft_dist.neural import NeuralDrafter
from treegraft_dist.ngram import NGramDrafter, PrefillCache
from treegraft_dist.tree import DraftTree, Proposal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NGramSpec:
    top_k: int
    max_n: int
    chain: int
    depth: int
    long_chain: int

    def load(self, device: str):
        return None

    def new(self, lm) -> NGramDrafter:
        return NGramDrafter(self.top_k, self.max_n, self.chain, self.depth, self.long_chain)


@dataclass(frozen=True)
class NeuralSpec:
    path: str  # a saved model folder: weights never cross the object store
    dtype: str
    top_k: int
    lookback: int

    def load(self, device: str):
        return load_model(self.path, device, self.dtype, drafter=True).lm

    def new(self, lm) -> NeuralDrafter:
        return NeuralDrafter(lm, self.top_k, self.lookback)


class DrafterHost:
    """Actor: one drafter of one kind (`spec`) per request id; a thin shell over the plain class."""

    def __init__(self, spec, device: str = "cpu", threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.lm = spec.load(device)
        self.drafters: dict[int, object] = {}

    def ready(self) -> bool:
        return True

    def start(self, rid: int, prompt: list[int], prefill: PrefillCache | None) -> None:
        d = self.drafters[rid] = self.spec.new(self.lm)
        d.start(prompt, prefill)

    def step(self, rid: int, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        return self.drafters[rid].step(tree, frontier, layer)

    def accept(self, rid: int, path: list[int], tokens: list[int]) -> None:
        self.drafters[rid].accept(path, tokens)

    def prefetch(self, rid: int, root: int) -> None:
        """Run the neural drafter over the context it lags behind plus the new root now, while the
        coordinator takes the round's first n-gram steps; its next step then only sees new nodes."""
        self.drafters[rid].prefetch(root)

    def release(self, rid: int) -> None:
        self.drafters.pop(rid, None)

    def forward_ms(self, block: int) -> float:
        return forward_ms(self.lm, block, drafting=True)


class RemoteDrafter:
    """Client side of one request on a DrafterHost: `step` waits for the proposal, `start`, `accept`
    and `prefetch` only enqueue (actor calls from one caller run in order, so the next step sees them)."""

    def __init__(self, host, rid: int, origin: int):
        self.host = host
        self.rid = rid
        self.origin = origin

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        self.host.start.remote(self.rid, prompt, prefill)

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        return ray.get(self.host.step.remote(self.rid, tree, frontier, layer))

    def accept(self, path: list[int], tokens: list[int]) -> None:
        self.host.accept.remote(self.rid, path, tokens)

    def prefetch(self, root: int) -> None:
        self.host.prefetch.remote(self.rid, root)

    def release(self) -> None:
        self.host.release.remote(self.rid)


class FallbackDrafter:
    """The middle drafter of one request, which never fails the request: once its actor is gone every
    step is answered by the n-gram drafter instead (verification is lossless whoever drafts, so the
    output is unchanged) and `on_death` is told once, so the owner can restart the actor. With
    `prefetch`, every accept is followed by the catch-up call (useless when layer 1 calls the middle
    drafter anyway: it would only split that call in two)."""

    def __init__(self, remote: RemoteDrafter, fallback, on_death, prefetch: bool = True):
        self.remote = remote
        self.prefetch = prefetch
        self.origin = remote.origin
        self.fallback = fallback
        self.on_death = on_death
        self.alive = True
        self.fallback_steps = 0  # steps the n-gram drafter answered in the middle drafter's place

    def start(self, prompt, prefill) -> None:
        self.remote.start(prompt, prefill)

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        if self.alive:
            try:
                return self.remote.step(tree, frontier, layer)
            except RayActorError as e:
                self.alive = False
                log.warning("middle drafter died (%s); request %d continues with n-gram drafting",
                            type(e).__name__, self.remote.rid)
                self.on_death(self.remote.host)
        self.fallback_steps += 1
        return self.fallback.step(tree, frontier, layer)

    def accept(self, path, tokens) -> None:
        if self.alive:
            self.remote.accept(path, tokens)
            if self.prefetch:
                self.remote.prefetch(tokens[-1])

    def release(self) -> None:
        if self.alive:
            self.remote.release()
