"""Where every actor runs: one resource config, and placement groups that fail fast with a reason.

Two placement groups per engine:
  control  the coordinator, the n-gram drafter (CPU) and the middle drafter (its own GPU), PACK;
  target   one bundle per tensor-parallel rank, one GPU each, STRICT_PACK (all on one node, so the
           ranks talk over NVLink / shared memory); rebuilt when a target worker dies.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

DEVICES = ("cpu", "cuda")
COORDINATOR_BUNDLE, NGRAM_BUNDLE, MIDDLE_BUNDLE = 0, 1, 2


class PlacementError(RuntimeError):
    """The cluster cannot hold the actors asked for; the message names the missing resources."""


@dataclass(frozen=True)
class Resources:
    """tp = tensor-parallel ranks of the target (the group asks for tp * target_gpus GPUs on one node);
    device = where tensors live: "cuda" (NCCL between ranks) or "cpu" (gloo). GPUs are reserved as
    configured whatever the device, so CPU tests place actors on fake GPUs (`ray.init(num_gpus=...)`).
    torch_threads = intra-op threads per model actor (None: torch's default). max_requests = requests
    the coordinator runs at once; their target work is batched into passes of up to max_batch_rows rows
    (prompts in chunks of prefill_chunk tokens), and with adapt_budget each round's tree shrinks as more
    requests share a pass (sizing.LoadBudget). kv_cache_gb bounds the KV caches of the requests admitted
    (None: measured on the target ranks after loading); a request waits until its cache fits, at most
    queue_timeout_s (None: no bound), then fails with QueueTimeout.
    middle_prefetch: the middle drafter catches up on the accepted tokens while the round's first n-gram
    steps run (schedules that do not call it at layer 0), instead of inside its next call.
    history_tokens > 0: the n-gram drafter also matches finished requests' prompts and outputs, up to this
    many tokens of them (least recently used out; ngram.HistoryIndex); 0: each request drafts from its own.
    Timeouts: placement_timeout_s for a placement group to be granted,
    dist_timeout_s for the torch.distributed rendezvous and any collective, load_timeout_s for the ranks to
    load their shards (a big checkpoint, a slow disk, CPU weight packing)."""

    tp: int = 1
    device: str = "cuda"
    target_gpus: float = 1.0  # per rank
    target_cpus: float = 1.0  # per rank
    middle_gpus: float = 1.0
    middle_cpus: float = 1.0
    ngram_cpus: float = 1.0
    coordinator_cpus: float = 1.0
    torch_threads: int | None = None
    max_requests: int = 16
    max_batch_rows: int = 384  # a prompt chunk and 128 rows of other requests' rounds
    prefill_chunk: int = 256
    adapt_budget: bool = True
    kv_cache_gb: float | None = None
    queue_timeout_s: float | None = 60.0
    middle_prefetch: bool = True
    history_tokens: int = 0
    placement_timeout_s: float = 30.0
    dist_timeout_s: float = 120.0
    load_timeout_s: float = 900.0

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {self.tp}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and self.target_gpus <= 0:
            raise ValueError("device 'cuda' needs target_gpus > 0: every target rank owns a GPU")
        for name in ("target_gpus", "target_cpus", "middle_gpus", "middle_cpus", "ngram_cpus", "coordinator_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_requests", "max_batch_rows", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0 (or None: no bound), got {self.queue_timeout_s}")
        if self.history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0 (0: no history), got {self.history_tokens}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0 (or None: measured), got {self.kv_cache_gb}")

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def target_bundles(self) -> list[dict]:
        return [_bundle(self.target_cpus, self.target_gpus) for _ in range(self.tp)]

    def control_bundles(self, with_middle: bool = True) -> list[dict]:
        """Bundles in the order COORDINATOR_BUNDLE, NGRAM_BUNDLE[, MIDDLE_BUNDLE]."""
        out = [_bundle(self.coordinator_cpus, 0), _bundle(self.ngram_cpus, 0)]
        return out + [_bundle(self.middle_cpus, self.middle_gpus)] if with_middle else out


def for_device(device: str, tp: int = 1, **changes) -> Resources:
    """An engine's resources on `device`: on "cuda" every target rank and the middle drafter own a GPU; on
    "cpu" the actors share the cores and ask for no GPUs, and the model actors run torch on every core."""
    if device == "cpu":
        from treegraft_dist.models.precision import physical_cores

        # No middle prefetch: on shared cores its catch-up only competes with the target's pass (measured in
        # BENCHMARKS.md, distributed path). Ray sets OMP_NUM_THREADS to an actor's whole CPUs, at least 1, so
        # the fractional shares that let the actors place together would leave the target one thread: the
        # model actors get the threads a plain process gets here (those `treegraft generate` runs with), and
        # take turns on them (one request's target passes and middle calls alternate). The coordinator is
        # given none and keeps Ray's one; the n-gram host runs no torch products.
        cpu = dict(target_gpus=0, middle_gpus=0, target_cpus=0.25, middle_cpus=0.25, ngram_cpus=0.1,
                   coordinator_cpus=0.1, middle_prefetch=False, torch_threads=physical_cores())
        return Resources(tp=tp, device="cpu", **{**cpu, **changes})
    return Resources(tp=tp, device=device, **changes)


def _bundle(cpus: float, gpus: float) -> dict:
    # Ray rejects an all-zero bundle; a tiny CPU share keeps a zero-CPU actor placeable.
    out = {"CPU": cpus or 0.001}
    if gpus:
        out["GPU"] = gpus
    return out


def reserve(bundles: list[dict], strategy: str, what: str, timeout_s: float) -> PlacementGroup:
    """A placement group that is granted within `timeout_s`, or PlacementError naming what is missing."""
    pg = placement_group(bundles, strategy=strategy)
    if pg.wait(timeout_s):
        return pg
    remove_placement_group(pg)
    raise PlacementError(shortfall(bundles, strategy, what, timeout_s))


def shortfall(bundles: list[dict], strategy: str, what: str, timeout_s: float) -> str:
    need = _total(bundles)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total = _total(nodes)
    avail = ray.available_resources()
    if strategy == "STRICT_PACK":
        best = max(nodes, key=lambda r: min(r.get(k, 0.0) / v for k, v in need.items()), default={})
        missing = {k: v for k, v in need.items() if best.get(k, 0.0) < v}
        where = "on ONE node (STRICT_PACK)"
        have = ", ".join(f"{k} {best.get(k, 0.0):g}" for k in need)
        offer = f"the best node has {have}"
    else:
        missing = {k: v for k, v in need.items() if total.get(k, 0.0) < v}
        where = "in the cluster"
        offer = "cluster total " + ", ".join(f"{k} {total.get(k, 0.0):g}" for k in need)
    if not missing:  # enough in principle, but taken by other actors or placement groups right now
        missing = {k: v for k, v in need.items() if avail.get(k, 0.0) < v}
        where += ", free now"
    names = ", ".join(f"{k} {v:g}" for k, v in (missing or need).items())
    free = ", ".join(f"{k} {avail.get(k, 0.0):g}" for k in need)
    return (f"cannot place the {what} within {timeout_s:g} s: it needs {names} {where} "
            f"({len(bundles)} bundles {bundles}); {offer}; free now: {free}. Add nodes with those "
            f"resources, free them, or lower the request in actors.Resources.")


def _total(resource_dicts) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in resource_dicts:
        for k, v in r.items():
            if k in ("CPU", "GPU", "memory") or not k.startswith(("node:", "object_store")):
                out[k] = out.get(k, 0.0) + float(v)
    return out
