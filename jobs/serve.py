"""The OpenAI-compatible server on Ray Serve.

    serve run serve.yaml                                  # a cluster (the config at the repository root)
    treegraft serve --target T --middle M --tp N --port P  # the same application, started locally

One replica owns one engine: `actors.DistributedEngine` places the target group, the drafters and the
coordinator exactly as `treegraft generate --distributed` does, and every request is one streamed request
to its coordinator (`Coordinator.stream`). Requests run concurrently up to `max_requests`; up to
`max_queued` more wait, each at most `queue_timeout` seconds (then 503 with Retry-After); beyond that the
answer is 429 with Retry-After. Request checks, text streaming, bodies and the /metrics registry are
`treegraft_dist.serving`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics (Prometheus),
GET /health. A request may pick the decoding method with the extra body field "method" (ar, treegraft,
all-small, all-mid or a 0/1 layer pattern); every response carries `metrics.speculative_decoding` and the
header X-Request-Id. With an API key (`api_key`, or the environment variable TREEGRAFT_API_KEY) every route
but /health asks for `Authorization: Bearer KEY`.

What one request can do to the others: nothing. Its input is checked here (`parse_request`) and again in
the engine before any model work; an error while computing its part of a shared pass fails it alone; only a
target rank that is gone rebuilds the group, and while it is rebuilt new requests get 503 at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import inspect
import logging
import os
import sys
import threading
import time
import uuid

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayError, RayTaskError

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import AR_METHOD, resolve_policy
from treegraft_dist.decoding.errors import EngineUnavailable, QueueTimeout
from treegraft_dist.decoding.scheduler import fitted_tree
from treegraft_dist.models.loading import describe_model
from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
from treegraft_dist.serving import (
    DONE,
    MAX_BODY_BYTES,
    ApiError,
    ApiRequest,
    ServedModel,
    ServingMetrics,
    TextStream,
    chunk_body,
    decode_body,
    parse_request,
    response_body,
    sse,
    usage_chunk,
)

api = FastAPI(title="treegraft-dist", docs_url=None, redoc_url=None, openapi_url=None)
log = logging.getLogger("ray.serve")

API_KEY_ENV = "TREEGRAFT_API_KEY"
HEALTH_POLL_S = 2.0  # how often the replica reads its engine's state (the metrics gauges, the 503 shortcut)
# A rebuild that takes longer than this (a lost rank's node gone for good, a group that cannot be placed)
# makes the replica unhealthy, so that Serve replaces it.
REBUILD_GRACE_S = 900.0
_OUTCOMES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "bad_request", 429: "rejected",
             503: "unavailable"}


class _Slot:
    """A running request's hold on one of the replica's `max_requests` places, given back exactly once: by
    the request's end, or, for a streamed answer whose body never started (its client left first), when
    the request's state is dropped."""

    def __init__(self, server: "OpenAIServer"):
        self.server = server

    def release(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.running -= 1
            server.slots.release()

    def __del__(self):
        self.release()


@dataclasses.dataclass
class _Progress:
    """What one request has produced so far."""

    text: TextStream
    arrived: float
    slot: _Slot | None = None
    tokens: int = 0
    stats: object = None
    last_token: int | None = None
    admitted: float | None = None
    first_token: float | None = None


class OpenAIServer:
    """One engine behind the OpenAI API. Arguments are those of `treegraft serve` (and serve.yaml's `args`):
    model names as `treegraft generate` takes them (a folder, a hub id, or an embedded name; `middle`
    "none" drafts with n-grams only), `model_name` the name clients use (default: the target's),
    `method` the default decoding method, `scheduler` a fitted scheduler artifact for the method
    "treegraft" (default: the one fitted for this replica's device from `trajectories`, a `treegraft collect`
    folder of this pair, or from those shipped for the pair, as `treegraft eval` does; the shallow-tree
    heuristic where none ship), `budget` nodes verified
    per round (default: the fitted scheduler's), `queue_timeout` the seconds a request may wait for room
    to run, `api_key` the bearer token clients must send (default: $TREEGRAFT_API_KEY; none: open),
    `draft_history` the tokens of finished requests (prompts and outputs) the n-gram drafter also matches
    (0: none; Resources.history_tokens)."""

    def __init__(self, target: str = DEFAULT_TARGET, middle: str | None = DEFAULT_MIDDLE, model_name: str | None = None,
                 tp: int = 1, device: str = "auto", dtype: str = "auto", method: str = "treegraft",
                 scheduler: str | None = None, budget: int | None = None, max_requests: int = 8,
                 max_queued: int = 64, max_tokens: int = 256, queue_timeout: float = 60.0,
                 api_key: str | None = None, trajectories: str | None = None, draft_history: int = 200_000,
                 cache_dir: str | None = None):
        from actors import DistributedEngine
        from actors.resources import for_device
        from treegraft_dist.models.loading import resolve_pair

        if max_requests < 1 or max_queued < 0 or max_tokens < 1 or not queue_timeout > 0 or draft_history < 0:
            raise ValueError("max_requests and max_tokens must be at least 1, max_queued and draft_history at least "
                             "0, queue_timeout > 0")
        t_src, t_tok, m_src, _ = resolve_pair(target, middle, cache_dir)
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= tp + (m_src is not None) else "cpu"
        resources = for_device(device, tp, max_requests=max_requests, queue_timeout_s=queue_timeout,
                               history_tokens=draft_history)
        self.policy = self._treegraft_policy(scheduler, trajectories, (target, middle), t_src, m_src, resources,
                                             dtype, cache_dir)
        # The tree size (unless given) and width the scheduler was fitted for.
        cfg = fitted_tree(TreeConfig() if budget is None else TreeConfig(budget=budget), self.policy,
                          budget=budget is None)
        self.cfg, self.has_middle = cfg, m_src is not None
        self.default_method = method
        self._check_method(method)
        info = describe_model(t_src, t_tok, tp)
        self.tokenizer = t_tok
        self.eos_ids = tuple(sorted(info.eos_ids))
        self.model = ServedModel(model_name or target.split(":")[-1].rstrip("/").split("/")[-1],
                                 info.max_positions - cfg.max_tree_depth - 1, self.eos_ids, max_tokens)
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        # The requests of the method treegraft name its policy, which the engine's actors hold (sent once).
        self.engine = DistributedEngine(t_src, m_src, cfg, resources, dtype=dtype, policies={"treegraft": self.policy})
        warm = self.engine.warm()  # the first requests would wait for these measurements
        log.info(f"treegraft: measured the target's forward at {warm['t_tgt_ms'] or 0:.0f} ms, the middle's at "
                 f"{warm['t_mid_ms'] or 0:.0f} ms over {cfg.budget} nodes; pass costs for sizing under load "
                 f"{'measured' if warm['pass_ms'] else 'not needed'}")
        self.max_queued, self.queue_timeout = max_queued, queue_timeout
        self.slots = asyncio.Semaphore(max_requests)
        self.running = self.waiting = 0
        self.metrics = ServingMetrics()
        self.cluster_metrics = ServingMetrics(ray_metric_kinds())
        self._health: dict = self.engine.health()
        self._rebuilding_since: float | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._watch_engine, name="engine-health", daemon=True).start()
        log.info(f"treegraft: serving {self.model.name!r} on {device} (tp={tp}), default method {method!r}, "
                 f"budget {cfg.budget}, at most {max_requests} running and {max_queued} waiting "
                 f"{queue_timeout:g} s; {'API key required' if self.api_key else 'no API key'}")

    def _treegraft_policy(self, scheduler: str | None, trajectories: str | None, pair, t_src, m_src, resources,
                          dtype, cache_dir):
        """The policy of the method "treegraft": the given artifact, else the scheduler fitted for this
        device from `trajectories` or the shipped ones (measured and fitted in a task on the target's
        resources on first use, cached beside the models), else the shallow-tree heuristic; the replica's log
        names which and why."""
        from treegraft_dist.decoding.schedule import ShallowTreeHeuristic
        from treegraft_dist.scheduling.artifact import load_artifact
        from treegraft_dist.scheduling.device import PROFILE_KEY, shipped_trajectories

        if scheduler:
            policy = load_artifact(scheduler, expect_pair=pair)[0]
            log.info(f"treegraft: scheduler {scheduler} (fitted for "
                     f"{policy.info.cost_profile.get(PROFILE_KEY, 'an unrecorded profile')})")
            return policy
        if trajectories is not None and m_src is None:
            raise ValueError("trajectories fit the scheduler of a middle drafter, and middle is none: give the "
                             "middle drafter they were collected with, or leave trajectories out")
        if trajectories is None and (m_src is None or shipped_trajectories(pair) is None):
            log.info(f"treegraft: no scheduler trajectories ship for {pair}: the method treegraft runs the "
                     "shallow-tree heuristic (fit one with `treegraft collect` and `treegraft fit`, then pass "
                     "scheduler)")
            return ShallowTreeHeuristic()
        if resources.tp > 1:
            log.info("treegraft: the device fit measures the target in one process, which a tensor-parallel "
                     "target does not fit: the method treegraft runs the shallow-tree heuristic (pass a "
                     "scheduler fitted for this device)")
            return ShallowTreeHeuristic()
        task = ray.remote(num_cpus=resources.target_cpus, num_gpus=resources.target_gpus, max_calls=1)(
            fit_device_scheduler)  # max_calls=1: the worker, and the models it loaded, go once it returns
        policy = ray.get(task.remote(pair, t_src, m_src, resources.device, dtype, cache_dir, resources.torch_threads,
                                     trajectories))
        if policy is None:
            log.info("treegraft: the trajectories were collected with other tree settings than the engine's: the "
                     "method treegraft runs the shallow-tree heuristic")
            return ShallowTreeHeuristic()
        profile = policy.info.cost_profile
        source = trajectories or shipped_trajectories(pair).name
        log.info(f"treegraft: scheduler fitted for this device ({profile.get(PROFILE_KEY)}) from {source} at "
                 f"budget {profile.get('budget')}, tree width {policy.width}, call cap {profile.get('call_cap')}")
        return policy

    def _check_method(self, method: str) -> None:
        if method not in (AR_METHOD, "treegraft"):
            resolve_policy(method, self.cfg.depth, self.has_middle)  # ValueError names what is wrong

    def _method_name(self, req: ApiRequest) -> str:
        return req.method or self.default_method

    # -- the engine's state ---------------------------------------------------------------------------
    def _watch_engine(self) -> None:
        while not self._stop.wait(HEALTH_POLL_S):
            self._read_health()

    def _read_health(self) -> dict:
        health = self.engine.health()
        if health["state"] == "rebuilding":
            self._rebuilding_since = self._rebuilding_since or time.monotonic()
        else:
            self._rebuilding_since = None
        self._health = health
        for m in (self.metrics, self.cluster_metrics):
            m.engine_state(health, self.running, self.waiting)
        return health

    def _unhealthy(self, health: dict) -> str | None:
        """Why the replica cannot serve, or None when it can."""
        state = health["state"]
        if state in ("dead", "failed"):
            return f"the engine is {state}"
        if state == "rebuilding" and time.monotonic() - (self._rebuilding_since or time.monotonic()) > REBUILD_GRACE_S:
            return f"the target group has been rebuilding for over {REBUILD_GRACE_S:g} s"
        return None

    def check_health(self) -> None:
        """Serve's health check: raises while the engine is dead or cannot be rebuilt, so that Serve
        replaces the replica. A rebuild in progress is recovery already and keeps the replica (its
        requests get 503 meanwhile), unless it runs past REBUILD_GRACE_S. It reads the state the watcher
        thread refreshes every HEALTH_POLL_S, so it never blocks the replica's event loop."""
        why = self._unhealthy(self._health)
        if why:
            raise RuntimeError(why)

    # -- routes ---------------------------------------------------------------------------------------
    @api.get("/health")
    def health(self) -> JSONResponse:
        """200 while the replica can serve; 503 while its engine is rebuilding, failed or dead."""
        health = self._read_health()
        body = {"status": "ok" if health["state"] == "ready" else health["state"], "running": self.running,
                "waiting": self.waiting, "active": self.running + self.waiting, "rebuilds": health["rebuilds"]}
        return JSONResponse(body, status_code=200 if health["state"] == "ready" else 503)

    @api.get("/v1/models")
    def models(self, request: Request):
        return self._authorized(request) or {"object": "list", "data": [self.model.card()]}

    @api.get("/v1/models/{name:path}")
    def model_card(self, name: str, request: Request):
        denied = self._authorized(request)
        if denied:
            return denied
        if name != self.model.name:
            return _error(ApiError(404, f"the model {name!r} does not exist here; this server serves "
                                        f"{self.model.name!r}", "model", "model_not_found"))
        return self.model.card()

    @api.get("/metrics")
    def prometheus(self, request: Request) -> Response:
        self._read_health()
        return self._authorized(request) or Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    def _authorized(self, request: Request) -> JSONResponse | None:
        """None when the request may pass; else the 401 answer."""
        if self.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return _error(ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                               code="invalid_api_key", type="invalid_request_error"))

    # -- one request ----------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        progress = _Progress(TextStream(self.tokenizer), time.perf_counter())
        rid = _request_id()
        try:
            denied = self._authorized(request)
            if denied:
                self._count(endpoint, "unauthorized")
                return denied
            body = decode_body(await _read_body(request))
            req = parse_request(body, chat, self.model, self.tokenizer, self._check_method)
            req.id = rid
            progress.text = TextStream(self.tokenizer, req.stop)
            await self._admit(progress)
        except ApiError as e:
            self._count(endpoint, _OUTCOMES.get(e.status, "error"))
            self._log(rid, endpoint, None, progress, e.status)
            return _error(e)
        except Exception as e:  # a bug of ours: the client still gets the OpenAI shape, the log the details
            log.exception(f"request id={rid} failed before it ran")
            self._count(endpoint, "error")
            return _error(_engine_error(e, rid))
        if req.stream:
            return StreamingResponse(self._events(req, endpoint, progress), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        status = 200
        try:
            text = "".join([delta async for delta in self._generate(req, progress)])
            self._count(endpoint, "ok")
            return JSONResponse(response_body(req, self.model, text, self._finish_reason(req, progress),
                                              progress.tokens, progress.stats, self._method_name(req)))
        except ApiError as e:
            status = e.status
            self._count(endpoint, _OUTCOMES.get(e.status, "error"))
            return _error(e)
        finally:
            progress.slot.release()
            self._log(req.id, endpoint, req, progress, status)

    async def _admit(self, progress: _Progress) -> None:
        """A slot to run in: at once, or after waiting at most queue_timeout; 429 when max_queued already
        wait, 503 when the engine is rebuilding or the wait runs out."""
        state = self._health["state"]
        if state != "ready" and state != "starting":
            raise ApiError(503, f"the engine is {state} after losing a worker: retry shortly", code="engine_restarting",
                           retry_after=5)
        if self.slots.locked() and self.waiting >= self.max_queued:
            raise ApiError(429, f"the server is full ({self.running} requests running, {self.waiting} waiting): "
                           "retry later", code="queue_full", retry_after=1)
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"the request waited {self.queue_timeout:g} s for room to run: retry later",
                           code="queue_timeout", retry_after=max(1.0, self.queue_timeout / 4)) from None
        finally:
            self.waiting -= 1
        self.running += 1
        progress.slot = _Slot(self)
        progress.admitted = time.perf_counter()
        for m in (self.metrics, self.cluster_metrics):
            m.queued(progress.admitted - progress.arrived)

    async def _events(self, req: ApiRequest, endpoint: str, progress: _Progress):
        """The server-sent events of a streamed request; an error after the first event is sent as one
        error event, then [DONE]."""
        outcome, status = "cancelled", 499  # unless it gets to the end: the client went away
        try:
            if req.chat:
                yield sse(chunk_body(req, self.model, "", first=True))
            async for delta in self._generate(req, progress):
                yield sse(chunk_body(req, self.model, delta))
            yield sse(chunk_body(req, self.model, None if req.chat else "", self._finish_reason(req, progress)))
            if req.include_usage:
                yield sse(usage_chunk(req, self.model, progress.tokens, progress.stats, self._method_name(req)))
            yield DONE
            outcome, status = "ok", 200
        except ApiError as e:
            outcome, status = _OUTCOMES.get(e.status, "error"), e.status
            yield sse(e.body())
            yield DONE
        finally:
            progress.slot.release()
            self._count(endpoint, outcome)
            self._log(req.id, endpoint, req, progress, status)

    async def _generate(self, req: ApiRequest, progress: _Progress):
        """Text deltas of one request as its rounds are accepted; `progress` holds its token count and, at
        the end, its stats. A stop string cancels the request in the engine; so does the caller leaving."""
        eos = tuple(sorted(set(self.eos_ids) | set(req.stop_token_ids)))
        try:
            stream = self.engine.stream(req.id, req.prompt_ids, req.max_tokens, self._method_name(req), eos,
                                        req.seed, req.sampling)
            last = None
            async for ref in stream:
                item = await ref
                if "stats" in item:
                    progress.stats = item["stats"]
                    for m in (self.metrics, self.cluster_metrics):
                        m.request_done(progress.stats, self._method_name(req))
                    continue
                tokens = item["tokens"]
                now = time.perf_counter()
                for m in (self.metrics, self.cluster_metrics):
                    if last is None:
                        m.ttft.observe(now - progress.arrived)
                    else:
                        for _ in tokens:
                            m.itl.observe((now - last) / len(tokens))
                if last is None:
                    progress.first_token = now
                last = now
                progress.tokens += len(tokens)
                progress.last_token = tokens[-1]
                delta = progress.text.push(tokens)
                if delta:
                    yield delta
                if progress.text.stopped:
                    self.engine.cancel(req.id)  # ends after the round in flight; its stats still come
        except Exception as e:
            raise _engine_error(e, req.id) from None
        finally:
            if progress.stats is None:  # the caller left, or the engine failed: stop the rounds
                self.engine.cancel(req.id)
        tail = progress.text.finish()
        if tail:
            yield tail

    def _finish_reason(self, req: ApiRequest, progress: _Progress) -> str:
        if (progress.text.stopped or progress.last_token in self.eos_ids or progress.last_token in req.stop_token_ids
                or progress.tokens < req.max_tokens):
            return "stop"
        return "length"

    def _count(self, endpoint: str, outcome: str) -> None:
        for m in (self.metrics, self.cluster_metrics):
            m.request_ended(endpoint, outcome)

    def _log(self, rid: str, endpoint: str, req: ApiRequest | None, progress: _Progress, status: int) -> None:
        """One line per request: id, method, tokens in and out, status, time to first token, total."""
        end = time.perf_counter()
        ttft = "-" if progress.first_token is None else f"{1e3 * (progress.first_token - progress.arrived):.0f}"
        method = "-" if req is None else self._method_name(req)
        prompt = "-" if req is None else len(req.prompt_ids)
        user = "" if req is None or not req.user else f" user={req.user!r}"
        log.info(f"request id={rid} endpoint={endpoint} method={method} prompt_tokens={prompt} "
                 f"completion_tokens={progress.tokens} status={status} ttft_ms={ttft} "
                 f"total_ms={1e3 * (end - progress.arrived):.0f}{user}")
        if status < 400 or status == 499:
            for m in (self.metrics, self.cluster_metrics):
                m.latency(end - progress.arrived)

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def fit_device_scheduler(pair, target_src: str, middle_src: str, device: str, dtype: str, cache_dir: str | None,
                         threads: int | None, trajectories: str | None = None):
    """The scheduler fitted for this device from `trajectories` or those shipped for `pair` (a Ray task on
    the target's resources: the cost profile is measured with the models loaded here, as the engine's actors
    run them). Cached beside the models, so only a replica's first start on a device measures and fits."""
    import torch

    from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
    from treegraft_dist.evaluation.evaluate import COST_CONTEXT_BENCHMARK
    from treegraft_dist.models.loading import load_model
    from treegraft_dist.models.paths import cache_root
    from treegraft_dist.scheduling.device import resolve_scheduler

    if threads:
        torch.set_num_threads(threads)
    target = load_model(target_src, device, dtype)
    middle = load_model(middle_src, device, dtype, target.tokenizer, drafter=True)
    context = chat_prompt(target.tokenizer, [builtin(COST_CONTEXT_BENCHMARK)[-1].turns[0]], [])
    found = resolve_scheduler(None, tuple(pair), target.lm, target.source, middle.lm, middle.source,
                              cache_root(cache_dir), context, TreeConfig(), lambda m: print(m, file=sys.stderr),
                              trajectories, any_width=True)
    return None if found is None else found[0]


def ray_metric_kinds() -> dict:
    """ServingMetrics' metric kinds through Ray's own metrics (`ray.util.metrics`), so that a cluster's
    Prometheus scrapes every replica once, at Ray's metrics endpoint. Ray refuses ':' in names: the
    vLLM-compatible `vllm:` prefix is written `vllm_` there."""
    from ray.util import metrics as rm

    def kind(cls):
        def make(name: str, doc: str, labels: list[str], *buckets):
            extra = {"boundaries": list(buckets[0])} if buckets else {}
            return _RayMetric(cls(name.replace(":", "_"), doc, tag_keys=tuple(labels), **extra), labels)
        return make

    return {"counter": kind(rm.Counter), "gauge": kind(rm.Gauge), "histogram": kind(rm.Histogram)}


class _RayMetric:
    """A Ray metric with prometheus_client's calls: `labels(*values)`, then `inc`, `set` or `observe`."""

    def __init__(self, metric, keys, tags: dict | None = None):
        self.metric, self.keys, self.tags = metric, keys, tags

    def labels(self, *values) -> "_RayMetric":
        return _RayMetric(self.metric, self.keys, dict(zip(self.keys, map(str, values))))

    def inc(self, amount: float = 1) -> None:
        if amount > 0:  # Ray's counters take positive increments only
            self.metric.inc(amount, self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value, self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value, self.tags)


# The deployment: every request reaches the replica (its own admission answers 429 or 503), which needs
# little CPU itself; its engine's actors ask for their own. serve.yaml sets autoscaling.
TreegraftServer = serve.deployment(name="treegraft", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.1},
                                   health_check_period_s=10, health_check_timeout_s=120)(
    serve.ingress(api)(OpenAIServer))
SERVER_ARGS = tuple(inspect.signature(OpenAIServer.__init__).parameters)[1:]


def _request_id() -> str:
    """This request's id: Serve's (the client's X-Request-Id when it sent one), which Serve's proxy also
    returns in the X-Request-Id header of every answer and its logger prints beside each line."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or "req-" + uuid.uuid4().hex
    except (ImportError, AttributeError):
        return "req-" + uuid.uuid4().hex


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to pass MAX_BODY_BYTES."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return b" " * (MAX_BODY_BYTES + 1)  # decode_body answers 413 without reading it
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return b" " * (MAX_BODY_BYTES + 1)
        chunks.append(chunk)
    return b"".join(chunks)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _engine_error(e: BaseException, rid: str) -> ApiError:
    """What the client is told of an engine error: a plain message and the request id, never the internals
    (process ids, addresses, actor ids), which go to the server log under the request id."""
    from actors.target import TargetGroupError

    if isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, ValueError) and not isinstance(e, RayError):
        return ApiError(400, str(e))
    log.warning(f"request id={rid} failed: {type(e).__name__}: {e}")
    if isinstance(e, QueueTimeout):
        return ApiError(503, "the request waited too long for KV cache room: retry later", code="queue_timeout",
                        retry_after=e.retry_after)
    if isinstance(e, TargetGroupError):
        return ApiError(503, "the engine lost a worker while serving this request and is being rebuilt: submit "
                        "the request again", code="engine_restarting", retry_after=e.retry_after)
    if isinstance(e, EngineUnavailable):
        return ApiError(503, f"the engine cannot serve this request now ({e}): retry shortly",
                        code="engine_restarting", retry_after=e.retry_after)
    if isinstance(e, RayActorError):
        return ApiError(503, "the engine of this replica is down and the replica is being replaced: retry shortly",
                        code="engine_unavailable", retry_after=10)
    return ApiError(500, f"an internal error ended this request (request id {rid}); the server log has the details",
                    type="server_error")


# -- entry points ---------------------------------------------------------------------------------------------
def app_builder(args: dict):
    """The application serve.yaml names (`import_path: jobs.serve:app_builder`); `args` are
    OpenAIServer's arguments."""
    unknown = sorted(set(args) - set(SERVER_ARGS))
    if unknown:
        raise ValueError(f"unknown serve args {unknown}: the application takes {', '.join(SERVER_ARGS)}")
    return TreegraftServer.bind(**args)


def run_local(args: argparse.Namespace) -> int:
    """`treegraft serve`: the application on a local Ray cluster (or --address), until interrupted (Ctrl-C, or
    SIGTERM as a service manager or container runtime sends it)."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    ray.init(address=args.address, include_dashboard=False, logging_level="ERROR")
    # After ray.init, whose core installs a SIGTERM handler that aborts the process.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)  # also where a shell started it in the background, which ignores it
    serve.start(http_options={"host": args.host, "port": args.port})
    try:  # Ctrl-C stops it, also while the application is still starting
        serve.run(app_builder({k: getattr(args, k) for k in SERVER_ARGS}), name="treegraft", route_prefix="/")
        print(f"treegraft: serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
