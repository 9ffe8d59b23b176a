"""Tree sizes under load: each round's budget as more requests share the target's passes.

The pass costs (`sizing.LoadBudget`) are profiled on the target once, by the first round that needs them or
by `warm`, and then corrected by what the batcher measured of the passes really run; per method, what a
drafted round costs and gets (`sizing.DraftingMeans`) carries from one request to the next.
"""

from __future__ import annotations

import threading

from treegraft_dist.decoding.sizing import DraftingMeans, LoadBudget, Payoff, Reading
from treegraft_dist.decoding.stats import RequestStats

from .admission import Admission
from .target import TargetBatcher, TargetGroup

PROFILED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # pass sizes the target profiles, up to its most rows a pass


class LoadBudgeting:
    def __init__(self, target: TargetGroup, admission: Admission, budget: int, max_batch_rows: int):
        self.target, self.admission, self.budget, self.max_batch_rows = target, admission, budget, max_batch_rows
        self.batcher: TargetBatcher | None = None  # the target's batcher, once it is built
        self.drafting = DraftingMeans()  # per method: what a drafted round costs and gets
        self.passes: LoadBudget | None = None
        self.lock = threading.Lock()  # reading the batcher's pass times; never held across a remote call
        self._measuring = threading.Lock()  # one thread measures the pass costs, the others wait for it

    def pass_costs(self) -> LoadBudget:
        """The pass costs, measured once (by the first caller; the others wait for it)."""
        if self.passes is None:
            with self._measuring:
                if self.passes is None:
                    sizes = [n for n in PROFILED_ROWS if n <= max(2, self.max_batch_rows)]
                    costs = self.target.call(self.target.wait_ready(), "pass_costs", sizes, check=False)
                    self.passes = LoadBudget(self.budget, costs)
        return self.passes

    def round_budget(self, stats: RequestStats, spent: list[float], payoff: Payoff, paced: bool,
                     reading: Reading | None, prior_ms: float = 0.0) -> int:
        """This round's tree size: the budget alone while drafting pays for this request (`payoff`; else plain
        steps and exploring rounds drafted without the middle drafter), smaller as more requests share the
        target's passes. `spent`: the request's drafting seconds so far, as last seen here (DraftingMeans).
        `paced`: Payoff applies (the scheduler's or heuristic's greedy requests). A fixed schedule alone drafts
        every round, as it was asked to (as in `treegraft eval`), and so does a sampled request: Payoff decides
        from timings, and a sampled text must depend on its seed alone. `reading`: where the request stands, to
        price the middle drafter's read of the context it has not seen (None: no middle drafter). `prior_ms`: a
        drafted round's milliseconds before the method's rounds measured any (a middle call's, where the policy
        may call it: a burst of requests that starts on a fresh engine must not take drafting for free), and the
        least a drafted round is priced under load (LoadBudget's `call_ms`)."""
        drafting_ms = self.drafting.update(stats, payoff, spent, prior_ms)
        lb = self.pass_costs()  # measured by the first round that needs them, unless warm() measured them
        with self.lock:
            while self.batcher.unread:  # what passes really cost, shared as they are
                lb.observe_pass(*self.batcher.unread.popleft())
        if stats.accepted and payoff.middle:  # exploring rounds (the n-gram drafter alone) would skew it
            lb.observe(stats.tree_sizes[-1], stats.accepted[-1])
        return lb(self.admission.active, drafting_ms, payoff if paced else None, reading, prior_ms)

    def pass_ms(self) -> dict[int, float] | None:
        """The pass costs by rows (None before they were measured)."""
        lb = self.passes
        return None if lb is None else dict(zip(lb.sizes.astype(int).tolist(), lb.ms.tolist()))

    def state(self) -> dict:
        """See Coordinator.load_state."""
        lb = self.passes
        return {"active": self.admission.active,
                "drafting_ms": {k: v.get("ms") for k, v in self.drafting.by_method.items()},
                "pass_ms": self.pass_ms(), "alpha": None if lb is None else lb.alpha,
                "recent_passes": [] if self.batcher is None else list(self.batcher.recent)}
