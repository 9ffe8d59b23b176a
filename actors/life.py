"""The drafter actors' life: started in the control placement group, checked, restarted when they die.

One `DrafterHost` actor per kind (n-gram on CPU; the middle drafter, when there is one, on its own device).
Each is a plain actor, so its methods run on the worker's main thread: on a pool thread, where Ray runs the
methods of an actor with concurrency groups, the middle drafter's forward took 1.65 times as long
(`python -m jobs.bench.threads`; BENCHMARKS.md). A request that starts alone pings each
actor (`replace_dead`): a dead one answers with an error at once and is restarted before the request drafts; one
still busy does not answer within PING_S and is taken as alive. A death a request meets
(`ngram_died`, `middle_died`, from its FallbackDrafter) restarts the actor for later requests, while the
request in flight finishes on n-gram drafting.
"""

from __future__ import annotations

import logging
import threading

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegraft_dist.decoding.config import TreeConfig

from .drafters import DrafterHost, NeuralSpec, NGramSpec
from .resources import MIDDLE_BUNDLE, NGRAM_BUNDLE, Resources

log = logging.getLogger(__name__)

PING_S = 0.05  # how long a new request waits for an idle drafter actor's answer (a busy one is alive)


class DrafterActors:
    def __init__(self, cfg: TreeConfig, res: Resources, middle_path: str | None, dtype: str, control_pg,
                 policies: dict | None = None):
        """`policies`: the named schedule policies the n-gram host holds for its requests (RoundSpec.policy_name)."""
        self.cfg, self.res, self.middle_path, self.dtype, self.control_pg = cfg, res, middle_path, dtype, control_pg
        self.policies = policies or {}
        self.lock = threading.Lock()  # restarts only: never held across a remote call that waits
        self.ngram_host = None
        self.middle_host = None

    def spawn(self) -> None:
        """Start the actors (they load their models meanwhile: `wait_ready`)."""
        self.ngram_host = self._spawn_ngram()
        if self.middle_path is not None:
            self.middle_host = self._spawn_middle()

    def wait_ready(self) -> None:
        ray.get([h.ready.remote() for h in self.hosts()], timeout=self.res.load_timeout_s)

    def hosts(self) -> list:
        return [h for h in (self.ngram_host, self.middle_host) if h is not None]

    def shutdown(self) -> None:
        for h in self.hosts():
            ray.kill(h, no_restart=True)

    def replace_dead(self, alone: bool = True) -> None:
        """Restart a drafter actor that died since the last request began: with no request in flight on it,
        nothing else notices, and the next request would draft without it. Only for a request that starts
        `alone`: beside others, their calls keep the actors busy (a ping would wait them out), and a death
        meets their calls, which restart the actor."""
        if not alone:
            return
        hosts = [(name, host, died) for name, host, died in (("n-gram", self.ngram_host, self.ngram_died),
                                                            ("middle", self.middle_host, self.middle_died))
                 if host is not None]
        pings = [host.ready.remote() for _, host, _ in hosts]
        ray.wait(pings, num_returns=len(pings), timeout=PING_S)
        for (name, host, died), ping in zip(hosts, pings):
            try:
                ray.get(ping, timeout=0)
            except GetTimeoutError:
                continue  # serving another request's call (or still loading): alive
            except RayActorError:
                log.warning("the %s drafter actor died between requests; restarting it", name)
                died(host)

    def middle_died(self, host) -> None:
        """Restart the middle drafter for later requests (requests in flight finish on n-gram drafting)."""
        with self.lock:
            if host is self.middle_host:
                ray.kill(host, no_restart=True)
                self.middle_host = self._spawn_middle()

    def ngram_died(self, host) -> None:
        """Restart the n-gram drafter for later requests (requests in flight draft n-grams here)."""
        with self.lock:
            if host is self.ngram_host:
                ray.kill(host, no_restart=True)
                self.ngram_host = self._spawn_ngram()

    def _host(self, spec, bundle: int, cpus: float, gpus: float, device: str, policies: dict | None = None):
        strategy = PlacementGroupSchedulingStrategy(self.control_pg, placement_group_bundle_index=bundle)
        return ray.remote(DrafterHost).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                                               scheduling_strategy=strategy).remote(spec, device,
                                                                                    self.res.torch_threads, policies)

    def _spawn_middle(self):
        spec = NeuralSpec(self.middle_path, self.dtype, self.cfg.top_k, self.cfg.lookback, self.cfg.middle_window)
        return self._host(spec, MIDDLE_BUNDLE, self.res.middle_cpus, self.res.middle_gpus, self.res.device)

    def _spawn_ngram(self):
        cfg = self.cfg
        return self._host(NGramSpec(cfg.top_k, cfg.max_n, cfg.chain, cfg.depth, cfg.long_chain,
                                    self.res.history_tokens, cfg.pin_match), NGRAM_BUNDLE,
                          self.res.ngram_cpus, 0, "cpu", self.policies)
