"""Adaptive tree sizing: per round, which nodes to verify and how many, from calibrated acceptance and the
device's verification costs.

A fixed budget verifies the same number of nodes every round, whether the drafted tree holds a confident
copied span (worth a large tree) or nothing at all (where a one-node step would cost less). `TreeSizer`
decides per round instead:

  acceptance  every node gets q, the probability that the target accepts it given that its parent was
              accepted, from a small calibration table learned online from the verdicts (cells: origin,
              only child or rank among its siblings, depth and the drafter's own log-prob for the edge;
              Beta prior), the current request's own counts weighed against the table across requests;
              P(node) = P(parent) * q, siblings normalised so that at most one can be accepted (greedy).
  selection   the best n nodes by P are closed under ancestors (P never grows down a path) and hold the
              most expected accepted tokens of any n-node tree under the table: E(n) = sum of their P.
  size        n among the tree sizes the device profile measured (up to the largest allowed), maximising
              expected tokens per millisecond: (1 + E(n)) / (verification_ms(n) + drafting_ms).

Output is unaffected (verification is lossless for any tree); only which tree is verified changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import ORIGIN_MIDDLE, DraftTree

# Calibration cells. Edge log-prob bins (upper edges, nats): near-certain or unknown (an n-gram copy of
# generated text has no prefill log-prob: 0), likely, possible, unlikely.
EDGE_BINS = np.array([-1.5, -0.3, -0.01])  # np.digitize -> 0 (< -1.5) .. 3 (>= -0.01)
# Sibling rank (insertion order: each drafter appends its children best first): an only child (a copied
# span continuing, mostly), then rank 0, 1, 2+ of several.
RANKS = 4
DEPTH_BINS = np.array([2, 3, 5, 9])  # np.digitize -> depth 1, 2, 3-4, 5-8, 9+
ORIGINS = 2  # n-gram, middle
PRIOR_WEIGHT = 4.0
# How acceptance varies between requests (a code edit copies its prompt, a chat answer does not) outweighs
# how it varies within one: per request, a cell's estimate is its own counts with the table across requests
# as a prior of this many trials.
REQUEST_PRIOR_WEIGHT = 6.0
PRIOR_MEAN_BY_RANK = np.array([0.6, 0.4, 0.15, 0.05])
Q_MAX = 0.98  # q < 1 keeps P strictly decreasing down a path


@dataclass
class SizeChoice:
    size: int  # nodes verified, root included
    expected: float  # expected accepted tokens (bonus token excluded) of that tree under the table


class AcceptanceTable:
    """Beta counts of acceptance by cell: across requests (from a prior mean worth `prior_weight` trials a cell) and
    for the current request, whose own counts are weighed against the table across requests as a prior of
    `request_weight` trials."""

    def __init__(self, prior_mean: np.ndarray, prior_weight: float, request_weight: float):
        self.hits = np.asarray(prior_mean, np.float64) * prior_weight
        self.trials = np.full(self.hits.shape, float(prior_weight))
        self.request_weight = request_weight
        self.start_request()

    def start_request(self) -> None:
        """Forget the current request's own counts (the table across requests stays)."""
        self.request_hits = np.zeros_like(self.hits)
        self.request_trials = np.zeros_like(self.trials)

    def q(self) -> np.ndarray:
        """P(accepted | parent accepted) per cell for the current request."""
        across = self.hits / self.trials
        w = self.request_weight
        return np.minimum((self.request_hits + w * across) / (self.request_trials + w), Q_MAX)

    def count(self, cells, hit: np.ndarray) -> None:
        """Trials at `cells` (an index into the table), hits where `hit` is 1: across requests and for this one."""
        for hits, trials in ((self.hits, self.trials), (self.request_hits, self.request_trials)):
            np.add.at(trials, cells, 1.0)
            np.add.at(hits, cells, hit)


def on_accepted_path(tree: DraftTree, kept: np.ndarray, accepted: list[int]) -> np.ndarray:
    """[tree size] bool: the root and the nodes a verdict accepted (`accepted`: ids of the verified tree, root
    excluded; `kept`: the verified tree's ids in `tree`)."""
    on_path = np.zeros(tree.size, bool)
    on_path[0] = True
    on_path[kept[accepted]] = True
    return on_path


class TreeSizer(AcceptanceTable):
    """The calibration table (learned across the requests it sees) and the per-round choice."""

    def __init__(self, verify_ms: dict[int, float], max_size: int, drafting_ms: float = 1.0):
        """`verify_ms`: target verification ms by tree size as measured on this device (costs.latency_profile);
        sizes above `max_size` are never chosen."""
        sizes = sorted(s for s in verify_ms if 1 <= s <= max_size)
        if not sizes:
            raise ValueError(f"no measured tree size is <= {max_size}: measured {sorted(verify_ms)}")
        self.sizes = np.array(sizes)  # [S] int64: the measured sizes <= max_size, ascending
        self.cost = np.array([verify_ms[s] for s in sizes], np.float64)  # [S] verification ms of each
        self.drafting_ms = drafting_ms
        shape = (ORIGINS, RANKS, len(DEPTH_BINS) + 1, len(EDGE_BINS) + 1)  # [2, 4, 5, 4] cells, as `cells` indexes
        super().__init__(np.broadcast_to(PRIOR_MEAN_BY_RANK[None, :, None, None], shape), PRIOR_WEIGHT,
                         REQUEST_PRIOR_WEIGHT)

    # -- per node -------------------------------------------------------------------------------------
    def cells(self, tree: DraftTree) -> tuple[np.ndarray, ...]:
        """Index arrays [size - 1] (root excluded) into the table for every node of `tree`."""
        n = tree.size
        nodes = np.arange(1, n)
        parents = tree.parents[1:n]
        # Rank among siblings by insertion id: the position within its parent's group, ids ascending.
        order = np.lexsort((nodes, parents))
        first = np.r_[0, np.flatnonzero(np.diff(parents[order])) + 1]
        group_start = np.repeat(first, np.diff(np.r_[first, len(order)]))
        rank = np.empty(n - 1, np.int64)
        rank[order] = np.arange(n - 1) - group_start
        only = np.bincount(parents, minlength=n)[parents] == 1
        rank = np.where(only, 0, np.minimum(rank + 1, RANKS - 1))
        edge = tree.scores[1:n] - tree.scores[parents]
        return ((tree.origins[1:n] == ORIGIN_MIDDLE).astype(np.int64), rank,
                np.digitize(tree.depths[1:n], DEPTH_BINS), np.digitize(edge, EDGE_BINS))

    def acceptance(self, tree: DraftTree) -> np.ndarray:
        """[size] P(node accepted) under the table; P(root) = 1."""
        n = tree.size
        q = np.zeros(n)
        q[1:] = self.q()[self.cells(tree)]
        # Greedy acceptance takes at most one child: a parent's children share at most its probability.
        total = np.bincount(tree.parents[1:n], weights=q[1:], minlength=n)
        q[1:] /= np.maximum(total[tree.parents[1:n]], 1.0)
        p = np.ones(n)
        for level in tree.levels()[1:]:
            p[level] = p[tree.parents[level]] * q[level]
        return p

    # -- per round ------------------------------------------------------------------------------------
    def choose(self, tree: DraftTree) -> tuple[DraftTree, np.ndarray, SizeChoice]:
        """The tree to verify: (pruned tree, original id of each of its nodes ([size] ascending), the choice)."""
        p = self.acceptance(tree)
        # Best first by P; ties (equal P) by depth then id, so a parent always precedes its children.
        order = np.lexsort((np.arange(1, tree.size), tree.depths[1 : tree.size], -p[1:])) + 1
        expected = np.r_[0.0, np.cumsum(p[order])]  # expected[k]: the best k nodes below the root
        reachable = np.minimum(self.sizes, tree.size)
        rate = (1.0 + expected[reachable - 1]) / (self.cost + self.drafting_ms)
        best = int(np.argmax(rate))
        size = int(reachable[best])
        kept = np.sort(np.r_[0, order[: size - 1]])
        return tree.subtree(kept), kept, SizeChoice(size, float(expected[size - 1]))

    def observe(self, tree: DraftTree, kept: np.ndarray, accepted: list[int]) -> None:
        """Learn from one verdict: every verified node whose parent was accepted (the root always is) is a
        trial, a hit when it was accepted itself. `kept`: [verified size], as `choose` gives it; `accepted`:
        ids of the verified tree (root excluded)."""
        on_path = on_accepted_path(tree, kept, accepted)
        nodes = kept[1:]
        tried = nodes[on_path[tree.parents[nodes]]]
        if len(tried):
            self.count(tuple(c[tried - 1] for c in self.cells(tree)), on_path[tried].astype(np.float64))


class CopyReach(AcceptanceTable):
    """How far a round verifies a copied span past its budget.

    A copy under way (a pinned chain, ngram.py) can run for a dozen tokens, where the budget a scheduler was
    fitted for may be 4: then a round verifies 3 of them, the next round 3 more, each round paying a pass. Where
    a round's pinned chain fills its budget (no other node would be verified), this picks how many of the chain's
    nodes to verify instead, the n among `budget` and the profiled sizes that gives the most expected tokens per
    millisecond of verification:
      rate(n)   (1 + E(n)) / verify_ms(n), with E(n) = sum over the chain's first n - 1 tokens of
                P(token i accepted) = q_first * q_next ** (i - 1);
      q_first   P(a copy's first token is accepted | its parent was), separately for a copy that picks up where
                the last round's ended (every copied token it verified was accepted: the span went on past what
                it verified) and for a fresh one; q_next P(the next token is | the one before was). Beta
                estimates from the verdicts, the current request's own counts weighed against the counts across
                requests (a code edit copies its prompt for long, a chat answer rarely), starting from PRIOR.
    A size the profile did not measure is priced as the next measured one (passes pad their rows). Output is
    unaffected: verification is lossless for any tree; only how much of the copy a pass checks changes.
    """

    PRIOR = (0.4, 0.8, 0.85)  # q_first of a fresh copy, q_first of one the last round verified whole, q_next
    PRIOR_WEIGHT = 4.0
    REQUEST_PRIOR_WEIGHT = 4.0

    def __init__(self, verify_ms: dict[int, float]):
        """`verify_ms`: the target's verification ms by tree size on this device (costs.latency_profile)."""
        if not verify_ms:
            raise ValueError("CopyReach needs the device's verification costs by tree size")
        self.sizes = np.array(sorted(verify_ms))  # [S] profiled sizes, ascending
        self.cost = np.array([verify_ms[s] for s in self.sizes], np.float64)  # [S] ms of each
        super().__init__(np.array(self.PRIOR), self.PRIOR_WEIGHT, self.REQUEST_PRIOR_WEIGHT)  # [3] cells as PRIOR's

    def start_request(self) -> None:
        super().start_request()
        self.running = False  # the last round verified copied tokens and the target accepted all of them

    def verify_cost(self, n: int) -> float:
        """ms of a pass of `n` nodes: the smallest profiled size that holds them (past the largest: linear)."""
        at = int(np.searchsorted(self.sizes, n))
        if at < len(self.sizes):
            return float(self.cost[at])
        if len(self.sizes) == 1:
            return float(self.cost[0] * n / self.sizes[0])
        slope = (self.cost[-1] - self.cost[-2]) / (self.sizes[-1] - self.sizes[-2])
        return float(self.cost[-1] + slope * (n - self.sizes[-1]))

    @staticmethod
    def chain(tree: DraftTree) -> np.ndarray:
        """The pinned chain hanging from the root ([L] ids), else an empty array."""
        pins = np.flatnonzero(tree.pinned[1 : tree.size]) + 1
        if not len(pins) or tree.parents[pins[0]] != 0 or np.any(tree.parents[pins[1:]] != pins[:-1]):
            return pins[:0]
        return pins

    def extend(self, tree: DraftTree, kept: np.ndarray) -> np.ndarray | None:
        """The ids ([n] ascending, root first) to verify instead of `kept` (the budget's pruned tree), or None
        to verify `kept`: only where `kept` is the root and the first nodes of a pinned chain that goes on."""
        pins = self.chain(tree)
        n = len(kept)
        if n < 2 or len(pins) < n or not np.array_equal(kept[1:], pins[: n - 1]):
            return None
        q = self.q()
        q_first, q_next = q[int(self.running)], q[2]
        expected = np.r_[0.0, np.cumsum(q_first * q_next ** np.arange(len(pins)))]  # [L + 1] E(1 + i)
        sizes = np.unique(np.minimum(np.r_[n, self.sizes[self.sizes > n]], len(pins) + 1))
        rate = [(1.0 + expected[m - 1]) / self.verify_cost(m) for m in sizes]
        best = int(sizes[int(np.argmax(rate))])
        return np.r_[0, pins[: best - 1]] if best > n else None

    def observe(self, tree: DraftTree, kept: np.ndarray, accepted: list[int]) -> None:
        """Learn from a verdict (as TreeSizer.observe takes it): every verified pinned node whose parent was
        accepted is a trial of its cell (the first of a copy, or the next), a hit when it was accepted itself."""
        on_path = on_accepted_path(tree, kept, accepted)
        nodes = kept[1:]
        pinned = nodes[tree.pinned[nodes]]
        tried = pinned[on_path[tree.parents[pinned]]]
        self.count(np.where(tree.pinned[tree.parents[tried]], 2, int(self.running)), on_path[tried].astype(np.float64))
        self.running = bool(len(pinned)) and bool(on_path[pinned].all())


PROBE_COST = 1.15  # an exploring round's pass costs at most this many one-row passes (LoadBudget.probe_size)


class LoadBudget:
    """Each round's tree size when several requests share every target pass (batched verification).

    Alone, a request verifies `budget` nodes a round. When `active` requests' trees go in one pass, the pass
    costs what a tree of all their rows costs, so large trees that pay alone can lose to plain decoding
    under load. Per round this picks the size b <= budget (powers of two, and the budget itself) that
    gives the most tokens per millisecond, acc(b) / (cost(active * b) + drafting), with
      cost(rows)  the target pass's measured milliseconds (`costs`), interpolated between sizes, and then
                  learned from the passes as they run (`observe_pass`);
      drafting    a request's drafting time a round (its n-gram steps, middle calls, scheduler), paid only
                  when it drafts (b > 1), once per active request: the drafter actors serve the requests'
                  calls one after another, and on a CPU they take the cores the target's pass would use; plus,
                  for this request, the middle drafter's read of what it has not seen (`reading`: its prompt's
                  window on a first drafted round, the tokens of plain steps since), which the pass waits for;
      acc(b)      tokens a round accepts, 1 + alpha * log2(b): trees accept about logarithmically more with
                  size; alpha is learned online from the rounds (`observe`), starting at `alpha`.
    b = 1 is a plain decoding step (no drafting at all), so under heavy load speculation degrades to batched
    plain decoding instead of losing to it. With one request active the budget stands while drafting pays for
    that request as measured (`Payoff`), and plain steps take over where it does not.
    """

    def __init__(self, budget: int, costs: dict[int, float], alpha: float = 0.5, smoothing: float = 0.05):
        if not costs:
            raise ValueError("LoadBudget needs measured pass costs")
        self.budget, self.alpha, self.smoothing = budget, alpha, smoothing
        self.sizes = np.array(sorted(costs), dtype=np.float64)  # [S] profiled pass rows, ascending
        self.ms = np.array([costs[k] for k in sorted(costs)], dtype=np.float64)  # [S] ms of each
        self.profile = self.ms.copy()  # [S] as profiled (its ratios bound the learned curve above what passes reach)
        self.reached = 0  # index of the largest profiled size a pass has moved (observe_pass)
        b, self.candidates = 1, []
        while b < budget:
            self.candidates.append(b)
            b *= 2
        self.candidates.append(budget)

    def cost(self, rows: float) -> float:
        """Milliseconds of a pass of `rows` rows: interpolated, extrapolated linearly past the largest."""
        if rows <= self.sizes[-1] or len(self.sizes) == 1:
            return float(np.interp(rows, self.sizes, self.ms))
        slope = (self.ms[-1] - self.ms[-2]) / (self.sizes[-1] - self.sizes[-2])
        return float(self.ms[-1] + slope * (rows - self.sizes[-1]))

    def observe_pass(self, rows: int, ms: float, rate: float = 0.1) -> None:
        """A real pass of `rows` rows took `ms`: the cost curve moves toward it. A pass of several requests
        costs more than the profiled single tree of as many rows (per-request attention, the actor calls,
        the work around it), so the profile is where the curve starts, not where it stays. The two profiled
        sizes around `rows` take the error in proportion to their interpolation weights (least squares on
        the piecewise-linear curve); passes beyond the largest size (prompt chunks) are not used."""
        if rows > self.sizes[-1] or len(self.sizes) == 1:
            return
        hi = int(np.searchsorted(self.sizes, rows))
        lo = max(0, hi - 1)
        w = 1.0 if hi == lo else (rows - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        err = ms - self.cost(rows)
        self.ms[lo] += rate * (1 - w) * err
        self.ms[hi] += rate * w * err
        # Sizes above the largest a pass reached cost at least what the profile's growth from there says: a curve
        # raised where passes ran must not leave the sizes above it cheaper than the profile's ratios.
        self.reached = max(self.reached, hi)
        for j in range(self.reached + 1, len(self.ms)):
            self.ms[j] = max(self.ms[j], self.ms[j - 1] * self.profile[j] / self.profile[j - 1])

    def observe(self, size: int, accepted: int) -> None:
        """A round verified `size` nodes and accepted `accepted` tokens (bonus included)."""
        if size > 1:
            seen = (accepted - 1) / np.log2(size)
            self.alpha += self.smoothing * (seen - self.alpha)

    def __call__(self, active: int, drafting_ms: float = 0.0, payoff: Payoff | None = None,
                 reading: Reading | None = None, call_ms: float = 0.0) -> int:
        """`call_ms`: a middle call's milliseconds, where the policy may call the middle drafter. Under load a
        drafted round is priced at no less: `drafting_ms`, a running mean over rounds, swings from a few
        milliseconds (rounds of n-gram layers) to hundreds (a call that reads context), and beside other
        requests any drafted round may call it, their calls queued on the one middle drafter."""
        if active <= 1:
            return self.budget if payoff is None else payoff.plan(self.cost, drafting_ms, self.budget, self.probe_size,
                                                                  reading)
        drafting_ms = max(drafting_ms, call_ms)
        # Under load every drafted round drafts as the policy says, and before its first call the middle drafter
        # reads what it has not seen of this request (the prompt's window, the tokens of plain steps): the other
        # requests' pass waits for that read too, so a drafted round pays it.
        catch_up_ms = 0.0 if payoff is None else payoff.catch_up_ms(reading)
        gain = [(1 + self.alpha * np.log2(b))
                / (self.cost(active * b) + (active * drafting_ms + catch_up_ms if b > 1 else 0.0))
                for b in self.candidates]
        size = self.candidates[int(np.argmax(gain))]
        if payoff is not None:
            payoff.middle = True
            if size > 1 and reading is not None:
                payoff.read = reading.context  # the middle drafter reads up to this round's root
        return size

    @property
    def probe_size(self) -> int:
        """The tree of an exploring round (Payoff): the most nodes whose pass costs at most PROBE_COST times a
        one-row pass, at least 2 and at most the budget, so that a round that finds nothing costs about a
        plain step."""
        fits = [b for b in range(2, self.budget + 1) if self.cost(b) <= PROBE_COST * self.cost(1)]
        return max(fits, default=min(2, self.budget))


@dataclass(frozen=True)
class Reading:
    """Where a request stands before a round, for pricing the middle drafter's read of the context it has not
    seen: `context` tokens so far (prompt and output), `remaining` tokens still to generate, `token_ms` what
    the middle drafter's read costs a token."""

    context: int
    remaining: int
    token_ms: float


class Payoff:
    """Whether drafting pays for one request running alone, from its own rounds: a drafted round accepts
    `accepted` tokens (a running mean, starting from what the method's earlier requests saw) for a pass of
    `size` nodes plus the drafting time, where a plain step gets 1 token for a 1-row pass. While that rate is
    at least the plain step's, every round drafts as the policy says (`middle`: the middle drafter may be
    called). Where it is lower, rounds become plain steps, and one round in `patience` explores with a small
    tree (LoadBudget.probe_size nodes, about a plain step's pass) drafted by the n-gram drafter alone, which
    costs about a millisecond where a middle call and its catch-up cost a good part of a step. An exploring
    round that took a drafted token brings the next one a round later (and where such rounds pay, every
    round is one: copied text); one that took none doubles `patience`, up to MAX_PATIENCE. Exploring rounds
    count in the running mean too, so text that turns predictable brings back the policy's rounds. Output is
    unaffected: only the tree and who drafts it change.

    A request drafts its own first MIN_ROUNDS rounds unless it `trusts` the prior its method's earlier requests
    left (DraftingMeans decides which requests do): then its first round already follows that verdict, which
    saves a request on text the middle drafter does not know its calls (and its read of the prompt).
    """

    MAX_PATIENCE = 8
    SMOOTHING = 0.3
    MIN_ROUNDS = 2  # drafted rounds of its own before a request can be switched to plain steps
    BEST_SAVING = 0.5  # of the remaining plain steps' time: the most drafting is assumed to save while unmeasured

    def __init__(self, accepted: float | None = None, size: float = 0.0, trust: bool = False):
        """`accepted`, `size`: what the method's earlier requests' drafted rounds accepted and verified. Unless
        `trust`, the request drafts MIN_ROUNDS rounds of its own before they can stop it drafting."""
        self.accepted = accepted  # tokens a round drafted as the policy says accepts (bonus included)
        self.size = size  # nodes such a round verifies (running mean)
        self.min_rounds = 0 if trust and accepted is not None else self.MIN_ROUNDS
        self.probe_accepted: float | None = None  # tokens a round of the n-gram drafter alone accepts
        self.rounds = 0  # drafted rounds seen
        self.plain_run = 0  # plain rounds since the last drafted one
        self.patience = 1
        self.middle = True  # this round is drafted as the policy says (False: a plain step or an n-gram round)
        self.read = 0  # context tokens the middle drafter has read (as far as the rounds drafted as the policy says)

    def observe(self, size: int, accepted: int) -> None:
        """A round of this request verified `size` nodes and accepted `accepted` tokens."""
        if size <= 1:
            self.plain_run += 1
            return
        better = self.accepted is not None and accepted > self.accepted
        a = self.SMOOTHING
        self.accepted = accepted if self.accepted is None else self.accepted + a * (accepted - self.accepted)
        if self.middle:
            self.size = size if not self.size else self.size + a * (size - self.size)
        else:
            better = accepted > 1
            p = self.probe_accepted
            self.probe_accepted = accepted if p is None else p + a * (accepted - p)
        if self.plain_run:  # that round explored after plain steps: the next one comes sooner if it did well
            self.patience = 1 if better else min(2 * self.patience, self.MAX_PATIENCE)
        self.rounds += 1
        self.plain_run = 0

    def drafting_rate(self, cost, drafting_ms: float, budget: int = 1) -> float:
        """Tokens a millisecond of a round drafted as the policy says; `cost(rows)` is a pass's milliseconds
        (`budget`: the size before a round of its own says)."""
        return self.accepted / (cost(self.size or budget) + drafting_ms)

    def pays(self, cost, drafting_ms: float, budget: int = 1, catch_up_ms: float = 0.0,
             remaining: int | None = None) -> bool:
        """Draft as the policy says this round? Always for the first MIN_ROUNDS (unless the prior is trusted);
        then while the drafted rate is at least the plain step's and, where the middle drafter has
        `catch_up_ms` of context to read first (what it has not seen: the prompt, plain steps' tokens), while
        the time drafting saves over the `remaining` tokens covers that read. The first rounds too skip a read
        that even BEST_SAVING of the remaining time could not pay back (a long prompt and a short answer, or a
        request that ran under load and is alone for its last tokens): they explore without the middle."""
        if self.accepted is None or self.rounds < self.min_rounds:  # explore, where that could pay back the read
            return not catch_up_ms or remaining is None or self.BEST_SAVING * remaining * cost(1) >= catch_up_ms
        rate, plain = self.drafting_rate(cost, drafting_ms, budget), 1.0 / cost(1)
        if rate < plain:
            return False
        return not catch_up_ms or remaining is None or remaining / plain - remaining / rate >= catch_up_ms

    def catch_up_ms(self, reading: Reading | None) -> float:
        """What the middle drafter's read of the context it has not seen costs before this round (0 without one)."""
        return 0.0 if reading is None else max(0, reading.context - self.read) * reading.token_ms

    def plan(self, cost, drafting_ms: float, budget: int, probe: int, reading: Reading | None = None) -> int:
        """This round's tree size: `budget` (drafted as the policy says) while that pays, `probe` (the n-gram
        drafter alone) while those pay and for an exploring round, else 1 (a plain step). Sets `middle`.
        `reading`: where the request stands, to price the middle drafter's read of what it has not seen."""
        catch_up_ms = self.catch_up_ms(reading)
        if self.pays(cost, drafting_ms, budget, catch_up_ms, None if reading is None else reading.remaining):
            self.middle = True
            if reading is not None:
                self.read = reading.context  # the middle drafter reads up to this round's root
            return budget
        self.middle = False
        probing_pays = self.probe_accepted is not None and self.probe_accepted / cost(probe) >= 1.0 / cost(1)
        return probe if probing_pays or self.plain_run >= self.patience else 1


DRAFTING_PHASES = ("ngram", "middle", "scheduler")


class DraftingMeans:
    """Per method, running means over its requests of what a round drafted as the policy says costs and gets
    (exploring rounds are left out): {"ms": drafting milliseconds, "accepted": tokens accepted, "size": nodes
    verified}, so that a request starts from what the earlier ones measured. A request's first drafted round
    is left out of "ms": it pays the middle drafter's read of the prompt once, a cost no later round repeats
    and no tree size can save.

    Once the means hold TRUST_ROUNDS drafted rounds, every request but one in EXPLORE_EVERY trusts them from
    its first round: where they say drafting does not pay, it starts with plain steps and exploring rounds,
    and drafts as the policy says only once its own text shows drafting pays. Before that (a warm-up request of
    a few tokens, one unpredictable prompt), and for the one in EXPLORE_EVERY, a request drafts its own first
    rounds whatever the means say, so the means keep being measured: a verdict taken once (on a busy hour, a
    run of unpredictable prompts, two rounds of one request) cannot keep the middle drafter out for good. A
    trusted verdict that drafting pays needs no such care: the request's own rounds overrule it within a few."""

    EXPLORE_EVERY = 4
    TRUST_ROUNDS = 8  # drafted rounds behind the means before a request may start from their verdict

    def __init__(self):
        self.by_method: dict[str, dict[str, float]] = {}

    def start(self, method: str) -> tuple[Payoff, list[float]]:
        """A new request's Payoff and its drafting-seconds marker (for `update`)."""
        means = self.by_method.setdefault(method, {})
        seen = means.get("requests", 0)
        means["requests"] = seen + 1
        trust = seen % self.EXPLORE_EVERY != 0 and means.get("rounds", 0) >= self.TRUST_ROUNDS
        return Payoff(means.get("accepted"), means.get("size", 0.0), trust), [0.0]

    def update(self, stats, payoff: Payoff, spent: list[float], prior_ms: float = 0.0) -> float:
        """Before a round of a request (`stats`: its RequestStats so far): learn from its last round and give
        the method's drafting milliseconds a drafted round (`prior_ms` until one was measured)."""
        now = sum(stats.seconds[k] for k in DRAFTING_PHASES)
        means = self.by_method.setdefault(stats.method, {})
        if stats.tree_sizes and stats.tree_sizes[-1] > 1 and payoff.middle:  # the last round drafted as the policy says
            got, size = stats.accepted[-1], stats.tree_sizes[-1]
            means["accepted"] = got if "accepted" not in means else means["accepted"] + 0.1 * (got - means["accepted"])
            means["size"] = size if "size" not in means else means["size"] + 0.1 * (size - means["size"])
            means["rounds"] = means.get("rounds", 0) + 1
            if payoff.rounds:  # not the request's first drafted round
                ms = 1e3 * (now - spent[0])
                means["ms"] = ms if "ms" not in means else means["ms"] + 0.3 * (ms - means["ms"])
        if stats.tree_sizes:
            payoff.observe(stats.tree_sizes[-1], stats.accepted[-1])
        spent[0] = now
        return means.get("ms", prior_ms)
