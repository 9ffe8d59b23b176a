"""Typed, validated settings of the decoding engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TreeConfig:
    """depth D drafting layers; top_k K children per expanded node and frontier size; lookback L of the
    expanded candidate pool; budget = nodes verified per round (root included); max_n = longest n-gram
    matched; chain = extra tokens the best n-gram match adds below its child; long_chain = tokens the
    best match may add at a round's first n-gram layer past the depth the layers reach (0: the published
    settings; see ngram.py); call_budget = most middle calls per round within its `depth` layers (None: no
    limit beyond the schedule); deepen = middle layers a round may draft past `depth` while the middle
    drafter is sure enough that one more layer pays for its call (engine.deepening; 0: the published
    settings); deepen_cost = a middle call's time over a target pass's, deepen_row_cost = what each node the
    middle drafter has not read adds to a deepening call (a token of its read over a target pass; both set from
    the engine's measured timings, round_config); middle_window = most prompt tokens the middle drafter reads,
    the last ones (0: the whole prompt, the published settings; see neural.py); pin_match = a long chain behind
    a match of at least this many tokens (a copy) is verified ahead of the nodes ranked by score (0: none;
    ngram.py)."""

    depth: int = 5
    top_k: int = 10
    lookback: int = 5
    budget: int = 64
    max_n: int = 5
    chain: int = 4
    long_chain: int = 12
    call_budget: int | None = None
    deepen: int = 4
    deepen_cost: float | None = None
    deepen_row_cost: float = 0.0
    middle_window: int = 256
    pin_match: int = 2

    def __post_init__(self):
        for name in ("depth", "top_k", "budget", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("lookback", "chain", "long_chain", "deepen", "middle_window", "pin_match"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.call_budget is not None and self.call_budget < 0:
            raise ValueError(f"call_budget must be >= 0 or None, got {self.call_budget}")
        if self.deepen_cost is not None and not self.deepen_cost > 0:
            raise ValueError(f"deepen_cost must be > 0 or None, got {self.deepen_cost}")
        if not self.deepen_row_cost >= 0:
            raise ValueError(f"deepen_row_cost must be >= 0, got {self.deepen_row_cost}")

    @property
    def max_tree_depth(self) -> int:
        """Deepest node a round can create: each 1-based layer l adds one level plus an n-gram chain of
        at most min(chain, depth - l) further tokens, one layer of a round at most long_chain (ngram.py);
        each deepening layer adds one level."""
        chains = [min(self.chain, self.depth - layer) for layer in range(1, self.depth + 1)]
        return sum(1 + c for c in chains) + max(0, self.long_chain - min(chains)) + self.deepen

    def middle_reads(self, prompt_len: int) -> int:
        """Prompt tokens the middle drafter reads before its first call of a request."""
        return min(prompt_len, self.middle_window) if self.middle_window else prompt_len

    def to_dict(self) -> dict:
        return asdict(self)
