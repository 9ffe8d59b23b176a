"""The coordinator actor: owns each request's draft tree, drives the rounds, grafts what the drafters
return, and sends the pruned tree to the target group.

It is a threaded actor, one thread per request in flight, so rounds of different requests overlap: one
request's tree is drafted on the middle drafter or the n-gram actor while others are verified, and the
trees (and plain steps, and prompt chunks) that wait for the target at the same time go in one forward
pass (`TargetBatcher`), with trees sized for the load (load.py) and requests admitted as their KV caches
fit (admission.py). Within a request, the middle drafter catches up on the newly accepted tokens (`prefetch`)
while the round's first n-gram steps run. A request starts and finishes as in the single-process Decoder
(request.start_request, request.finish_request) and its rounds are the engine's own loop (`speculate`,
`draft_tree`), driven through drafter proxies (drafters.py); the scheduler runs here, next to the tree it reads.

A request's input is checked here before any target work (ValueError); its faults stay with it
(RequestFailed); every wait it makes is bounded (admission: QueueTimeout; the target: EngineUnavailable);
while the target group is rebuilt a new request is turned away at once (TargetGroupError). `health()`
answers from counters alone, whatever the requests are doing.
"""

from __future__ import annotations

import copy
import itertools
import threading

import ray

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import AR_METHOD, check_request, decode_plain, resolve_policy, speculate
from treegraft_dist.decoding.ngram import NGramDrafter
from treegraft_dist.decoding.request import (
    DeepeningCalibration,
    Generation,
    Request,
    finish,
    finish_request,
    may_call_middle,
    start_request,
)
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import SchedulePolicy
from treegraft_dist.decoding.signals import READ_BLOCK, Timings
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree
from treegraft_dist.decoding.verify import Verdict

from .admission import Admission
from .drafters import FallbackDrafter, RemoteDrafter, RoundDrafter, RoundSpec
from .life import DrafterActors
from .load import LoadBudgeting
from .resources import Resources
from .streams import StreamRegistry
from .target import READY, TargetBatcher, TargetGroup


class Coordinator:
    """The actor's methods over its parts: the drafter actors' life (`life.DrafterActors`), the target group and
    its batcher, admission (`Admission`), tree sizes under load (`LoadBudgeting`) and the streams
    (`StreamRegistry`). A request's own state and rounds are the engine's (request.py, engine.speculate)."""

    def __init__(self, target_path: str, middle_path: str | None, tree: TreeConfig, sampling: SamplingParams,
                 resources: Resources, dtype: str, control_pg, timings: Timings | None = None,
                 policies: dict[str, SchedulePolicy] | None = None):
        self.cfg, self.res = tree, resources
        self.middle_path = middle_path
        # Policies a request may name (DistributedEngine's `policies`, checked there); the n-gram host holds them too.
        self.policies = dict(policies or {})
        self.target = TargetGroup(target_path, resources, sampling, dtype)
        self.life = DrafterActors(tree, resources, middle_path, dtype, control_pg, self.policies)
        self.admission = Admission(resources.queue_timeout_s)
        self.load = LoadBudgeting(self.target, self.admission, tree.budget, resources.max_batch_rows)
        self.streams = StreamRegistry()
        self.batcher: TargetBatcher | None = None
        self._deepening = DeepeningCalibration()  # how far the middle's confidence past the depth holds
        self._timings = timings
        self._timings_lock = threading.Lock()
        self._ids = itertools.count()
        self._progress: dict[int, int] = {}
        self._vocab = 0  # prompt ids must be below it; learnt from the target at start
        self._started = False

    # -- lifetime -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the drafters and the target group; PlacementError when the GPUs are not there."""
        self.life.spawn()
        self.target.build()
        # An answer waits for the pass in flight and then its own, each bounded by dist_timeout_s (_gather).
        self.batcher = self.load.batcher = TargetBatcher(self.target, self.res.max_batch_rows,
                                                         self.res.prefill_chunk, 2 * self.res.dist_timeout_s,
                                                         shared_unscored=self.res.adapt_budget)
        gen = self.target.wait_ready()
        per_token, free = self.target.call(gen, "kv_capacity", check=False)
        budget = free if self.res.kv_cache_gb is None else self.res.kv_cache_gb * 1e9
        self.admission.capacity = int(budget // per_token)  # tokens
        self._vocab = self.target.call(gen, "vocab_size")
        self.life.wait_ready()
        self._started = True

    def shutdown(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.target.shutdown()
        self.life.shutdown()

    # -- introspection (tests, fault drills) ----------------------------------------------------------
    @ray.method(concurrency_group="control")
    def health(self) -> dict:
        """{"state": "starting" | "ready" | "rebuilding" | "failed", "rebuilds": lost-rank rebuilds of the target
        group, "running": requests admitted and running, "waiting": requests waiting for admission,
        "kv_used_tokens", "kv_capacity_tokens": KV cache reserved and held, in tokens (a request reserves
        twice its length: a pass holds a working copy of its cache), "batcher_restarts"}. Read from counters
        alone: no lock a request may hold, no remote call."""
        state, batcher, admission = self.target.state, self.batcher, self.admission
        return {"state": state if self._started or state != READY else "starting", "rebuilds": self.target.rebuilds,
                "running": admission.active, "waiting": admission.queued, "kv_used_tokens": admission.used,
                "kv_capacity_tokens": admission.capacity,
                "batcher_restarts": 0 if batcher is None else batcher.restarts}

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[int, int]:
        """Tokens generated so far by each request in flight."""
        return dict(self._progress)

    @ray.method(concurrency_group="control")
    def actors(self) -> dict:
        return {"ngram": self.life.ngram_host, "middle": self.life.middle_host,
                "target": list(self.target.workers)}

    @ray.method(concurrency_group="control")
    def target_passes(self) -> tuple[int, int]:
        """(target forward passes, pieces of request work they held) since the group was built."""
        return self.target.call(self.target.wait_ready(), "passes", check=False)

    @ray.method(concurrency_group="control")
    def load_state(self) -> dict:
        """What sizes trees under load: requests active, the pass costs and acceptance `LoadBudget` works
        from (None before passes were first shared), the drafting milliseconds a round per method, and
        the (rows, milliseconds) of the latest passes as the batcher timed them."""
        return self.load.state()

    @property
    def timings(self) -> Timings:
        """The target's and the middle drafter's forward times over a full-budget tree, measured once: by the
        first request that needs them, while any others that start meanwhile wait for that measurement
        (each measuring on its own would queue one profile per request on the target's passes)."""
        if self._timings is None:
            with self._timings_lock:
                if self._timings is None:
                    gen = self.target.wait_ready()
                    t_tgt = self.target.call(gen, "forward_ms", self.cfg.budget, check=False)
                    t_mid, t_read = 1.0, 0.0
                    middle = self.life.middle_host
                    if middle:
                        t_mid, t_read = ray.get([middle.forward_ms.remote(n) for n in (self.cfg.budget, READ_BLOCK)],
                                                timeout=self.res.load_timeout_s)
                    self._timings = Timings(t_tgt, t_mid, t_read / READ_BLOCK if middle else 0.0)
        return self._timings

    def warm(self) -> dict:
        """Measure now what the first requests would otherwise wait for: the forward times a signal-reading
        policy needs and, where trees are sized (adapt_budget), the pass costs that size them. A server calls this
        before it answers, so its first users do not pay for it."""
        if self.middle_path is not None:
            _ = self.timings
        if self.res.adapt_budget:
            self.load.pass_costs()
        return {"t_tgt_ms": None if self._timings is None else self._timings.t_tgt_ms,
                "t_mid_ms": None if self._timings is None else self._timings.t_mid_ms,
                "pass_ms": self.load.pass_ms()}

    # -- requests -------------------------------------------------------------------------------------
    def resolve_policy(self, method) -> SchedulePolicy:
        """A policy the engine holds by that name (a request's own copy: a policy may keep state for the request
        it serves, or buffers its decisions write, as a policy that arrived with the request had), else a schedule
        name or pattern, or a policy object."""
        named = self._named(method)
        if named is not None:
            return copy.copy(self.policies[named])
        return resolve_policy(method, self.cfg.depth, self.middle_path is not None)

    def _named(self, method) -> str | None:
        """`method` when it names a policy the engine holds, else None."""
        return method if isinstance(method, str) and method in self.policies else None

    def generate(self, prompt: list[int], max_new_tokens: int, method="all-small", eos_ids=(), seed: int = 0,
                 sampling: SamplingParams | None = None) -> Generation:
        """One request to the end; `sampling` overrides the engine's for this request."""
        return self._run(prompt, max_new_tokens, method, eos_ids, seed, sampling)

    def stream(self, key: str, prompt: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
               seed: int = 0, sampling: SamplingParams | None = None):
        """One request as a Ray streaming generator: {"tokens": [new ids]} as rounds accept them (cut as
        `generate` cuts them), then {"stats": RequestStats}. `cancel(key)` (or the caller dropping the
        stream) ends the request after the round in flight, with the stats of what it generated."""
        self._check(prompt, max_new_tokens, seed, sampling)
        yield from self.streams.stream(key, max_new_tokens, set(eos_ids), lambda on_tokens, cancelled: self._run(
            prompt, max_new_tokens, method, eos_ids, seed, sampling, on_tokens, cancelled))

    @ray.method(concurrency_group="control")
    def cancel(self, key: str) -> bool:
        """Stop the streamed request `key` after its round in flight (or before any target work, when it has
        not been admitted yet); False when it is not running."""
        if not self.streams.cancel(key):
            return False
        self.admission.wake()  # a request waiting for admission leaves the queue
        return True

    def _check(self, prompt, max_new_tokens, seed, sampling) -> None:
        """ValueError for input the target cannot run (engine.check_request, against the target's vocabulary)."""
        check_request(prompt, max_new_tokens, seed, self._vocab or None, sampling)

    def _run(self, prompt, max_new_tokens, method, eos_ids, seed, sampling, on_tokens=None,
             cancelled: threading.Event | None = None) -> Generation:
        """One request: checked, admitted, run. A request cancelled before it is admitted (or as it is)
        never reaches the target: its Generation is empty."""
        self._check(prompt, max_new_tokens, seed, sampling)
        policy = None if method == AR_METHOD else self.resolve_policy(method)
        self.target.wait_ready()  # TargetGroupError at once while the group is rebuilt: the queue is no place to wait
        tokens = self.admission.admit(len(prompt) + max_new_tokens + self.cfg.max_tree_depth + 1, cancelled)
        if tokens is None:
            return self._nothing(policy, prompt, max_new_tokens, eos_ids)
        rid = next(self._ids)
        self._progress[rid] = 0

        def progress(out: list[int]) -> bool:
            self._progress[rid] = len(out)
            return on_tokens is not None and on_tokens(out)

        gen = None
        try:
            if cancelled is not None and cancelled.is_set():
                return self._nothing(policy, prompt, max_new_tokens, eos_ids)
            gen = self.target.wait_ready()
            if policy is None:
                return self._generate_ar(rid, gen, list(prompt), max_new_tokens, set(eos_ids), seed, sampling,
                                         progress)
            return self._generate_spec(rid, gen, policy, self._named(method), list(prompt), max_new_tokens,
                                       set(eos_ids), seed, sampling, progress)
        finally:
            del self._progress[rid]
            if self.batcher is not None:
                self.batcher.leave(rid)
            if gen is not None:
                self.target.release(gen, rid)
            self.admission.leave(tokens)

    @staticmethod
    def _nothing(policy, prompt, max_new_tokens, eos_ids) -> Generation:
        """The Generation of a request cancelled before any target work."""
        stats = RequestStats(AR_METHOD if policy is None else policy.name, prompt_tokens=len(prompt))
        return finish([], stats, PhaseTimer(stats), max_new_tokens, set(eos_ids))

    def _generate_ar(self, rid, gen, prompt, max_new, eos, seed, sampling, progress) -> Generation:
        return decode_plain(lambda p: self.batcher.prefill(gen, rid, p, seed, False, sampling)[0],
                            lambda tok: self.batcher.step(gen, rid, tok), prompt, max_new, eos,
                            on_tokens=progress)

    def _generate_spec(self, rid, gen, policy, named, prompt, max_new, eos, seed, sampling, progress) -> Generation:
        """`named`: the name the n-gram host knows `policy` by (it travels instead of the policy), or None."""
        greedy = (sampling or self.target.sampling).greedy
        pattern = getattr(policy, "pattern", None)  # fixed schedules: known in advance
        # The middle drafter catches up on each round's accepted tokens at once, unless layer 1 calls it anyway
        # (the catch-up would only split that call in two).
        prefetch = self.res.middle_prefetch and (pattern is None or pattern[0] == "0")

        def drafters(req: Request) -> tuple[FallbackDrafter, FallbackDrafter | None]:
            """The request's drafters on the drafter actors, each falling back on n-gram drafting here."""
            rounds = RoundSpec(req.cfg, policy, req.context, history=greedy, policy_name=named)
            self.life.replace_dead(alone=self.admission.active <= 1)
            # A drafter call waits at most as long as a (restarted) host may take to load its model.
            bound = self.res.load_timeout_s
            # Beside other requests, rounds start as plain steps (LoadBudget): the n-gram host hears of the request
            # only once a round drafts, and of a request that never does only its text, for the history.
            under_load = self.res.adapt_budget and self.admission.active > 1
            ngram = FallbackDrafter(RemoteDrafter(self.life.ngram_host, rid, ORIGIN_NGRAM, rounds, bound,
                                                  lazy=under_load, remember=self.res.history_tokens > 0),
                                    NGramDrafter.from_config(req.cfg), self.life.ngram_died, mirror=True)
            middle = None
            if self.life.middle_host is not None and may_call_middle(policy):
                middle = FallbackDrafter(RemoteDrafter(self.life.middle_host, rid, ORIGIN_MIDDLE, timeout_s=bound,
                                                       lazy=True),
                                         ngram, self.life.middle_died, prefetch=prefetch)
                if prefetch and under_load:
                    middle.prefetch = False  # under load: catch up only once a round drafts (round_budget)
            return ngram, middle

        # The target's top-k log-probs over the prompt only score n-gram drafts. Under load the rounds are plain
        # steps (LoadBudget): a request admitted beside others does not pay for them in its prefill.
        scores = not (self.res.adapt_budget and self.admission.active > 1)
        req = start_request(prompt, max_new, eos, policy, self.cfg, timings=lambda: self.timings,
                            prefill=lambda p: self.batcher.prefill(gen, rid, p, seed, scores, sampling),
                            drafters=drafters, calibration=self._deepening)
        out: list[int] = []
        if max_new:
            try:
                out = self._rounds(req, rid, gen, prefetch, greedy and pattern is None, progress)
            except BaseException:
                req.release()
                raise
        return finish_request(req, out)

    def _rounds(self, req: Request, rid: int, gen: int, prefetch: bool, paced: bool, progress) -> list[int]:
        """speculate over the drafter actors, with trees sized for the load (Resources.adapt_budget).
        `prefetch`: the middle drafter may catch up ahead of a round; `paced`: LoadBudgeting.round_budget's."""
        middle = req.middle
        payoff, spent = self.load.drafting.start(req.policy.name)
        draft = RoundDrafter(req.ngram, middle, req.timer)

        def round_budget() -> int:
            reading = None if middle is None else req.reading(self.timings.read_ms)
            size = self.load.round_budget(req.stats, spent, payoff, paced, reading,
                                          0.0 if middle is None else self.timings.t_mid_ms)
            draft.middle_on = payoff.middle
            if prefetch and middle is not None:  # a round without the middle needs no catch-up: leave its actor free
                middle.prefetch = size > 1 and payoff.middle
            return size

        def verify(pruned: DraftTree) -> Verdict:
            if pruned.size == 1:  # a plain step: the same target work as plain decoding's
                return Verdict([], [self.batcher.step(gen, rid, int(pruned.tokens[0]))])
            return self.batcher.verify(gen, rid, pruned)

        return speculate(req, verify, draft=draft, budget=round_budget if self.res.adapt_budget else None,
                         on_tokens=progress)
