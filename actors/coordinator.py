"""The coordinator actor: owns each request's draft tree, drives the rounds, grafts what the drafters
return, and sends the pruned tree to the target group.

It is a threaded actor, one thread per request in flight, so rounds of different requests overlap: one
request's tree is verified on the target while another's is drafted on the middle drafter or the n-gram
actor. Within a request, the middle drafter catches up on the newly accepted tokens (`prefetch`)
while the round's first n-gram steps run. The rounds are the engine's own loop (`speculate`, `draft_tree`),
driven through drafter proxies; the scheduler runs here, next to the tree it reads.
"""

from __future__ import annotations

import itertools
import threading

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegraft_dist.config import TreeConfig
from treegraft_dist.engine import (AR_METHOD, Generation, check_request, decode_plain, finish, resolve_policy,
                                   round_config, speculate, start_drafters)
from treegraft_dist.ngram import NGramDrafter
from treegraft_dist.sampling import SamplingParams
from treegraft_dist.schedule import SchedulePolicy
from treegraft_dist.signals import Timings, context_signals
from treegraft_dist.stats import PhaseTimer, RequestStats
from treegraft_dist.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM

from .drafters import DrafterHost, FallbackDrafter, NeuralSpec, NGramSpec, RemoteDrafter, RoundDrafter, RoundSpec
from .resources import MIDDLE_BUNDLE, NGRAM_BUNDLE, Resources
from .target import TargetGroup


class Coordinator:
    def __init__(self, target_path: str, middle_path: str | None, tree: TreeConfig, sampling: SamplingParams,
                 resources: Resources, dtype: str, control_pg, timings: Timings | None = None):
        self.cfg, self.res, self.control_pg = tree, resources, control_pg
        self.middle_path, self.dtype = middle_path, dtype
        self.target = TargetGroup(target_path, resources, sampling, dtype)
        self._timings = timings
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._progress: dict[int, int] = {}
        self.ngram_host = None
        self.middle_host = None

    # -- lifetime -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the drafters and the target group; PlacementError when the GPUs are not there."""
        self.ngram_host = self._spawn_ngram()
        if self.middle_path is not None:
            self.middle_host = self._spawn_middle()
        self.target.build()
        ray.get([h.ready.remote() for h in (self.ngram_host, self.middle_host) if h is not None])

    def shutdown(self) -> None:
        self.target.shutdown()
        for h in (self.ngram_host, self.middle_host):
            if h is not None:
                ray.kill(h, no_restart=True)

    def _host(self, spec, bundle: int, cpus: float, gpus: float, device: str):
        strategy = PlacementGroupSchedulingStrategy(self.control_pg, placement_group_bundle_index=bundle)
        return ray.remote(DrafterHost).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                                               scheduling_strategy=strategy).remote(spec, device,
                                                                                    self.res.torch_threads)

    def _spawn_middle(self):
        spec = NeuralSpec(self.middle_path, self.dtype, self.cfg.top_k, self.cfg.lookback)
        return self._host(spec, MIDDLE_BUNDLE, self.res.middle_cpus, self.res.middle_gpus, self.res.device)

    def _spawn_ngram(self):
        cfg = self.cfg
        return self._host(NGramSpec(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth, cfg.long_chain), NGRAM_BUNDLE,
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
    def progress(self) -> dict[int, int]:
        """Tokens generated so far by each request in flight."""
        return dict(self._progress)

    def actors(self) -> dict:
        return {"ngram": self.ngram_host, "middle": self.middle_host, "target": list(self.target.workers)}

    @property
    def timings(self) -> Timings:
        if self._timings is None:
            gen = self.target.wait_ready()
            t_tgt = self.target.call(gen, "forward_ms", self.cfg.budget, check=False)
            t_mid = ray.get(self.middle_host.forward_ms.remote(self.cfg.budget)) if self.middle_host else 1.0
            self._timings = Timings(t_tgt, t_mid)
        return self._timings

    # -- requests -------------------------------------------------------------------------------------
    def resolve_policy(self, method) -> SchedulePolicy:
        return resolve_policy(method, self.cfg.depth, self.middle_path is not None)

    def generate(self, prompt: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
                 seed: int = 0) -> Generation:
        check_request(prompt, max_new_tokens)
        policy = None if method == AR_METHOD else self.resolve_policy(method)
        rid = next(self._ids)
        gen = self.target.wait_ready()
        self._progress[rid] = 0
        try:
            if policy is None:
                return self._generate_ar(rid, gen, list(prompt), max_new_tokens, set(eos_ids), seed)
            return self._generate_spec(rid, gen, policy, list(prompt), max_new_tokens, set(eos_ids), seed)
        finally:
            del self._progress[rid]
            self.target.release(gen, rid)

    def _generate_ar(self, rid, gen, prompt, max_new, eos, seed) -> Generation:
        return decode_plain(lambda p: self.target.call(gen, "prefill", rid, p, seed, False)[0],
                            lambda tok: self.target.call(gen, "step", rid, tok), prompt, max_new, eos,
                            on_token=lambda n: self._progress.__setitem__(rid, n))

    def _generate_spec(self, rid, gen, policy, prompt, max_new, eos, seed) -> Generation:
        cfg = round_config(self.cfg, policy, lambda: self.timings)
        stats = RequestStats(policy.name, prompt_tokens=len(prompt))
        context = context_signals(len(prompt), self.timings) if policy.needs_signals else None
        timer = PhaseTimer(stats)
        out: list[int] = []
        drafters = []
        try:
            if max_new:
                with timer.phase("prefill"):
                    first, prefill = self.target.call(gen, "prefill", rid, prompt, seed, True)
                rounds = RoundSpec(cfg, policy, context)
                ngram = FallbackDrafter(RemoteDrafter(self.ngram_host, rid, ORIGIN_NGRAM, rounds),
                                        NGramDrafter.from_config(cfg), self._ngram_died, mirror=True)
                drafters.append(ngram)
                middle = None
                pattern = getattr(policy, "pattern", None)  # fixed schedules: known in advance
                if self.middle_host is not None and (pattern is None or "1" in pattern):
                    middle = FallbackDrafter(RemoteDrafter(self.middle_host, rid, ORIGIN_MIDDLE), ngram,
                                             self._middle_died, prefetch=pattern is None or pattern[0] == "0")
                    drafters.append(middle)
                start_drafters(drafters, prompt, prefill, first)
                out = speculate(first, cfg, policy, ngram, middle, drafters,
                                lambda pruned: self.target.call(gen, "verify", rid, pruned), timer, stats, context,
                                max_new, eos, on_tokens=lambda n: self._progress.__setitem__(rid, n),
                                draft=RoundDrafter(ngram, middle, timer))
        finally:
            for d in drafters:
                d.release()
        return finish(out, stats, timer, max_new, eos)
