"""The target model as a worker group: one actor per GPU (tensor-parallel rank) in a STRICT_PACK
placement group, torch.distributed inside each, the model sharded by transformers' own tensor
parallelism (`DistributedConfig(tp_size=...)`; `tp_plan="auto"` on releases without it).

Every rank runs the same forward on the same inputs: the group sends one request's prompt or pruned
tree to all ranks, and rank 0's result is returned (the others' are checked to agree). Each rank keeps
its shard of every request's KV cache; only token ids and trees cross the wire.

Faults: one request's bad work fails that request alone (batch.BatchedTarget answers it with ItemFailed);
an exception a live worker raises fails only the call it raised in; only a rank that is gone (dead, silent
past dist_timeout_s, a broken collective, shards out of step) makes the group rebuild.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from datetime import timedelta

import psutil
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegraft_dist.decoding.batch import PREFILL, STEP, VERIFY, BatchedTarget, ItemFailed, Work, take_pass
from treegraft_dist.decoding.costs import PROFILE_PAST, forward_ms, prefilled
from treegraft_dist.decoding.errors import EngineUnavailable, RequestFailed
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.tree import DraftTree
from treegraft_dist.decoding.verify import Verdict
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import check_supported, load_config, load_model, pick_dtype

from .resources import Resources, reserve

log = logging.getLogger(__name__)

# TargetGroup.state
STARTING, READY, REBUILDING, FAILED = "starting", "ready", "rebuilding", "failed"


class TargetGroupError(EngineUnavailable):
    """The target group lost a rank (the requests in flight on it are lost) or is being rebuilt, or could
    not be: the request can be sent again once the group is ready."""


def load_sharded(path: str, tp: int, device: str, dtype: str) -> CausalLM:
    """Load `path` sharded over the `tp` ranks of the initialised default process group."""
    if tp == 1:
        return load_model(path, device, dtype).lm
    from transformers import AutoModelForCausalLM

    kwargs = {"config": load_config(path, tp), "dtype": pick_dtype(dtype, torch.device(device))}
    try:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=tp)
    except ImportError:  # transformers before DistributedConfig: the model's own plan, same sharding
        kwargs["tp_plan"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    check_supported(model.config, path, tp)  # the attention implementation transformers resolved
    return CausalLM(model)


class TargetWorker:
    """Actor: one tensor-parallel rank; holds one TargetVerifier (KV cache shard) per request id."""

    def __init__(self, path: str, rank: int, resources: Resources, sampling: SamplingParams, dtype: str):
        if resources.torch_threads:
            torch.set_num_threads(resources.torch_threads)
        self.path, self.rank, self.res, self.sampling, self.dtype = path, rank, resources, sampling, dtype
        self.lm: CausalLM | None = None
        self.store = None  # rank 0: the process group's store, served from rendezvous() on
        self.batch: BatchedTarget | None = None  # every request's KV cache shard, by request id

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) of the process group's store, asked of rank 0: it serves the store itself on a port
        the system picks, and keeps it bound until the group is formed, so no other process can take the port
        between its choice and its use (as one probed, closed and reopened later could be)."""
        host = ray.util.get_node_ip_address()
        self.store = torch.distributed.TCPStore(host, 0, self.res.tp, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=self.res.dist_timeout_s))
        return host, self.store.port

    def load(self, master: tuple[str, int] | None) -> None:
        tp = self.res.tp
        if tp > 1:
            timeout = timedelta(seconds=self.res.dist_timeout_s)
            store = self.store if self.rank == 0 else torch.distributed.TCPStore(
                master[0], master[1], tp, is_master=False, timeout=timeout)
            # Ray gives each rank exactly its own GPU, which is then device 0 of the process; transformers'
            # tensor parallelism reads the rank and world size from the environment.
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                              WORLD_SIZE=str(tp), LOCAL_RANK="0")
            torch.distributed.init_process_group(self.res.backend, store=store, rank=self.rank, world_size=tp,
                                                 timeout=timeout)
        self.lm = load_sharded(self.path, tp, self.res.device, self.dtype)
        self.batch = BatchedTarget(self.lm, self.sampling)

    def run(self, items: list[Work]) -> list:
        """One forward pass over several requests' work (batch.BatchedTarget.run); only rank 0 returns
        prefill caches."""
        out = self.batch.run(items)
        if self.rank:
            out = [(r[0], None) if isinstance(r, tuple) else r for r in out]
        return out

    def vocab_size(self) -> int:
        """Token ids the model takes: [0, vocab_size)."""
        return self.batch.vocab

    def passes(self) -> tuple[int, int]:
        """(forward passes, work items they held) so far."""
        return self.batch.passes, self.batch.items

    def release(self, rid: int) -> None:
        self.batch.release(rid)

    def forward_ms(self, block: int) -> float:
        return forward_ms(self.lm, block)

    def pass_costs(self, sizes: list[int]) -> dict[int, float]:
        """Milliseconds of a verification pass of each size, over one warm cache of PROFILE_PAST tokens."""
        cache = prefilled(self.lm)
        return {n: forward_ms(self.lm, n, cache=cache) for n in sizes}

    def kv_capacity(self) -> tuple[int, int]:
        """(bytes of KV cache one token takes on this rank, bytes this rank can give KV caches): on a GPU
        85% of its free memory after loading, on a CPU half of the memory available."""
        cfg = self.lm.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.lm.dtype.itemsize // self.res.tp
        if self.lm.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.lm.device)[0] * 0.85
        else:
            free = psutil.virtual_memory().available * 0.5
        return max(1, per_token), int(free)


class TargetGroup:
    """Client side of the worker group (lives in the coordinator): builds it, broadcasts each call to
    every rank, and when a rank is lost kills the group, fails the calls in flight and rebuilds it.

    Calls to all ranks are submitted under one lock, so every rank sees the same order of calls (their
    collectives must match) even when several requests run at once. `state` is STARTING until the first
    build, READY, REBUILDING after a lost rank, FAILED when a rebuild failed (the next request that finds it
    so starts another attempt); `rebuilds` counts the lost-rank rebuilds.
    """

    def __init__(self, path: str, resources: Resources, sampling: SamplingParams, dtype: str):
        self.path, self.res, self.sampling, self.dtype = path, resources, sampling, dtype
        self.generation = 0  # bumped by every rebuild: a request's KV cache lives in one generation
        self.rebuilds = 0
        self.state = STARTING
        self.workers: list = []
        self.pg = None
        self._submit = threading.Lock()
        self._build = threading.Lock()
        self._ready = threading.Event()
        self._error: Exception | None = None  # why the last rebuild failed
        self._closed = False

    # -- lifetime -------------------------------------------------------------------------------------
    def build(self) -> None:
        """Reserve the GPUs (PlacementError if the cluster cannot), start the ranks, load the shards."""
        with self._build:
            if self._closed:
                raise TargetGroupError("the engine is shutting down")
            if self.workers:  # another request rebuilt it meanwhile
                return
            self.pg = reserve(self.res.target_bundles(), "STRICT_PACK", f"target group (tp={self.res.tp})",
                              self.res.placement_timeout_s)
            worker = ray.remote(TargetWorker)
            self.workers = [
                worker.options(
                    num_cpus=self.res.target_cpus, num_gpus=self.res.target_gpus, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                ).remote(self.path, r, self.res, self.sampling, self.dtype)
                for r in range(self.res.tp)
            ]
            try:
                master = (ray.get(self.workers[0].rendezvous.remote(), timeout=self.res.dist_timeout_s)
                          if self.res.tp > 1 else None)
                ray.get([w.load.remote(master) for w in self.workers], timeout=self.res.load_timeout_s)
            except Exception:
                self._teardown()
                raise
            self._error = None
            self.state = READY
            self._ready.set()

    def shutdown(self) -> None:
        with self._build:
            self._closed = True
            self._ready.clear()
            self._teardown()

    def _teardown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None

    def _rebuild(self, generation: int) -> None:
        """Replace a group that lost a rank, once per broken generation (the first failing call does it)."""
        with self._submit:
            if generation != self.generation or self.state != READY or self._closed:
                return
            self.generation += 1
            self.rebuilds += 1
            self.state = REBUILDING
            self._ready.clear()
        self._restart()

    def _restart(self) -> None:
        try:
            with self._build:
                self._teardown()
            self.build()
        except Exception as e:  # FAILED: the next request that finds it so tries again
            log.error("the target group could not be rebuilt: %s: %s", type(e).__name__, e)
            self._error = e
            self.state = FAILED

    def wait_ready(self, timeout_s: float = 0.0) -> int:
        """The group's generation once it is usable, waiting at most `timeout_s` (by default not at all: a
        request is not held while the group is rebuilt); TargetGroupError when it is not usable by then.
        A group whose rebuild failed starts another attempt in the background."""
        if self._ready.wait(timeout_s):
            return self.generation
        if self._closed:
            raise TargetGroupError("the engine is shutting down")
        if self.state == FAILED:
            error = self._error
            with self._submit:
                retry = self.state == FAILED and not self._closed
                if retry:
                    self.state = REBUILDING
            if retry:
                threading.Thread(target=self._restart, name="target-rebuild", daemon=True).start()
            raise TargetGroupError(f"the target group (tp={self.res.tp}) could not be rebuilt ({type(error).__name__}: "
                                   f"{error}); another attempt is under way: try again later", retry_after=30.0)
        raise TargetGroupError(f"the target group (tp={self.res.tp}) is {self.state}, after a lost worker or at "
                               "start: try again in a few seconds")

    # -- calls ----------------------------------------------------------------------------------------
    def call(self, generation: int, method: str, *args, check: bool = True):
        """Run `method(*args)` on every rank; rank 0's result (with `check`, the ranks' answers reconciled:
        `_reconcile`). TargetGroupError when the group was rebuilt since `generation` (the request's KV
        cache is gone) or a rank is lost now (the group is rebuilt); RequestFailed when the method raised
        on every rank alike (a live worker's own exception: nothing is rebuilt)."""
        with self._submit:
            if generation != self.generation or not self._ready.is_set():
                raise TargetGroupError("the target group was rebuilt after a worker failure while this request "
                                       "was in flight; its KV cache is lost: submit the request again")
            refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            results = _gather(refs, self.res.dist_timeout_s)
        except RayError as e:
            raise self._lost(generation, method, e) from e
        raised = [r for r in results if isinstance(r, RayTaskError)]
        if raised:
            if len(raised) < len(results) or any(isinstance(e.cause, torch.distributed.DistError) for e in raised):
                # One rank raised where others went on, or a collective broke: the ranks are out of step.
                raise self._lost(generation, method, raised[0]) from raised[0]
            cause = raised[0].cause if raised[0].cause is not None else raised[0]
            raise RequestFailed(f"the target failed during {method} ({type(cause).__name__}: {_first_line(cause)}); "
                                "the requests of that call are lost, the engine goes on") from raised[0]
        if not check:
            return results[0]
        try:
            return _reconcile(results)
        except _OutOfStep as e:
            raise self._lost(generation, method, e) from None

    def _lost(self, generation: int, method: str, e: Exception) -> TargetGroupError:
        """Start the rebuild of a group that lost a rank; the error the calls in flight get."""
        threading.Thread(target=self._rebuild, args=(generation,), name="target-rebuild", daemon=True).start()
        if isinstance(e, _OutOfStep):
            what = f"target ranks disagree on {method}: {e}; their shards are out of step"
        else:
            cause = "died" if isinstance(e, RayActorError) else "failed"
            shown = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e  # not Ray's wrapper
            what = f"a target worker {cause} during {method} ({type(shown).__name__}: {_first_line(shown)})"
        return TargetGroupError(f"{what}; the request is lost and the target group (tp={self.res.tp}) is being "
                                "rebuilt: submit it again")

    def release(self, generation: int, rid: int) -> None:
        with self._submit:
            if generation == self.generation:
                for w in self.workers:
                    w.release.remote(rid)


class _OutOfStep(Exception):
    """The ranks' answers to one call differ where they must agree."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _gather(refs: list, timeout_s: float) -> list:
    """Every rank's answer in order, or the RayTaskError a rank raised (its process is alive). Any other
    Ray error (a rank that is gone) raises at once, and GetTimeoutError when the ranks have not all
    answered within `timeout_s`: a rank blocked in a collective with a dead peer may never return."""
    deadline = time.monotonic() + timeout_s
    done = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise GetTimeoutError(f"{len(pending)} target ranks gave no answer within {timeout_s:g} s")
        try:
            done[ready[0]] = ray.get(ready[0])
        except RayTaskError as e:
            if isinstance(e, RayActorError):
                raise
            done[ready[0]] = e
    return [done[r] for r in refs]


def _reconcile(results: list):
    """Rank 0's answer once every rank's agrees with it. A pass's items are compared one by one: an item
    that failed on any rank is answered with that failure (its request ends, so its cache shards need not
    agree); any other difference means the ranks' shards are out of step (_OutOfStep)."""
    first = results[0]
    if not isinstance(first, list):
        if any(_agreed(r) != _agreed(first) for r in results[1:]):
            raise _OutOfStep(str(results))
        return first
    if any(not isinstance(r, list) or len(r) != len(first) for r in results[1:]):
        raise _OutOfStep(f"answers of different lengths: {results}")
    out = list(first)
    for i, column in enumerate(zip(*results)):
        failed = next((x for x in column if isinstance(x, ItemFailed)), None)
        if failed is not None:
            out[i] = failed
        elif any(_agreed(x) != _agreed(column[0]) for x in column[1:]):
            raise _OutOfStep(f"item {i}: {column}")
    return out


def _agreed(result):
    """The part of a rank's answer every rank must share (prefill: the first token; rank 0 alone
    returns the prefill cache)."""
    if isinstance(result, list):
        return [_agreed(r) for r in result]
    return result[0] if isinstance(result, tuple) else result


GATHER_FRACTION = 0.05  # of the last pass's time: how long a pass may wait for the last one's requests
GATHER_MAX_S = 0.02

class TargetBatcher:
    """Where every request's target work meets (lives in the coordinator, one per target group).

    Request threads hand in their next piece of work (a prefill chunk, a tree to verify, a plain step) and
    wait for its answer; one thread sends whatever is waiting to the group as one forward pass, so the
    trees of concurrent requests are verified together. A pass takes the oldest item, then rounds before
    prompt chunks, up to `max_rows` rows (`batch.take_pass`); a prompt goes in chunks of `prefill_chunk`
    tokens, so a long prefill shares passes with other requests' rounds instead of stalling them. With
    `shared_unscored` (trees sized for the load: Resources.adapt_budget), a prompt whose chunk shares a pass
    with other requests' work is prefilled without its n-gram scores (the target's top-k over its last
    positions, an output-head product every request in the pass would wait for): the target is shared, so its
    rounds are plain steps (LoadBudget), and a burst's first request, admitted before the others, does not make
    them all wait for scores it will not draft with.

    The requests of a pass come back at once with their next piece, each after its own bookkeeping (a plain
    step's is short, a round's longer): the thread waits for them briefly (at most GATHER_FRACTION of the
    last pass's time, GATHER_MAX_S) before it sends the next pass, so that one straggler does not split the
    batch into a pass without it and a pass for it alone. A request that ends says so (`leave`).

    Every wait is bounded: a request waits at most `answer_timeout_s` for an answer (then EngineUnavailable),
    and the batching thread is supervised: should its loop die of an unexpected exception, every request
    waiting on it fails with EngineUnavailable and the loop starts again (`restarts` counts it).
    """

    def __init__(self, group: TargetGroup, max_rows: int, prefill_chunk: int, answer_timeout_s: float,
                 shared_unscored: bool = True):
        self.group, self.max_rows, self.prefill_chunk = group, max_rows, prefill_chunk
        self.answer_timeout_s = answer_timeout_s
        self.shared_unscored = shared_unscored
        self.restarts = 0
        self._waiting: list[tuple[int, Work, _Answer]] = []
        self._in_pass: list[tuple[int, Work, _Answer]] = []
        self._returning: set[int] = set()  # requests of the last pass that have not handed in their next piece
        self._unscored: set[int] = set()  # requests whose prompt shared a pass: prefilled without scores
        self._last_ms = 0.0  # the last pass's milliseconds
        self._wake = threading.Condition()
        self._closed = False
        self.recent: collections.deque = collections.deque(maxlen=256)  # (rows, milliseconds) of recent passes
        self.unread: collections.deque = collections.deque(maxlen=256)  # the same, for one reader (the sizing)
        threading.Thread(target=self._supervise, name="target-batcher", daemon=True).start()

    # -- what request threads call --------------------------------------------------------------------
    def prefill(self, generation: int, rid: int, prompt: list[int], seed: int, want_prefill_cache: bool,
                sampling: SamplingParams | None):
        """(first token, prefill cache or None), the prompt sent in chunks."""
        for start in range(0, len(prompt), self.prefill_chunk):
            end = min(len(prompt), start + self.prefill_chunk)
            out = self.submit(generation, Work(PREFILL, rid, prompt=prompt if start == 0 else None, start=start,
                                               end=end, want_prefill_cache=want_prefill_cache, seed=seed,
                                               sampling=sampling))
        return out

    def verify(self, generation: int, rid: int, tree: DraftTree) -> Verdict:
        return self.submit(generation, Work(VERIFY, rid, tree=tree))

    def step(self, generation: int, rid: int, token: int) -> int:
        return self.submit(generation, Work(STEP, rid, token=token))

    def submit(self, generation: int, work: Work):
        """The answer to `work`: what BatchedTarget.run gives for it, or the exception its request raises
        (ValueError, RequestFailed, EngineUnavailable)."""
        entry = (generation, work, _Answer())
        with self._wake:
            if self._closed:
                raise TargetGroupError("the engine is shutting down")
            self._waiting.append(entry)
            self._wake.notify()
        try:
            return entry[2].get(self.answer_timeout_s)
        finally:
            if not entry[2].done:  # given up on: a pass must not run it after its request ended
                with self._wake:
                    self._waiting = [e for e in self._waiting if e is not entry]

    def leave(self, rid: int) -> None:
        """Request `rid` has ended: the next pass does not wait for it."""
        with self._wake:
            self._unscored.discard(rid)
            if rid in self._returning:
                self._returning.discard(rid)
                self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # -- the batching thread --------------------------------------------------------------------------
    def _supervise(self) -> None:
        while True:
            try:
                self._loop()
                return
            except Exception as e:
                log.exception("the target batcher failed; failing the requests waiting on it and restarting")
                error = EngineUnavailable(f"the target batcher failed ({type(e).__name__}: {e}) and was restarted; "
                                          "this request's work was lost: submit it again", retry_after=1.0)
                with self._wake:
                    lost, self._waiting, self._in_pass = self._in_pass + self._waiting, [], []
                    self.restarts += 1
                for _, _, answer in lost:
                    answer.fail(error)
                time.sleep(0.05)  # a loop that keeps failing does not spin

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._closed:
                    self._wake.wait()
                self._gather()
                if self._closed:
                    for _, _, answer in self._waiting:
                        answer.fail(TargetGroupError("the engine is shutting down"))
                    self._waiting = []
                    return
                self._in_pass = batch = self._take()
            self._run(batch)
            with self._wake:
                self._in_pass = []
                self._returning = {w.rid for _, w, _ in batch}

    def _gather(self) -> None:
        """Under the lock: wait (briefly, bounded) until every request of the last pass that still runs has
        handed in its next piece."""
        deadline = time.monotonic() + min(GATHER_MAX_S, GATHER_FRACTION * self._last_ms / 1e3)
        while not self._closed:
            self._returning -= {w.rid for _, w, _ in self._waiting}
            left = deadline - time.monotonic()
            if not self._returning or left <= 0:
                return
            self._wake.wait(left)

    def _run(self, batch: list) -> None:
        """One pass: every answer set, with its item's result or its request's error."""
        generation = batch[0][0]
        started = time.perf_counter()
        try:
            results = self.group.call(generation, "run", [w for _, w, _ in batch])
        except Exception as e:  # every request in the pass gets the group's error
            for _, _, answer in batch:
                answer.fail(e)
            return
        timed = (sum(w.rows for _, w, _ in batch), 1e3 * (time.perf_counter() - started))
        self._last_ms = timed[1]
        self.recent.append(timed)
        self.unread.append(timed)
        for (_, _, answer), result in zip(batch, results, strict=True):
            if isinstance(result, ItemFailed):
                answer.fail(result.error())
            else:
                answer.put(result)

    def _take(self) -> list:
        """The next pass: waiting work of the oldest item's group generation, chosen by `take_pass`."""
        generation = self._waiting[0][0]
        same = [i for i, (g, _, _) in enumerate(self._waiting) if g == generation]
        chosen = {same[j] for j in take_pass([self._waiting[i][1] for i in same], self.max_rows)}
        batch = [e for i, e in enumerate(self._waiting) if i in chosen]
        self._waiting = [e for i, e in enumerate(self._waiting) if i not in chosen]
        if self.shared_unscored and len(batch) > 1:  # a prompt sharing a pass goes unscored, to its last chunk
            self._unscored.update(w.rid for _, w, _ in batch if w.kind == PREFILL and w.want_prefill_cache)
        for _, w, _ in batch:
            if w.kind == PREFILL and w.rid in self._unscored:
                w.want_prefill_cache = False
        return batch


class _Answer:
    """A result one thread waits for and another sets (the first value or error set is the answer)."""

    def __init__(self):
        self._done = threading.Event()
        self._value = self._error = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def put(self, value) -> None:
        if not self._done.is_set():
            self._value = value
            self._done.set()

    def fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def get(self, timeout_s: float | None = None):
        if not self._done.wait(timeout_s):
            raise EngineUnavailable(f"the target gave no answer within {timeout_s:g} s: the engine is overloaded "
                                    "or a worker is stuck; try again later")
        if self._error is not None:
            raise self._error
        return self._value
