"""The driver-side API of the distributed engine: what `treegraft generate --distributed` calls."""

from __future__ import annotations

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import AR_METHOD, Generation, resolve_policy
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import SchedulePolicy
from treegraft_dist.decoding.signals import Timings
from treegraft_dist.models.loading import load_config

from .coordinator import Coordinator
from .resources import COORDINATOR_BUNDLE, Resources, reserve

# What health() answers for a coordinator that is gone or does not answer.
DEAD = {"state": "dead", "rebuilds": 0, "running": 0, "waiting": 0, "kv_used_tokens": 0, "kv_capacity_tokens": 0,
        "batcher_restarts": 0}


class DistributedEngine:
    """TreeGraft over Ray actors, with the output of the single-process `Decoder`.

    `target`, `middle`: saved model folders (or hub ids) every node can read; `middle=None` drafts with
    n-gram only. `address`: a running Ray cluster ("auto", "ray://host:10001", ...); None joins the
    cluster this process already belongs to, or starts a local one. Construction raises PlacementError
    (within `resources.placement_timeout_s`) when the cluster lacks the resources. `policies`: schedule
    policies by name (e.g. {"treegraft": the fitted scheduler}), sent to the actors once, so that a request
    names one (`method="treegraft"`) instead of carrying the policy (its weights, its value heads) itself.
    """

    def __init__(self, target: str, middle: str | None = None, tree: TreeConfig = TreeConfig(),
                 resources: Resources = Resources(), address: str | None = None,
                 sampling: SamplingParams = SamplingParams(), dtype: str = "auto", timings: Timings | None = None,
                 policies: dict[str, SchedulePolicy] | None = None):
        load_config(target, resources.tp)  # a model the ranks cannot shard fails here, before any placement
        policies = {name: resolve_policy(p, tree.depth, middle is not None) for name, p in (policies or {}).items()}
        if AR_METHOD in policies:
            raise ValueError(f"{AR_METHOD!r} is plain decoding and cannot name a policy: choose another name")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address)
        self.resources = resources
        self.coordinator = self.pg = None
        self.pg = reserve(resources.control_bundles(with_middle=middle is not None), "PACK",
                          "coordinator and drafters", resources.placement_timeout_s)
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=COORDINATOR_BUNDLE)
        # Threads: one per request in flight; health(), progress(), actors(), cancel() and the other
        # introspection calls have their own, so they answer while every request thread is busy.
        self.coordinator = ray.remote(concurrency_groups={"control": 4})(Coordinator).options(
            num_cpus=resources.coordinator_cpus, max_concurrency=resources.max_requests, max_restarts=0,
            scheduling_strategy=strategy,
        ).remote(target, middle, tree, sampling, resources, dtype, self.pg, timings, policies)
        try:
            _get(self.coordinator.start.remote())
        except BaseException:
            self.shutdown()
            raise

    def submit(self, prompt_ids: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
               seed: int = 0, sampling: SamplingParams | None = None) -> ray.ObjectRef:
        """Start one request; `result(ref)` waits for its Generation. `sampling` overrides the engine's."""
        return self.coordinator.generate.remote(list(prompt_ids), max_new_tokens, method, tuple(eos_ids), seed,
                                                sampling)

    def stream(self, key: str, prompt_ids: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
               seed: int = 0, sampling: SamplingParams | None = None):
        """Start one request as a stream: a Ray ObjectRefGenerator (iterate it, or `async for` it) of
        {"tokens": [new ids]} as rounds accept them, then {"stats": RequestStats}. `key` names it for
        `cancel`; it must be unique among the requests in flight."""
        return self.coordinator.stream.remote(key, list(prompt_ids), max_new_tokens, method, tuple(eos_ids), seed,
                                              sampling)

    def cancel(self, key: str) -> ray.ObjectRef:
        """Stop the streamed request `key` after its round in flight (a ref to whether it was running)."""
        return self.coordinator.cancel.remote(key)

    @staticmethod
    def result(ref: ray.ObjectRef) -> Generation:
        return _get(ref)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, method="all-small", eos_ids=(),
                 seed: int = 0, sampling: SamplingParams | None = None) -> Generation:
        """Same arguments and result as `treegraft_dist.decoding.engine.Decoder.generate`."""
        return self.result(self.submit(prompt_ids, max_new_tokens, method, eos_ids, seed, sampling))

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int, method="all-small", eos_ids=(),
                      seed: int = 0) -> list[Generation]:
        """All requests in flight at once (up to resources.max_requests); results in prompt order."""
        refs = [self.submit(p, max_new_tokens, method, eos_ids, seed) for p in prompts]
        return [self.result(r) for r in refs]

    def health(self, timeout_s: float = 5.0) -> dict:
        """Never raises: {"state": "ready" | "starting" | "rebuilding" | "failed" | "dead", "rebuilds": target
        group rebuilds after a lost worker, "running": requests admitted and running, "waiting": requests
        waiting for admission, "kv_used_tokens", "kv_capacity_tokens": KV cache reserved and held, in tokens,
        "batcher_restarts"}. "failed": the target group could not be rebuilt (each new request starts
        another attempt); "dead": the coordinator is gone or gave no answer within `timeout_s`."""
        try:
            return ray.get(self.coordinator.health.remote(), timeout=timeout_s)
        except Exception:  # a dead or stuck coordinator, or none (shut down)
            return dict(DEAD)

    def warm(self) -> dict:
        """Measure what the first requests would wait for (Coordinator.warm); what it measured."""
        return _get(self.coordinator.warm.remote())

    def progress(self) -> dict[int, int]:
        """Tokens generated so far by each request in flight."""
        return ray.get(self.coordinator.progress.remote())

    def target_passes(self) -> tuple[int, int]:
        """(target forward passes, pieces of request work they held): more pieces than passes means
        concurrent requests shared passes."""
        return ray.get(self.coordinator.target_passes.remote())

    def load_state(self) -> dict:
        """How trees are sized under load (Coordinator.load_state)."""
        return ray.get(self.coordinator.load_state.remote())

    def actors(self) -> dict:
        """Handles of the actors: {"ngram": ..., "middle": ..., "target": [rank 0, ...]}."""
        return ray.get(self.coordinator.actors.remote())

    def shutdown(self) -> None:
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.shutdown.remote(), timeout=60)
            except RayError:  # a dead coordinator took its actors with it
                pass
            ray.kill(self.coordinator, no_restart=True)
            self.coordinator = None
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "DistributedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _get(ref):
    """ray.get, raising the coordinator's own exception (ValueError, PlacementError, RequestFailed,
    EngineUnavailable and its kinds QueueTimeout and TargetGroupError) rather than Ray's wrapper around it."""
    try:
        return ray.get(ref)
    except RayTaskError as e:
        if e.cause is not None:
            raise e.cause from None
        raise
