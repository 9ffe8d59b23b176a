"""The interface every drafter speaks, so one round loop drives any of them (in-process or remote)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .ngram import PrefillCache
from .tree import DraftTree, Proposal


class Drafter(Protocol):
    origin: int  # ORIGIN_NGRAM or ORIGIN_MIDDLE: the tree records which drafter added a node
    # False once the drafter is gone for this request (its actor died): later rounds leave it out. An
    # in-process drafter is always alive.
    alive: bool
    # Steps another drafter answered in its place since the request started (its actor was gone): a layer
    # drafted that way is not counted as this drafter's call. 0 for an in-process drafter.
    fallback_steps: int

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        """Begin a request: forget the previous one."""

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        """Propose nodes for 1-based drafting `layer`, expanding `frontier` ([<= K] node ids); never mutates
        `tree`."""

    def accept(self, path: list[int], tokens: list[int]) -> None:
        """End of a round: `path` = accepted node ids of the round's tree (root first; empty after the
        prefill), `tokens` = what the context grew by (accepted tokens, then the bonus token)."""

    def release(self) -> None:
        """End of the request: free what is held for it (nothing, in process: `start` forgets it anyway)."""
