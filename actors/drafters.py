"""Drafters as actors: one host actor holds a drafter per in-flight request, and client-side proxies
speak the `Drafter` protocol (decoding/drafter.py), so the engine's own round loop drives them unchanged.

The n-gram host also runs the request's schedule: `RoundDrafter` has it draft every n-gram layer between two
middle calls, with the scheduler's decisions, in one actor call (an n-gram step costs well under the ~1 ms of
a call), and drafts the middle's layers itself.

Messages: prompts and accepted token ids in, the tree (plain arrays) in, a `Proposal` (plain arrays) or the
round's drafting so far (`engine.Drafting`) out.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import forward_ms
from treegraft_dist.decoding.engine import Drafting, deepening, draft_layer, draft_layers
from treegraft_dist.decoding.neural import NeuralDrafter
from treegraft_dist.decoding.ngram import HistoryIndex, NGramDrafter, PrefillCache
from treegraft_dist.decoding.schedule import SchedulePolicy
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import DraftTree, Proposal
from treegraft_dist.models.loading import load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NGramSpec:
    top_k: int
    max_n: int
    chain: int
    depth: int
    long_chain: int
    history_tokens: int = 0  # > 0: the host keeps a HistoryIndex of finished requests this big
    pin_match: int = 2  # TreeConfig.pin_match

    def load(self, device: str):
        return None

    def new(self, lm) -> NGramDrafter:
        return NGramDrafter(self.top_k, self.max_n, self.chain, self.depth, self.long_chain, pin_match=self.pin_match)

    def history(self) -> HistoryIndex | None:
        return HistoryIndex(self.history_tokens, self.max_n) if self.history_tokens > 0 else None


@dataclass(frozen=True)
class NeuralSpec:
    path: str  # a saved model folder: weights never cross the object store
    dtype: str
    top_k: int
    lookback: int
    window: int = 0  # TreeConfig.middle_window

    def load(self, device: str):
        return load_model(self.path, device, self.dtype, drafter=True).lm

    def new(self, lm) -> NeuralDrafter:
        return NeuralDrafter(lm, self.top_k, self.lookback, self.window)


@dataclass(frozen=True)
class RoundSpec:
    """What the n-gram host needs to draft a request's n-gram layers and decide its middle calls."""

    cfg: TreeConfig
    policy: SchedulePolicy
    context: np.ndarray | None  # [4] context signals, when the policy reads signals
    # Draft from the host's history too. Greedy requests only: a sampled request's output for a seed depends on
    # the drafts it verifies, and the same seed must give the same text whatever earlier requests left there.
    history: bool = True
    # The name the host holds `policy` by (DrafterHost's `policies`): then only the name travels, not the policy
    # (a fitted scheduler carries its weights and value heads: over 100 kB a request).
    policy_name: str | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.policy_name is not None:
            state["policy"] = None
        return state


class DrafterHost:
    """Actor: one drafter of one kind (`spec`) per request id; a thin shell over the plain class."""

    def __init__(self, spec, device: str = "cpu", threads: int | None = None, policies: dict | None = None):
        """`policies`: the schedule policies requests may name (RoundSpec.policy_name)."""
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.policies = policies or {}
        self.lm = spec.load(device)
        self.drafters: dict[int, object] = {}
        self.rounds: dict[int, RoundSpec] = {}
        # The n-gram host's memory of finished requests (prompt and output), which its drafters also match.
        self.history = spec.history() if isinstance(spec, NGramSpec) else None

    def ready(self) -> bool:
        return True

    def start(self, rid: int, prompt: list[int], prefill: PrefillCache | None, rounds: RoundSpec | None = None) -> None:
        d = self.drafters[rid] = self.spec.new(self.lm)
        if self.history is not None and (rounds is None or rounds.history):
            d.history = self.history
        d.start(prompt, prefill)
        if rounds is not None:
            if rounds.policy is None:  # sent by name: the request's own copy (Coordinator.resolve_policy)
                rounds = replace(rounds, policy=copy.copy(self.policies[rounds.policy_name]))
            self.rounds[rid] = rounds

    def draft(self, rid: int, state: Drafting, budgets: tuple[int, ...], has_middle: bool
              ) -> tuple[Drafting, str | None]:
        """Draft `state`'s layers with this request's drafter and schedule until the middle drafter's turn
        (then "middle") or the round's end (None); see engine.draft_layers."""
        r, state = self.rounds[rid], state.own()
        timer = PhaseTimer(RequestStats("actor"))  # the caller times the whole call
        return state, draft_layers(state, r.cfg, r.policy, self.drafters[rid], None, timer, r.context, budgets,
                                   has_middle=has_middle)

    def step(self, rid: int, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        return self.drafters[rid].step(tree, frontier, layer)

    def accept(self, rid: int, path: list[int], tokens: list[int]) -> None:
        self.drafters[rid].accept(path, tokens)

    def prefetch(self, rid: int, root: int) -> None:
        """Run the neural drafter over the context it lags behind plus the new root now, while the
        coordinator takes the round's first n-gram steps; its next step then only sees new nodes."""
        self.drafters[rid].prefetch(root)

    def release(self, rid: int) -> None:
        d = self.drafters.pop(rid, None)
        self.rounds.pop(rid, None)
        if self.history is not None and d is not None:
            self.history.add(d.index.tokens)  # the prompt and every token the target accepted

    def remember(self, tokens: list[int]) -> None:
        """A finished request's text (prompt and output) that never drafted here: the history keeps it as it
        keeps a released drafter's (RemoteDrafter's `lazy`)."""
        if self.history is not None:
            self.history.add(tokens)

    def history_state(self) -> dict:
        """Sequences and tokens the history holds (0 and 0 without one)."""
        h = self.history
        return {"sequences": 0 if h is None else len(h), "tokens": 0 if h is None else h.tokens}

    def forward_ms(self, block: int) -> float:
        return forward_ms(self.lm, block, drafting=True)


class RemoteDrafter:
    """Client side of one request on a DrafterHost: `step` waits for the proposal, `start`, `accept`
    and `prefetch` only enqueue (actor calls from one caller run in order, so the next step sees them).
    A wait longer than `timeout_s` raises GetTimeoutError, which its FallbackDrafter takes as the actor's
    death (a stuck actor is replaced as a dead one is)."""

    alive = True  # as far as it knows: a call to a dead actor raises, and its FallbackDrafter takes over
    fallback_steps = 0

    def __init__(self, host, rid: int, origin: int, rounds: RoundSpec | None = None, timeout_s: float | None = None,
                 lazy: bool = False, remember: bool = False):
        """`lazy`: the host hears of the request only when it is first asked to draft or catch up (its start and
        the tokens accepted until then go first, in one accept: the same state, as a drafter before its first
        step holds only the context). A request that never drafts with it (plain steps under load, or a
        request that Payoff keeps from the middle drafter) costs the host nothing: on shared cores its work
        would run beside the target's passes and slow them. `remember`: such a request's text still goes to
        the host at its end, in one message, for the history it keeps (DrafterHost.remember)."""
        self.host = host
        self.rid = rid
        self.origin = origin
        self.rounds = rounds
        self.timeout_s = timeout_s
        self.lazy = lazy
        self.remember = remember
        self._pending: tuple[list[int], PrefillCache | None, list[int]] | None = None  # prompt, prefill, tokens

    def start(self, prompt: list[int], prefill: PrefillCache | None) -> None:
        if self.lazy:
            self._pending = (prompt, prefill, [])
            return
        self.host.start.remote(self.rid, prompt, prefill, self.rounds)

    def begin(self) -> None:
        """Tell the host of the request now, if it has not heard of it (`lazy`)."""
        if self._pending is not None:
            prompt, prefill, tokens = self._pending
            self._pending = None
            self.host.start.remote(self.rid, prompt, prefill, self.rounds)
            if tokens:
                self.host.accept.remote(self.rid, [], tokens)

    @property
    def started(self) -> bool:
        """Whether the host has heard of the request."""
        return self._pending is None

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        self.begin()
        return ray.get(self.host.step.remote(self.rid, tree, frontier, layer), timeout=self.timeout_s)

    def accept(self, path: list[int], tokens: list[int]) -> None:
        if self._pending is not None:
            self._pending[2].extend(tokens)
            return
        self.host.accept.remote(self.rid, path, tokens)

    def prefetch(self, root: int) -> None:
        self.begin()
        self.host.prefetch.remote(self.rid, root)

    def release(self) -> None:
        if self._pending is not None:  # never started there: nothing to free, the text to remember at most
            prompt, _, tokens = self._pending
            self._pending = None
            if self.remember:
                self.host.remember.remote(list(prompt) + tokens)
            return
        self.host.release.remote(self.rid)


class FallbackDrafter:
    """One request's drafter on an actor, which never fails the request: once the actor is gone every
    step is answered by `fallback` instead (verification is lossless whoever drafts, so the output is
    unchanged) and `on_death` is told once, so the owner can restart the actor.

    The middle drafter falls back on the request's n-gram drafter. The n-gram drafter falls back on a copy
    of itself in the caller's process (`mirror`: it is started and told every accepted token as the actor
    is, so it can take over at any step; an n-gram step is cheap). With `prefetch`, every accept is followed
    by the catch-up call (useless when layer 1 calls the middle drafter anyway: it would only split that
    call in two)."""

    def __init__(self, remote: RemoteDrafter, fallback, on_death, prefetch: bool = False, mirror: bool = False):
        self.remote = remote
        self.prefetch = prefetch
        self.mirror = mirror
        self.origin = remote.origin
        self.fallback = fallback
        self.on_death = on_death
        self.alive = True
        self.fallback_steps = 0  # steps the fallback answered in the actor's place

    def start(self, prompt, prefill) -> None:
        if self.mirror:
            self.fallback.start(prompt, prefill)
        self.remote.start(prompt, prefill)

    def step(self, tree: DraftTree, frontier: np.ndarray, layer: int) -> Proposal:
        if self.alive:
            try:
                return self.remote.step(tree, frontier, layer)
            except (RayActorError, GetTimeoutError) as e:
                self.died(e)
        self.fallback_steps += 1
        return self.fallback.step(tree, frontier, layer)

    def died(self, e: Exception) -> None:
        """The actor is gone: answer from the fallback from now on and tell the owner."""
        self.alive = False
        log.warning("a drafter actor died (%s); request %d continues with %s", type(e).__name__,
                    self.remote.rid, "its local n-gram drafter" if self.mirror else "n-gram drafting")
        self.on_death(self.remote.host)

    def accept(self, path, tokens) -> None:
        if self.mirror:
            self.fallback.accept(path, tokens)
        if self.alive:
            self.remote.accept(path, tokens)
            if self.prefetch:
                self.remote.prefetch(tokens[-1])

    def release(self) -> None:
        if self.alive:
            self.remote.release()


class RoundDrafter:
    """`draft(root, budgets)` for engine.speculate on actors, in as few actor calls as the schedule allows:
    the n-gram host drafts every n-gram layer up to the next middle call in one call (`DrafterHost.draft`),
    the middle drafter's layers are drafted from here, and for a `stateless` policy the layers after a
    middle call are decided here too (a fixed all-mid round then costs its five middle calls and nothing
    more). Once the n-gram actor is gone, the n-gram drafter's local mirror drafts its layers here."""

    def __init__(self, ngram: FallbackDrafter, middle: FallbackDrafter | None, timer: PhaseTimer):
        if ngram.remote.rounds is None or not ngram.mirror:
            raise ValueError("RoundDrafter needs the n-gram drafter's RoundSpec and a local mirror")
        self.ngram, self.middle, self.timer = ngram, middle, timer
        self.middle_on = True  # False: this round is drafted without the middle drafter (sizing.Payoff)
        self.spec = ngram.remote.rounds
        self.decide_here = getattr(self.spec.policy, "stateless", False)
        # Its first layer is decided where the n-gram drafter and the history are (draft_layers).
        self.first_here = self.decide_here and not getattr(self.spec.policy, "copies_first", False)

    def __call__(self, root: int, budgets: tuple[int, ...]) -> tuple[DraftTree, list[bool]]:
        r, state = self.spec, Drafting.new(root)
        wanted = "ngram"  # the first layer: decided on the n-gram host ...
        if self.first_here and self.ngram.alive:  # ... or here, where a middle layer would be drafted anyway
            wanted = self._decide_here(state, budgets)
        while wanted is not None:
            if not self.ngram.alive:  # everything here, with the local n-gram mirror
                wanted = draft_layers(state, r.cfg, r.policy, self.ngram.fallback, self._live_middle(), self.timer,
                                      r.context, budgets)
            elif wanted == "ngram":
                try:
                    with self.timer.phase("ngram"):
                        self.ngram.remote.begin()
                        drafted, wanted = ray.get(self.ngram.remote.host.draft.remote(
                            self.ngram.remote.rid, state, budgets, self._live_middle() is not None),
                            timeout=self.ngram.remote.timeout_s)
                    state = drafted.own()
                except (RayActorError, GetTimeoutError) as e:
                    self.ngram.died(e)  # the state sent is untouched here: draft on from it
            else:  # the middle drafter's layer, then the next decisions here if the policy allows
                with self.timer.phase("middle"):
                    draft_layer(state, self.middle, r.cfg.top_k, True)
                deeper = self._live_middle() is not None and deepening(state, r.cfg, budgets[0] if budgets else None)
                wanted = (self._decide_here(state, budgets) if self.decide_here
                          else "ngram" if state.layer < r.cfg.depth else "middle" if deeper else None)
        return state.tree, state.calls

    def _live_middle(self) -> FallbackDrafter | None:
        return self.middle if self.middle is not None and self.middle.alive and self.middle_on else None

    def _decide_here(self, state: Drafting, budgets: tuple[int, ...]) -> str | None:
        """Decide (and draft the middle drafter's) layers here up to the next n-gram layer."""
        r = self.spec
        return draft_layers(state, r.cfg, r.policy, None, self._live_middle(), self.timer, r.context, budgets)
