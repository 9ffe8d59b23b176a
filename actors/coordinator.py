"""The coordinator actor: owns each request's draft tree, drives the rounds, grafts what the drafters
return, and sends the pruned tree to the target group.

It is a threaded actor, one thread per request in flight, so rounds of different requests overlap: one
request's tree is drafted on the middle drafter or the n-gram actor while others are verified, and the
trees (and plain steps, and prompt chunks) that wait for the target at the same time go in one forward
pass (`TargetBatcher`), with trees sized for the load (`sizing.LoadBudget`) and requests admitted as
their KV caches fit. Within a request, the middle drafter catches up on the newly accepted tokens (`prefetch`)
while the round's first n-gram steps run. The rounds are the engine's own loop (`speculate`, `draft_tree`),
driven through drafter proxies; the scheduler runs here, next to the tree it reads.

A request's input is checked here before any target work (ValueError); its faults stay with it
(RequestFailed); every wait it makes is bounded (admission: QueueTimeout; the target: EngineUnavailable);
while the target group is rebuilt a new request is turned away at once (TargetGroupError). `health()`
answers from counters alone, whatever the requests are doing.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import (
    AR_METHOD,
    DeepeningCalibration,
    Generation,
    check_request,
    decode_plain,
    finish,
    resolve_policy,
    round_config,
    speculate,
    start_drafters,
    truncate,
)
from treegraft_dist.decoding.errors import QueueTimeout
from treegraft_dist.decoding.ngram import NGramDrafter
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import SchedulePolicy
from treegraft_dist.decoding.signals import READ_BLOCK, Timings, context_signals
from treegraft_dist.decoding.sizing import DraftingMeans, LoadBudget, Payoff, Reading
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM, DraftTree
from treegraft_dist.decoding.verify import Verdict

from .drafters import DrafterHost, FallbackDrafter, NeuralSpec, NGramSpec, RemoteDrafter, RoundDrafter, RoundSpec
from .resources import MIDDLE_BUNDLE, NGRAM_BUNDLE, Resources
from .target import READY, TargetBatcher, TargetGroup

log = logging.getLogger(__name__)

QUEUE_RETRY_AFTER_S = 5.0  # what a request turned away from a full queue is told to wait


class Coordinator:
    def __init__(self, target_path: str, middle_path: str | None, tree: TreeConfig, sampling: SamplingParams,
                 resources: Resources, dtype: str, control_pg, timings: Timings | None = None):
        self.cfg, self.res, self.control_pg = tree, resources, control_pg
        self.middle_path, self.dtype = middle_path, dtype
        self.target = TargetGroup(target_path, resources, sampling, dtype)
        self._timings = timings
        self._timings_lock = threading.Lock()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # request bookkeeping only: never held across a remote call
        self._measuring = threading.Lock()  # one thread measures the pass costs, the others wait for it
        self._progress: dict[int, int] = {}
        self._cancels: dict[str, threading.Event] = {}
        self.batcher: TargetBatcher | None = None
        self._kv = threading.Condition()  # admission: KV cache tokens reserved by the requests admitted
        self._kv_used = self._kv_capacity = 0
        self._active = 0  # requests admitted and running
        self._queued = 0  # requests waiting for admission
        self._vocab = 0  # prompt ids must be below it; learnt from the target at start
        self._started = False
        self._load_budget: LoadBudget | None = None
        self._drafting = DraftingMeans()  # per method: what a drafted round costs and gets
        self._deepening = DeepeningCalibration()  # how far the middle's confidence past the depth holds
        self._cancelled_early: dict[str, None] = {}  # ordered: the oldest are dropped first
        self.ngram_host = None
        self.middle_host = None
        self._watches: dict[int, ray.ObjectRef] = {}  # bundle -> its drafter actor's DrafterHost.watch call

    # -- lifetime -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the drafters and the target group; PlacementError when the GPUs are not there."""
        self.ngram_host = self._spawn_ngram()
        if self.middle_path is not None:
            self.middle_host = self._spawn_middle()
        self.target.build()
        # An answer waits for the pass in flight and then its own, each bounded by dist_timeout_s (_gather).
        self.batcher = TargetBatcher(self.target, self.res.max_batch_rows, self.res.prefill_chunk,
                                     2 * self.res.dist_timeout_s)
        gen = self.target.wait_ready()
        per_token, free = self.target.call(gen, "kv_capacity", check=False)
        budget = free if self.res.kv_cache_gb is None else self.res.kv_cache_gb * 1e9
        self._kv_capacity = int(budget // per_token)  # tokens
        self._vocab = self.target.call(gen, "vocab_size")
        ray.get([h.ready.remote() for h in (self.ngram_host, self.middle_host) if h is not None],
                timeout=self.res.load_timeout_s)
        self._started = True

    def shutdown(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.target.shutdown()
        for h in (self.ngram_host, self.middle_host):
            if h is not None:
                ray.kill(h, no_restart=True)

    def _host(self, spec, bundle: int, cpus: float, gpus: float, device: str):
        strategy = PlacementGroupSchedulingStrategy(self.control_pg, placement_group_bundle_index=bundle)
        host = ray.remote(concurrency_groups={"watch": 1})(DrafterHost).options(
            num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=strategy).remote(
            spec, device, self.res.torch_threads)
        self._watches[bundle] = host.watch.remote()
        return host

    def _replace_dead_hosts(self) -> None:
        """Restart a drafter actor that died since the last request began: with no request in flight on it,
        nothing else notices, and the next request would draft without it."""
        for bundle, host, died in ((NGRAM_BUNDLE, self.ngram_host, self._ngram_died),
                                   (MIDDLE_BUNDLE, self.middle_host, self._middle_died)):
            if host is not None and ray.wait([self._watches[bundle]], timeout=0)[0]:
                log.warning("the %s drafter actor died between requests; restarting it",
                            "n-gram" if bundle == NGRAM_BUNDLE else "middle")
                died(host)

    def _spawn_middle(self):
        spec = NeuralSpec(self.middle_path, self.dtype, self.cfg.top_k, self.cfg.lookback)
        return self._host(spec, MIDDLE_BUNDLE, self.res.middle_cpus, self.res.middle_gpus, self.res.device)

    def _spawn_ngram(self):
        cfg = self.cfg
        return self._host(NGramSpec(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth, cfg.long_chain,
                                    self.res.history_tokens), NGRAM_BUNDLE,
                          self.res.ngram_cpus, 0, "cpu")

    def _middle_died(self, host) -> None:
        """Restart the middle drafter for later requests (requests in flight finish on n-gram drafting)."""
        with self._lock:
            if host is self.middle_host:
                ray.kill(host, no_restart=True)
                self.middle_host = self._spawn_middle()

    def _ngram_died(self, host) -> None:
        """Restart the n-gram drafter for later requests (requests in flight draft n-grams here)."""
        with self._lock:
            if host is self.ngram_host:
                ray.kill(host, no_restart=True)
                self.ngram_host = self._spawn_ngram()

    # -- introspection (tests, fault drills) ----------------------------------------------------------
    @ray.method(concurrency_group="control")
    def health(self) -> dict:
        """{"state": "starting" | "ready" | "rebuilding" | "failed", "rebuilds": lost-rank rebuilds of the target
        group, "running": requests admitted and running, "waiting": requests waiting for admission,
        "kv_used_tokens", "kv_capacity_tokens": KV cache reserved and held, in tokens (a request reserves
        twice its length: a pass holds a working copy of its cache), "batcher_restarts"}. Read from counters
        alone: no lock a request may hold, no remote call."""
        state = self.target.state
        batcher = self.batcher
        return {"state": state if self._started or state != READY else "starting", "rebuilds": self.target.rebuilds,
                "running": self._active, "waiting": self._queued, "kv_used_tokens": self._kv_used,
                "kv_capacity_tokens": self._kv_capacity,
                "batcher_restarts": 0 if batcher is None else batcher.restarts}

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[int, int]:
        """Tokens generated so far by each request in flight."""
        return dict(self._progress)

    @ray.method(concurrency_group="control")
    def actors(self) -> dict:
        return {"ngram": self.ngram_host, "middle": self.middle_host, "target": list(self.target.workers)}

    @ray.method(concurrency_group="control")
    def target_passes(self) -> tuple[int, int]:
        """(target forward passes, pieces of request work they held) since the group was built."""
        return self.target.call(self.target.wait_ready(), "passes", check=False)

    @ray.method(concurrency_group="control")
    def load_state(self) -> dict:
        """What sizes trees under load: requests active, the pass costs and acceptance `LoadBudget` works
        from (None before passes were first shared), the drafting milliseconds a round per method, and
        the (rows, milliseconds) of the latest passes as the batcher timed them."""
        lb = self._load_budget
        return {"active": self._active, "drafting_ms": {k: v.get("ms") for k, v in self._drafting.by_method.items()},
                "pass_ms": None if lb is None else dict(zip(lb.sizes.astype(int).tolist(), lb.ms.tolist())),
                "alpha": None if lb is None else lb.alpha,
                "recent_passes": [] if self.batcher is None else list(self.batcher.recent)}

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
                    if self.middle_host:
                        t_mid, t_read = ray.get([self.middle_host.forward_ms.remote(n) for n in (self.cfg.budget,
                                                                                               READ_BLOCK)],
                                                timeout=self.res.load_timeout_s)
                    self._timings = Timings(t_tgt, t_mid, t_read / READ_BLOCK if self.middle_host else 0.0)
        return self._timings

    # -- requests -------------------------------------------------------------------------------------
    def resolve_policy(self, method) -> SchedulePolicy:
        return resolve_policy(method, self.cfg.depth, self.middle_path is not None)

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
        updates: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            cancelled = self._cancels[key] = threading.Event()
            if key in self._cancelled_early:  # cancelled while it waited for a thread
                self._cancelled_early.pop(key)
                cancelled.set()
        eos, sent = set(eos_ids), 0

        def on_tokens(out: list[int]) -> bool:
            nonlocal sent
            cut = truncate(out, max_new_tokens, eos)
            if len(cut) > sent and not cancelled.is_set():
                updates.put(cut[sent:])
                sent = len(cut)
            return cancelled.is_set()

        def run() -> None:
            try:
                updates.put(self._run(prompt, max_new_tokens, method, eos_ids, seed, sampling, on_tokens, cancelled))
            except BaseException as e:  # handed to the generator, which raises it to the caller
                updates.put(e)

        threading.Thread(target=run, name=f"request-{key}", daemon=True).start()
        try:
            while True:
                item = updates.get()
                if isinstance(item, list):
                    yield {"tokens": item}
                elif isinstance(item, Generation):
                    yield {"stats": item.stats}
                    return
                else:
                    raise item
        finally:
            cancelled.set()
            self._cancels.pop(key, None)

    @ray.method(concurrency_group="control")
    def cancel(self, key: str) -> bool:
        """Stop the streamed request `key` after its round in flight (or before any target work, when it has
        not been admitted yet); False when it is not running."""
        with self._lock:
            event = self._cancels.get(key)
            if event is None:
                self._cancelled_early[key] = None
                while len(self._cancelled_early) > 4096:  # keys of requests that ended meanwhile
                    self._cancelled_early.pop(next(iter(self._cancelled_early)))
                return False
        event.set()
        with self._kv:  # a request waiting for admission leaves the queue
            self._kv.notify_all()
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
        tokens = self._admit(len(prompt) + max_new_tokens + self.cfg.max_tree_depth + 1, cancelled)
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
            return self._generate_spec(rid, gen, policy, list(prompt), max_new_tokens, set(eos_ids), seed, sampling,
                                       progress)
        finally:
            del self._progress[rid]
            if self.batcher is not None:
                self.batcher.leave(rid)
            if gen is not None:
                self.target.release(gen, rid)
            with self._kv:
                self._kv_used -= tokens
                self._active -= 1
                self._kv.notify_all()

    @staticmethod
    def _nothing(policy, prompt, max_new_tokens, eos_ids) -> Generation:
        """The Generation of a request cancelled before any target work."""
        stats = RequestStats(AR_METHOD if policy is None else policy.name, prompt_tokens=len(prompt))
        return finish([], stats, PhaseTimer(stats), max_new_tokens, set(eos_ids))

    def _admit(self, tokens: int, cancelled: threading.Event | None = None) -> int | None:
        """Wait until a request's KV cache fits beside those admitted; a pass holds a working copy of every
        cache in it, so each counts twice. Returns the tokens reserved, or None when `cancelled` was set
        first. ValueError when it could never fit; QueueTimeout after Resources.queue_timeout_s."""
        need = 2 * tokens
        if need > self._kv_capacity:
            raise ValueError(f"the request needs a KV cache of {tokens} tokens (prompt + max_new_tokens + the draft "
                             f"tree), more than the engine holds ({self._kv_capacity // 2} tokens): shorten the "
                             "prompt or ask for fewer tokens")
        bound = self.res.queue_timeout_s
        deadline = None if bound is None else time.monotonic() + bound
        with self._kv:
            self._queued += 1
            try:
                while True:
                    if cancelled is not None and cancelled.is_set():
                        return None
                    if self._kv_used + need <= self._kv_capacity:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise QueueTimeout(f"no room for the request's KV cache ({tokens} tokens) within {bound:g} s: "
                                           f"{self._active} requests hold the engine's {self._kv_capacity // 2} "
                                           "tokens; try again later", retry_after=QUEUE_RETRY_AFTER_S)
                    self._kv.wait(left)
            finally:
                self._queued -= 1
            self._kv_used += need
            self._active += 1
        return need

    def warm(self) -> dict:
        """Measure now what the first requests would otherwise wait for: the forward times a signal-reading
        policy needs and, where trees are sized (adapt_budget), the pass costs that size them. A server calls this
        before it answers, so its first users do not pay for it."""
        if self.middle_path is not None:
            _ = self.timings
        if self.res.adapt_budget:
            self._pass_costs(self.cfg)
        return {"t_tgt_ms": None if self._timings is None else self._timings.t_tgt_ms,
                "t_mid_ms": None if self._timings is None else self._timings.t_mid_ms,
                "pass_ms": None if self._load_budget is None else
                dict(zip(self._load_budget.sizes.astype(int).tolist(), self._load_budget.ms.tolist()))}

    def _pass_costs(self, cfg: TreeConfig) -> LoadBudget:
        if self._load_budget is None:
            with self._measuring:  # measured once; not under self._lock
                if self._load_budget is None:
                    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= max(2, self.res.max_batch_rows)]
                    costs = self.target.call(self.target.wait_ready(), "pass_costs", sizes, check=False)
                    self._load_budget = LoadBudget(cfg.budget, costs)
        return self._load_budget

    def _round_budget(self, cfg: TreeConfig, stats: RequestStats, spent: list[float], payoff: Payoff,
                      paced: bool, reading: Reading | None) -> int:
        """This round's tree size: cfg.budget alone while drafting pays for this request (`payoff`; else plain
        steps and exploring rounds drafted without the middle drafter), smaller as more requests share the
        target's passes. `spent`: the request's drafting seconds so far, as last seen here (DraftingMeans).
        `paced`: Payoff applies (the scheduler's or heuristic's greedy requests). A fixed schedule alone drafts
        every round, as it was asked to (as in `treegraft eval`), and so does a sampled request: Payoff decides
        from timings, and a sampled text must depend on its seed alone. `reading`: where the request stands, to
        price the middle drafter's read of the context it has not seen (None: no middle drafter)."""
        drafting_ms = self._drafting.update(stats, payoff, spent)
        lb = self._pass_costs(cfg)  # measured by the first round that needs them, unless warm() measured them
        with self._lock:
            while self.batcher.unread:  # what passes really cost, shared as they are
                lb.observe_pass(*self.batcher.unread.popleft())
        if stats.accepted:
            lb.observe(stats.tree_sizes[-1], stats.accepted[-1])
        return lb(self._active, drafting_ms, payoff if paced else None, reading)

    def _generate_ar(self, rid, gen, prompt, max_new, eos, seed, sampling, progress) -> Generation:
        return decode_plain(lambda p: self.batcher.prefill(gen, rid, p, seed, False, sampling)[0],
                            lambda tok: self.batcher.step(gen, rid, tok), prompt, max_new, eos,
                            on_tokens=progress)

    def _generate_spec(self, rid, gen, policy, prompt, max_new, eos, seed, sampling, progress) -> Generation:
        cfg = round_config(self.cfg, policy, lambda: self.timings, self._deepening)
        stats = RequestStats(policy.name, prompt_tokens=len(prompt))
        context = context_signals(len(prompt), self.timings) if policy.needs_signals else None
        timer = PhaseTimer(stats)
        out: list[int] = []
        drafters = []
        try:
            if max_new:
                with timer.phase("prefill"):
                    first, prefill = self.batcher.prefill(gen, rid, prompt, seed, True, sampling)
                greedy = (sampling or self.target.sampling).greedy
                rounds = RoundSpec(cfg, policy, context, history=greedy)
                self._replace_dead_hosts()
                # A drafter call waits at most as long as a (restarted) host may take to load its model.
                bound = self.res.load_timeout_s
                ngram = FallbackDrafter(RemoteDrafter(self.ngram_host, rid, ORIGIN_NGRAM, rounds, bound),
                                        NGramDrafter.from_config(cfg), self._ngram_died, mirror=True)
                drafters.append(ngram)
                middle = None
                pattern = getattr(policy, "pattern", None)  # fixed schedules: known in advance
                if self.middle_host is not None and (pattern is None or "1" in pattern):
                    middle = FallbackDrafter(RemoteDrafter(self.middle_host, rid, ORIGIN_MIDDLE, timeout_s=bound),
                                             ngram, self._middle_died, prefetch=self.res.middle_prefetch
                                             and (pattern is None or pattern[0] == "0"))
                    drafters.append(middle)
                prefetch = middle is not None and middle.prefetch
                if prefetch and self.res.adapt_budget and self._active > 1:
                    middle.prefetch = False  # under load: catch up only once a round drafts (round_budget)
                start_drafters(drafters, prompt, prefill, first)

                payoff, spent = self._drafting.start(policy.name)

                draft = RoundDrafter(ngram, middle, timer)

                def round_budget() -> int:
                    done = 1 + sum(stats.accepted)
                    reading = None if middle is None else Reading(len(prompt) + done, max_new - done,
                                                                  self.timings.read_ms)
                    size = self._round_budget(cfg, stats, spent, payoff, greedy and pattern is None, reading)
                    draft.middle_on = payoff.middle
                    if prefetch:  # a round without the middle needs no catch-up: leave the middle actor free
                        middle.prefetch = size > 1 and payoff.middle
                    return size

                def verify(pruned: DraftTree) -> Verdict:
                    if pruned.size == 1:  # a plain step: the same target work as plain decoding's
                        return Verdict([], [self.batcher.step(gen, rid, int(pruned.tokens[0]))])
                    return self.batcher.verify(gen, rid, pruned)

                out = speculate(first, cfg, policy, ngram, middle, drafters, verify, timer, stats, context,
                                max_new, eos, on_tokens=progress, draft=draft,
                                budget=round_budget if self.res.adapt_budget else None)
                self._deepening.observe(stats)
        finally:
            for d in drafters:
                d.release()
        return finish(out, stats, timer, max_new, eos)
