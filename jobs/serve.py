"""The OpenAI-compatible server on Ray Serve.

    serve run serve.yaml                                  # a cluster (the config at the repository root)
    treegraft serve --target T --middle M --tp N --port P  # the same application, started locally

One replica owns one engine: `actors.DistributedEngine` places the target group, the drafters and the
coordinator exactly as `treegraft generate --distributed` does, and every request is one streamed request
to its coordinator (`Coordinator.stream`). Requests run concurrently up to `max_requests`; up to
`max_queued` more wait; beyond that the answer is 429 with Retry-After. Request checks, text streaming,
bodies and metrics are `treegraft_dist.serving`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics (Prometheus),
GET /health. A request may pick the decoding method with the extra body field "method" (ar, treegraft,
all-small, all-mid or a 0/1 layer pattern); every response carries `metrics.speculative_decoding`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import AR_METHOD, resolve_policy
from treegraft_dist.models.loading import describe_model
from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
from treegraft_dist.serving import (
    DONE,
    ApiError,
    ApiRequest,
    ServedModel,
    ServingMetrics,
    TextStream,
    chunk_body,
    parse_request,
    response_body,
    sse,
    usage_chunk,
)

api = FastAPI(title="treegraft-dist", docs_url=None, redoc_url=None, openapi_url=None)

_OUTCOMES = {400: "bad_request", 404: "not_found", 429: "rejected", 503: "unavailable"}


@dataclasses.dataclass
class _Progress:
    """What one request has produced so far."""

    text: TextStream
    tokens: int = 0
    stats: object = None
    last_token: int | None = None


class OpenAIServer:
    """One engine behind the OpenAI API. Arguments are those of `treegraft serve` (and serve.yaml's `args`):
    model names as `treegraft generate` takes them (a folder, a hub id, or an embedded name; `middle`
    "none" drafts with n-grams only), `model_name` the name clients use (default: the target's),
    `method` the default decoding method, `scheduler` a fitted scheduler artifact for the method
    "treegraft" (default: the shallow-tree heuristic), `budget` nodes verified per round."""

    def __init__(self, target: str = DEFAULT_TARGET, middle: str | None = DEFAULT_MIDDLE, model_name: str | None = None,
                 tp: int = 1, device: str = "auto", dtype: str = "auto", method: str = "treegraft",
                 scheduler: str | None = None, budget: int | None = None, max_requests: int = 8,
                 max_queued: int = 64, max_tokens: int = 256, cache_dir: str | None = None):
        from actors import DistributedEngine
        from actors.resources import for_device
        from treegraft_dist.cli import resolve_pair

        if max_requests < 1 or max_queued < 0 or max_tokens < 1:
            raise ValueError("max_requests and max_tokens must be at least 1, max_queued at least 0")
        t_src, t_tok, m_src, _ = resolve_pair(target, middle, cache_dir)
        cfg = TreeConfig() if budget is None else TreeConfig(budget=budget)
        self.policy = self._treegraft_policy(scheduler, (target, middle))
        fitted = getattr(self.policy, "info", None)
        if fitted is not None and budget is None:
            cfg = dataclasses.replace(cfg, budget=int(fitted.cost_profile["budget"]))
        self.cfg, self.has_middle = cfg, m_src is not None
        self.default_method = method
        self._check_method(method)
        info = describe_model(t_src, t_tok, tp)
        self.tokenizer = t_tok
        self.eos_ids = tuple(sorted(info.eos_ids))
        self.model = ServedModel(model_name or target.split(":")[-1].rstrip("/").split("/")[-1],
                                 info.max_positions - cfg.max_tree_depth - 1, self.eos_ids, max_tokens)
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= tp + self.has_middle else "cpu"
        self.engine = DistributedEngine(t_src, m_src, cfg, for_device(device, tp, max_requests=max_requests),
                                        dtype=dtype)
        self.limit, self.active = max_requests + max_queued, 0
        self.metrics = ServingMetrics()

    @staticmethod
    def _treegraft_policy(scheduler: str | None, pair):
        from treegraft_dist.decoding.schedule import ShallowTreeHeuristic
        from treegraft_dist.scheduling.artifact import load_artifact

        return load_artifact(scheduler, expect_pair=pair)[0] if scheduler else ShallowTreeHeuristic()

    def _check_method(self, method: str) -> None:
        if method not in (AR_METHOD, "treegraft"):
            resolve_policy(method, self.cfg.depth, self.has_middle)  # ValueError names what is wrong

    def _method(self, name: str | None):
        name = name or self.default_method
        return self.policy if name == "treegraft" else name

    def _method_name(self, req: ApiRequest) -> str:
        return req.method or self.default_method

    # -- routes ---------------------------------------------------------------------------------------
    @api.get("/health")
    def health(self) -> dict:
        return {"status": "ok", "active": self.active}

    @api.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [self.model.card()]}

    @api.get("/v1/models/{name:path}")
    def model_card(self, name: str):
        if name != self.model.name:
            return _error(ApiError(404, f"the model {name!r} does not exist here; this server serves "
                                        f"{self.model.name!r}", "model", "model_not_found"))
        return self.model.card()

    @api.get("/metrics")
    def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    # -- one request ----------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        arrived = time.perf_counter()
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON") from None
            req = parse_request(body, chat, self.model, self.tokenizer, self._check_method)
            if self.active >= self.limit:
                raise ApiError(429, f"the server is full ({self.limit} requests running or queued): retry later",
                               code="queue_full", retry_after=1)
        except ApiError as e:
            self.metrics.requests.labels(endpoint, _OUTCOMES.get(e.status, "error")).inc()
            return _error(e)
        self.active += 1
        if req.stream:
            return StreamingResponse(self._events(req, endpoint, arrived), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            progress = _Progress(TextStream(self.tokenizer, req.stop))
            text = "".join([delta async for delta in self._generate(req, progress, arrived)])
            self.metrics.requests.labels(endpoint, "ok").inc()
            return JSONResponse(response_body(req, self.model, text, self._finish_reason(req, progress),
                                              progress.tokens, progress.stats, self._method_name(req)))
        except ApiError as e:
            self.metrics.requests.labels(endpoint, _OUTCOMES.get(e.status, "error")).inc()
            return _error(e)
        finally:
            self.active -= 1

    async def _events(self, req: ApiRequest, endpoint: str, arrived: float):
        """The server-sent events of a streamed request; an error after the first event is sent as an event."""
        outcome = "cancelled"  # unless it gets to the end: the client went away
        progress = _Progress(TextStream(self.tokenizer, req.stop))
        try:
            if req.chat:
                yield sse(chunk_body(req, self.model, "", first=True))
            async for delta in self._generate(req, progress, arrived):
                yield sse(chunk_body(req, self.model, delta))
            yield sse(chunk_body(req, self.model, None if req.chat else "", self._finish_reason(req, progress)))
            if req.include_usage:
                yield sse(usage_chunk(req, self.model, progress.tokens, progress.stats, self._method_name(req)))
            yield DONE
            outcome = "ok"
        except ApiError as e:
            outcome = _OUTCOMES.get(e.status, "error")
            yield sse(e.body())
            yield DONE
        finally:
            self.active -= 1
            self.metrics.requests.labels(endpoint, outcome).inc()
            if progress.stats is None:  # the client went away mid-request: stop its rounds
                self.engine.cancel(req.id)

    async def _generate(self, req: ApiRequest, progress: _Progress, arrived: float):
        """Text deltas of one request as its rounds are accepted; `progress` holds its token count and, at
        the end, its stats. A stop string cancels the request in the engine; so does the caller leaving."""
        stream = self.engine.stream(req.id, req.prompt_ids, req.max_tokens, self._method(req.method), self.eos_ids,
                                    req.seed, req.sampling)
        last = None
        try:
            async for ref in stream:
                item = await ref
                if "stats" in item:
                    progress.stats = item["stats"]
                    self.metrics.request_done(progress.stats, self._method_name(req))
                    continue
                tokens = item["tokens"]
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - arrived)
                else:
                    for _ in tokens:
                        self.metrics.itl.observe((now - last) / len(tokens))
                last = now
                progress.tokens += len(tokens)
                progress.last_token = tokens[-1]
                delta = progress.text.push(tokens)
                if delta:
                    yield delta
                if progress.text.stopped:
                    self.engine.cancel(req.id)  # ends after the round in flight; its stats still come
        except RayTaskError as e:
            raise _engine_error(e.cause if e.cause is not None else e) from None
        except RayActorError as e:
            raise _engine_error(e) from None
        finally:
            if progress.stats is None:  # the caller left, or the engine failed: stop the rounds
                self.engine.cancel(req.id)
        tail = progress.text.finish()
        if tail:
            yield tail

    def _finish_reason(self, req: ApiRequest, progress: _Progress) -> str:
        if progress.text.stopped or progress.last_token in self.eos_ids or progress.tokens < req.max_tokens:
            return "stop"
        return "length"

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# The deployment: every request reaches the replica (its own admission answers 429), which needs little CPU
# itself; its engine's actors ask for their own.
TreegraftServer = serve.deployment(name="treegraft", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.1},
                                   health_check_timeout_s=120)(serve.ingress(api)(OpenAIServer))
SERVER_ARGS = tuple(inspect.signature(OpenAIServer.__init__).parameters)[1:]


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _engine_error(e: BaseException) -> ApiError:
    from actors.target import TargetGroupError

    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    if isinstance(e, (TargetGroupError, RayActorError)):
        return ApiError(503, f"the engine lost a worker: {e}", code="engine_restarting", retry_after=5)
    return ApiError(500, f"{type(e).__name__}: {e}", type="server_error")


# -- entry points ---------------------------------------------------------------------------------------------
def app_builder(args: dict):
    """The application serve.yaml names (`import_path: jobs.serve:app_builder`); `args` are
    OpenAIServer's arguments."""
    unknown = sorted(set(args) - set(SERVER_ARGS))
    if unknown:
        raise ValueError(f"unknown serve args {unknown}: the application takes {', '.join(SERVER_ARGS)}")
    return TreegraftServer.bind(**args)


def run_local(args: argparse.Namespace) -> int:
    """`treegraft serve`: the application on a local Ray cluster (or --address), until interrupted."""
    ray.init(address=args.address, include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": args.host, "port": args.port})
    try:  # Ctrl-C stops it, also while the application is still starting
        serve.run(app_builder({k: getattr(args, k) for k in SERVER_ARGS}), name="treegraft", route_prefix="/")
        print(f"treegraft: serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
