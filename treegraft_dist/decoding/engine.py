"""The decoding loop: draft a tree with two drafters under a schedule, prune, verify, repeat.

`speculate` (the rounds of a request `request.start_request` started) and `draft_tree` (one round's drafting)
take the drafters (any `drafter.Drafter`) and the verifier as plain objects, so the same loop drives in-process
components here and remote ones in the coordinator (actors/coordinator.py).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..models.hf import CausalLM
from .batch import input_vocab
from .config import TreeConfig
from .costs import forward_ms
from .drafter import Drafter
from .neural import ONE_FORWARD_MAX_LEAVES, NeuralDrafter
from .ngram import NGramDrafter
from .request import (
    DeepeningCalibration,
    Generation,
    Request,
    finish,
    finish_request,
    may_call_middle,
    start_request,
    truncate,  # noqa: F401  (callers import it from here, to cut tokens as the engine does)
    until_eos,
)
from .sampling import SamplingParams, check_seed
from .schedule import SchedulePolicy, as_policy, fixed_schedule
from .signals import READ_BLOCK, Timings, compute_signals
from .sizing import CopyReach, DraftingMeans, LoadBudget, TreeSizer
from .stats import PhaseTimer, RequestStats
from .tree import ORIGIN_MIDDLE, DraftTree, next_frontier
from .verify import TargetVerifier, Verdict

AR_METHOD = "ar"
DraftRound = Callable[[int, tuple[int, ...]], tuple[DraftTree, list[bool]]]  # draft(root, budgets) -> (tree, calls)


def pruning_settled(tree: DraftTree, frontier: np.ndarray, keep: int) -> bool:
    """Whether n-gram steps from `frontier` ([<= K] node ids) can no longer change `tree.prune(keep)`.

    An n-gram step adds or rescores only nodes at or below the frontier (children of frontier nodes, chains
    below them, then their children), each at its parent's score plus a log-prob <= 0, so no score it
    assigns exceeds the best frontier score. When the best keep - 1 nodes hold their ancestors (pruning
    keeps exactly them), none of them nor the root is at or below the frontier, and all outscore every
    frontier node, everything later n-gram steps score ranks below them: pruning keeps the same nodes
    with the same data.
    """
    if len(frontier) == 0:
        return True  # an n-gram step proposes nothing without a frontier
    if tree.size < keep:
        return False  # pruning would keep new nodes too
    # Cheap test first: are there keep - 1 nodes above the best frontier score at all? Then those are the
    # top ones, and only they need ranking.
    above = np.flatnonzero(tree.scores[1 : tree.size] > tree.scores[frontier].max()) + 1
    if len(above) < keep - 1:
        return False
    top = tree.ranked(above)[: keep - 1]
    kept = np.zeros(tree.size, bool)
    kept[0] = True
    kept[top] = True
    if not kept[tree.parents[top]].all():
        return False
    # A kept node at or below the frontier could be rescored or get its expanded bit set.
    return not tree.ancestor_mask(np.flatnonzero(kept))[:, frontier].any()


def pins_fill(tree: DraftTree, budgets: tuple[int, ...]) -> bool:
    """Whether a copied span's pinned chain fills every one of `budgets` (DraftTree.pins_fill): then no later
    layer of either drafter can change the tree pruned to them, and a middle call there would be paid for
    nodes that are never verified."""
    return bool(budgets) and all(tree.pins_fill(b) for b in budgets)


def only_ngram_left(cfg: TreeConfig, policy: SchedulePolicy, has_middle: bool, layer: int, calls: list[bool]) -> bool:
    """Whether no layer from `layer` on can call the middle drafter: none is there, the call budget is
    spent, or a fixed schedule has no call left."""
    pattern = getattr(policy, "pattern", None)  # only a fixed schedule tells its later layers in advance
    return (not has_middle or (cfg.call_budget is not None and sum(calls) >= cfg.call_budget)
            or (pattern is not None and "1" not in pattern[layer:]))


def deepening(state: "Drafting", cfg: TreeConfig, budget: int | None = None) -> bool:
    """Whether a round that has drafted its cfg.depth layers drafts one more middle layer.

    Only in a round that called the middle drafter, at most cfg.deepen times, and only where one more layer is
    expected to pay for its call. The nodes it would expand: the last layer's frontier after a middle layer
    (it carries the middle drafter's own path log-probs); after n-gram layers, the nodes the middle drafter
    would select next (`DraftTree.reselect`: the best by score within its lookback that it has not expanded;
    a fixed schedule such as 10100 ends on n-gram layers, and its chain would otherwise stop at the depth;
    such a call also reads the nodes those layers added, at cfg.deepen_row_cost each, up to what one forward
    reads, `neural.ONE_FORWARD_MAX_LEAVES`).
    What a layer adds: each such node's best child, at the node's path probability times the round's last
    middle layer's confidence (its frontier's mass over its parents', `Drafting.confidence`), takes the place of
    the weakest node the budget keeps (`budget`: this round's, where it is not cfg.budget: a round sized for the
    load), so it adds the difference where positive. Against what the call costs at
    this round's rate (its expected accepted tokens, 1 + the kept nodes' path probabilities, over its time so
    far, a target pass plus its calls):
        gain / cost >= accepted / time,  in target passes: gain * (1 + calls * c) >= cost * accepted,
    cost = c (+ the unread nodes' rows). This is how a round grows as deep as a confident chain reaches (as
    assisted generation's chain runs while its drafter is sure), where a flat number of layers stops every round
    at `depth`."""
    c = cfg.deepen_cost
    if (c is None or state.layer < cfg.depth or state.layer >= cfg.depth + cfg.deepen or state.confidence is None
            or len(state.frontier) == 0):
        return False
    tree = state.tree
    cost, nodes = c, state.frontier  # [<= K]
    if not state.calls[-1]:
        nodes = tree.reselect(state.frontier, cfg.lookback, cfg.top_k, ORIGIN_MIDDLE)
        last = len(state.calls) - state.calls[::-1].index(True)  # the last middle layer (1-based)
        unread = int((tree.layers[: tree.size] > last).sum())  # the n-gram layers' nodes since
        cost += cfg.deepen_row_cost * min(unread, ONE_FORWARD_MAX_LEAVES)
    if len(nodes) == 0:
        return False
    reach = np.exp(tree.scores[nodes])  # [<= K]
    budget = cfg.budget if budget is None else budget
    kept = np.exp(np.sort(tree.scores[1 : tree.size])[::-1][: budget - 1])  # [<= budget - 1] descending
    weakest = float(kept[-1]) if 0 < len(kept) == budget - 1 else 0.0  # what a new node displaces
    gain = float(np.maximum(reach * state.confidence - weakest, 0.0).sum())
    accepted = 1.0 + float(kept.sum())
    return gain * (1.0 + sum(state.calls) * c) >= cost * accepted


def layer_confidence(tree: DraftTree, frontier: np.ndarray) -> float:
    """A layer's confidence: its frontier's probability mass over that of the frontier's parents (at most 1)."""
    parents = np.unique(tree.parents[frontier])
    return min(1.0, float(np.exp(tree.scores[frontier]).sum() / np.exp(tree.scores[parents]).sum()))


@dataclass
class Drafting:
    """One round's drafting so far: the tree, its frontier, and which of the layers drafted so far called
    the middle drafter (their count is the next layer's 0-based index)."""

    tree: DraftTree
    frontier: np.ndarray  # [<= K] node ids the next layer expands
    calls: list[bool]
    confidence: float | None = None  # the last middle layer's (layer_confidence); None before one

    @classmethod
    def new(cls, root: int) -> Drafting:
        return cls(DraftTree(root), np.zeros(1, np.int64), [])

    @property
    def layer(self) -> int:
        return len(self.calls)

    def own(self) -> Drafting:
        """A copy whose arrays this process may write (arrays that come out of Ray's object store are
        read-only)."""
        return Drafting(self.tree.copy(), self.frontier.copy(), list(self.calls), self.confidence)


def draft_tree(
    root: int, cfg: TreeConfig, policy: SchedulePolicy, ngram: Drafter, middle: Drafter | None, timer: PhaseTimer,
    context: np.ndarray | None,  # [4] context signals; needed when the policy reads signals
    budgets: tuple[int, ...] = (),
) -> tuple[DraftTree, list[bool]]:
    """Grow one round's tree over cfg.depth layers; returns it and which layers called the middle.

    `budgets`, when given, are all those the tree will be pruned to, the round's own first (deepening weighs
    against it): once a copy's pins fill them (pins_fill), or only n-gram layers are left and they cannot
    change the tree pruned to any of them (pruning_settled), the later layers are not drafted. Without,
    every layer is drafted (the whole tree is wanted, e.g. to compare with trajectory collection)."""
    state = Drafting.new(root)
    draft_layers(state, cfg, policy, ngram, middle, timer, context, budgets)
    return state.tree, state.calls


def draft_layers(
    state: Drafting, cfg: TreeConfig, policy: SchedulePolicy, ngram: Drafter | None, middle: Drafter | None,
    timer: PhaseTimer, context: np.ndarray | None,  # [4] context signals; needed when the policy reads signals
    budgets: tuple[int, ...] = (), has_middle: bool | None = None,
) -> str | None:
    """Draft the layers of `state` from its next one on (draft_tree); returns None once the round's
    drafting is done. A drafter given as None is one the caller drafts with elsewhere: drafting stops before
    the first layer the schedule gives it, and returns its name ("ngram" or "middle"); the caller drafts that
    layer (`draft_layer`) or those layers and resumes. `has_middle` (default: `middle` is given) says
    whether the middle drafter is there at all. This is how the distributed engine drafts every n-gram layer
    between two middle calls in one call to the n-gram actor. A policy that `copies_first` gets no say over
    the first layer while the n-gram drafter finds the text copying a span (NGramDrafter.copying), so the
    n-gram drafter must be given for that layer."""
    has_middle = middle is not None if has_middle is None else has_middle
    while state.layer < cfg.depth or (has_middle and deepening(state, cfg, budgets[0] if budgets else None)):
        layer, calls = state.layer, state.calls
        with timer.phase("scheduler"):
            if budgets and pins_fill(state.tree, budgets):  # a copy fills the tree: nothing left to draft
                calls.extend([False] * max(0, cfg.depth - layer))
                break
            if layer >= cfg.depth:  # a deepening layer: the middle drafter's, past the schedule
                call = True
            elif layer == 0 and getattr(policy, "copies_first", False) and ngram is not None and ngram.copying():
                call = False  # a copy under way: its long chain first (NGramDrafter.copying)
            elif (budgets and only_ngram_left(cfg, policy, has_middle, layer, calls)
                    and all(pruning_settled(state.tree, state.frontier, b) for b in budgets)):
                calls.extend([False] * (cfg.depth - layer))
                break
            else:
                signals = None
                if policy.needs_signals:
                    signals = compute_signals(state.tree, state.frontier, layer, calls, cfg.depth, cfg.lookback,
                                              cfg.top_k, context)
                call = (has_middle and policy.decide(signals, layer)
                        and (cfg.call_budget is None or sum(calls) < cfg.call_budget))
        drafter = middle if call else ngram
        if drafter is None:
            return "middle" if call else "ngram"
        with timer.phase("middle" if call else "ngram"):
            draft_layer(state, drafter, cfg.top_k, call)
    return None


def draft_layer(state: Drafting, drafter: Drafter, top_k: int, call: bool) -> None:
    """One layer: `drafter` proposes from the frontier, the proposal is grafted, the frontier moves on."""
    proposal = drafter.step(state.tree, state.frontier, state.layer + 1)
    ids = state.tree.graft(proposal, state.layer + 1)
    if len(proposal):
        state.frontier = next_frontier(state.tree, proposal, ids, top_k)
        if call:
            state.confidence = layer_confidence(state.tree, state.frontier)
    state.calls.append(call)


class Decoder:
    """One target (and optionally one middle drafter) decoding requests one at a time."""

    def __init__(self, target: CausalLM, middle: CausalLM | None = None, tree: TreeConfig = TreeConfig(),
                 sampling: SamplingParams = SamplingParams(), timings: Timings | None = None,
                 probe_budgets: tuple[int, ...] = (), sizer: TreeSizer | None = None,
                 verify_ms: dict[int, float] | None = None, reach: CopyReach | None = None):
        """`probe_budgets`: also record, per round, the accepted length had the tree been pruned to each
        of these budgets instead (greedy only; for choosing a budget). `sizer`: choose each round's tree
        and its size from calibrated acceptance and the device's costs (sizing.py) instead of pruning to
        the budget by score; the sizer keeps learning across the requests of this decoder. `verify_ms`:
        this device's verification milliseconds by tree size (costs.latency_profile); with them a round
        drafts only while drafting pays for its request (sizing.Payoff, as the served engine decides for a
        request alone) and is a plain step where it does not; greedy only (Payoff decides from timings, and a
        sampled text must depend on its seed alone). `reach`: where a round's budget holds only the first tokens
        of a copied span, verify as much more of it as pays (sizing.CopyReach, learning across requests)."""
        self.target = target
        self.middle = middle
        self.cfg = tree
        self.sampling = sampling
        self._timings = timings
        self.probe_budgets = probe_budgets
        self.sizer = sizer
        self.reach = reach
        self.alone = LoadBudget(tree.budget, verify_ms) if verify_ms else None
        self.drafting = DraftingMeans()
        self.deepening = DeepeningCalibration()

    # -- public API -----------------------------------------------------------------------------------
    def resolve_policy(self, method) -> SchedulePolicy:
        return resolve_policy(method, self.cfg.depth, self.middle is not None)

    def generate(self, prompt: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
                 seed: int = 0) -> Generation:
        """Decode `prompt`; `method` is "ar", a schedule name/pattern, or a policy."""
        check_request(prompt, max_new_tokens, seed, input_vocab(self.target))
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        verifier = TargetVerifier(self.target, self.sampling, generator)
        if method == AR_METHOD:
            return self._generate_ar(verifier, prompt, max_new_tokens, set(eos_ids))
        policy = self.resolve_policy(method)
        return self._generate_spec(verifier, policy, prompt, max_new_tokens, set(eos_ids))

    @property
    def measured_timings(self) -> Timings | None:
        """`timings` where given or measured already, else None (nothing is measured here)."""
        return self._timings

    @property
    def timings(self) -> Timings:
        """Warm target and middle forward times (ms) over one full-budget tree; measured once."""
        if self._timings is None:
            self._timings = Timings(
                forward_ms(self.target, self.cfg.budget),
                forward_ms(self.middle, self.cfg.budget, drafting=True) if self.middle else 1.0,
                forward_ms(self.middle, READ_BLOCK, drafting=True) / READ_BLOCK if self.middle else 0.0)
        return self._timings

    # -- methods --------------------------------------------------------------------------------------
    def _generate_ar(self, verifier: TargetVerifier, prompt, max_new, eos) -> Generation:
        return decode_plain(lambda p: verifier.prefill(p, want_prefill_cache=False)[0], verifier.step, prompt,
                            max_new, eos, device=self.target.device)

    def _generate_spec(self, verifier: TargetVerifier, policy: SchedulePolicy, prompt, max_new, eos) -> Generation:
        req = start_request(prompt, max_new, eos, policy, self.cfg, timings=lambda: self.timings,
                            prefill=verifier.prefill, drafters=self._drafters, calibration=self.deepening,
                            device=self.target.device, sizer=self.sizer, probe_budgets=self.probe_budgets,
                            reach=self.reach)
        out: list[int] = []
        if max_new:
            budget, draft = None, None
            if self.alone is not None and self.sizer is None and not self.probe_budgets and self.sampling.greedy:
                budget, draft = self._paced(req)
            out = speculate(req, verifier.verify, draft=draft, budget=budget)
        return finish_request(req, out)

    def _drafters(self, req: Request) -> tuple[NGramDrafter, NeuralDrafter | None]:
        """A request's drafters: the n-gram drafter and, when a middle model is loaded, the neural one."""
        middle = NeuralDrafter(self.middle, req.cfg.top_k, req.cfg.lookback,
                               req.cfg.middle_window) if self.middle is not None else None
        return NGramDrafter.from_config(req.cfg), middle

    def _paced(self, req: Request) -> tuple[Callable[[], int], DraftRound]:
        """`budget` and `draft` for speculate where a round drafts only while drafting pays for the request
        (verify_ms given): the budget while it pays, else plain steps and exploring rounds."""
        payoff, spent = self.drafting.start(req.policy.name)

        def budget() -> int:
            drafting_ms = self.drafting.update(req.stats, payoff, spent)
            return self.alone(1, drafting_ms, payoff, req.reading(self.timings.read_ms))

        def draft(root: int, settle: tuple[int, ...]) -> tuple[DraftTree, list[bool]]:
            live = req.middle if payoff.middle else None  # an exploring round: the n-gram drafter alone
            return draft_tree(root, req.cfg, req.policy, req.ngram, live, req.timer, req.context, settle)

        return budget, draft


def speculate(
    req: Request, verify: Callable[[DraftTree], Verdict], *, draft: DraftRound | None = None,
    budget: Callable[[], int] | None = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> list[int]:
    """The rounds of a started request (request.start_request), the same whether its parts run in this process
    or as actors: draft a tree, prune it to the budget (or let `req.sizer` choose it; `req.reach` may verify a
    copied span past the budget), verify it with `verify`, and let every drafter accept the result; until
    `req.max_new` tokens or end of sequence. Returns the tokens, `req.first` included (finish_request truncates
    them).

    A middle drafter that is no longer `alive` is left out of later rounds; one that answered some steps with
    n-gram drafting in its place (`fallback_steps`) is not counted as called for those. `on_tokens(out)` is
    shown the tokens so far (before truncation) at the start and after each round; when it returns True
    the request ends there (a client went away, a stop string was met). `draft(root, budgets) -> (tree,
    calls)` drafts a round in the caller's own way (the coordinator: n-gram layers on the n-gram actor); by
    default `draft_tree` here. `budget()`, when given, is each round's tree size instead of cfg.budget (the
    coordinator's, under load). A round of size 1 is a plain step: nothing is drafted, and the drafters hear
    of its token only when a later round drafts (one accept for the whole run of steps, which is what they
    would have built from one accept each), so under load a speculative request costs what a plain one does."""
    if req.first is None:
        raise ValueError("the request asked for no tokens, so it has no prefill to speculate from: finish it "
                         "(finish_request) without rounds")
    cfg, middle, sizer, stats, eos = req.cfg, req.middle, req.sizer, req.stats, req.eos
    reach = req.reach if sizer is None else None  # a sizer weighs a copy's nodes itself
    out = [req.first]
    stop = on_tokens is not None and on_tokens(out)
    for learner in (sizer, reach):
        if learner is not None:
            learner.start_request()
    if draft is None:
        def draft(root: int, settle: tuple[int, ...]) -> tuple[DraftTree, list[bool]]:
            live = middle if middle is not None and middle.alive else None
            return draft_tree(root, cfg, req.policy, req.ngram, live, req.timer, req.context, settle)
    unseen: list[int] = []  # tokens of plain-step rounds the drafters have not been told yet
    while len(out) < req.max_new and out[-1] not in eos and not stop:
        keep = cfg.budget if budget is None else budget()
        plain = keep == 1 and sizer is None  # the root alone is verified: a plain step, nothing to draft
        if not plain and unseen:
            for d in req.drafters:  # one accept for a run of plain steps: the drafters drafted nothing in them
                d.accept([0], unseen)
            unseen = []
        started, fell_back = time.perf_counter(), req.middle_fallback_steps
        # A sizer ranks nodes by its own estimate, not by score: every layer may matter to it.
        settle = () if sizer is not None else (keep,) + req.probe_budgets
        tree, calls = (DraftTree(out[-1]), []) if plain else draft(out[-1], settle)
        pruned, kept = choose_nodes(tree, keep, sizer, started)
        if reach is not None and (wider := reach.extend(tree, kept)) is not None:  # a copy that goes on past keep
            pruned, kept = tree.subtree(wider), wider
        with req.timer.phase("verify"):
            verdict = verify(pruned)
        for learner in (sizer, reach):
            if learner is not None:
                learner.observe(tree, kept, verdict.accepted)
        if cfg.deepen and len(kept) > 1:
            note_deepening(stats, tree, kept, verdict.accepted, cfg.depth)
        if plain:  # told at the next round that drafts (no actor message, no work, per plain step)
            unseen.extend(verdict.tokens)
        else:
            for d in req.drafters:
                d.accept([0] + [int(kept[i]) for i in verdict.accepted], verdict.tokens)
        accepted = until_eos(verdict.tokens, eos)  # a round can accept eos before its last token
        out.extend(accepted)
        called = sum(calls) - (req.middle_fallback_steps - fell_back)
        record_round(stats, tree, pruned.size, verdict, len(accepted), called, req.probe_budgets)
        stop = on_tokens is not None and on_tokens(out)
    if unseen:  # the last rounds were plain steps: the drafters end with the whole text (a served history keeps it)
        for d in req.drafters:
            d.accept([0], unseen)
    return out


def choose_nodes(tree: DraftTree, keep: int, sizer: TreeSizer | None, started: float
                 ) -> tuple[DraftTree, np.ndarray]:
    """The tree to verify and its nodes' ids in `tree` ([n]): the best `keep` by score, or the sizer's choice
    (which then learns how long drafting took since `started`)."""
    if sizer is None:
        return tree.prune(keep)
    pruned, kept, _ = sizer.choose(tree)
    sizer.drafting_ms += 0.2 * (1e3 * (time.perf_counter() - started) - sizer.drafting_ms)
    return pruned, kept


def note_deepening(stats: RequestStats, tree: DraftTree, kept: np.ndarray, accepted: list[int], depth: int) -> None:
    """Add a round's verified deepening nodes to `stats`: `kept` ([n] ids in `tree` of the verified nodes, root
    first), `accepted` (indices into `kept` the target accepted)."""
    deep = tree.layers[kept] > depth  # [n]
    if deep.any():
        stats.deep_expected += float(np.exp(tree.scores[kept[deep]]).sum())
        stats.deep_accepted += int(deep[list(accepted)].sum())


def record_round(stats: RequestStats, tree: DraftTree, verified: int, verdict: Verdict, accepted: int,
                 middle_calls: int, probe_budgets: tuple[int, ...]) -> None:
    """A round's counts; for each probe budget, what the tree pruned to it would have accepted (the target's
    greedy continuation is known as far as this round accepted it)."""
    stats.accepted.append(accepted)
    stats.tree_sizes.append(verified)
    stats.middle_calls.append(middle_calls)
    for b in probe_budgets:
        hit = len(tree.prune(b)[0].follow(verdict.tokens[:-1]))
        stats.accepted_at_budget.setdefault(b, []).append(hit + 1)


def decode_plain(prefill: Callable[[list[int]], int], step: Callable[[int], int], prompt: list[int], max_new: int,
                 eos: set[int], on_tokens: Callable[[list[int]], bool | None] | None = None,
                 device: torch.device | None = None) -> Generation:
    """The autoregressive baseline over any target: `prefill(prompt)` gives the first token, `step(token)`
    the next one; `on_tokens(out)` is shown the tokens after each one and ends the request by returning True;
    `device`: the target's, when in this process."""
    stats = RequestStats(AR_METHOD, prompt_tokens=len(prompt))
    timer = PhaseTimer(stats, device)
    out: list[int] = []
    if max_new:
        with timer.phase("prefill"):
            tok = prefill(prompt)
        out.append(tok)
        stop = on_tokens is not None and on_tokens(out)
        with timer.phase("verify"):
            while len(out) < max_new and tok not in eos and not stop:
                tok = step(tok)
                out.append(tok)
                stop = on_tokens is not None and on_tokens(out)
                stats.accepted.append(1)
                stats.tree_sizes.append(1)
                stats.middle_calls.append(0)
    return finish(out, stats, timer, max_new, eos)  # nothing to cut: the loop stops where plain decoding does


def check_request(prompt: list[int], max_new_tokens: int, seed: int = 0, vocab_size: int | None = None,
                  sampling: SamplingParams | None = None) -> None:
    """ValueError, before any model work, for a request that cannot be served as asked: an empty prompt or
    one that is not integer token ids (all below `vocab_size`, when given), a max_new_tokens that is not an
    integer >= 0, a seed torch.Generator.manual_seed does not take (sampling.check_seed), bad sampling params."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError("the prompt must be a flat list of integer token ids")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise ValueError(f"the prompt holds token id {bad}, outside the model's vocabulary "
                         f"[0, {vocab_size if vocab_size is not None else 'vocab size'})")
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_seed(seed)
    if sampling is not None:
        sampling.check()


def resolve_policy(method, depth: int, has_middle: bool) -> SchedulePolicy:
    """A schedule name or pattern, a policy, or a callable, checked against the drafters loaded."""
    policy = fixed_schedule(method, depth) if isinstance(method, str) else as_policy(method)
    if not has_middle and may_call_middle(policy):
        raise ValueError(f"method {policy.name!r} calls the middle drafter, but none is loaded: pass a middle model")
    return policy
