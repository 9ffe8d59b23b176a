"""The OpenAI-compatible API without the server: request bodies checked and turned into what the engine
takes, token ids turned into text as it becomes final (stop strings included), response and stream-chunk
bodies, errors in OpenAI's shape, and the Prometheus metrics. `jobs/serve.py` puts this behind Ray Serve.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from .decoding.sampling import SamplingParams
from .decoding.stats import RequestStats

MAX_STOP = 4  # stop strings per request, as OpenAI allows
UNSUPPORTED = {  # parameter -> the values it may take here (anything else is a 400)
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
}


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, round(self.retry_after)))}


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


@dataclass(frozen=True)
class ServedModel:
    """What the server knows of the model it serves: its public name, the positions a prompt plus its
    completion may use, its end-of-sequence ids and the methods it accepts."""

    name: str
    context: int  # prompt + max_tokens may not exceed this
    eos_ids: tuple[int, ...]
    default_max_tokens: int = 256
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "treegraft-dist",
                "max_model_len": self.context}


@dataclass
class ApiRequest:
    """A checked /v1/completions or /v1/chat/completions request."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    method: str | None  # None: the server's default
    id: str = ""

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def parse_request(body, chat: bool, model: ServedModel, tokenizer, check_method: Callable[[str], None]) -> ApiRequest:
    """`body` (the decoded JSON) checked against `model`; ApiError(400) says which parameter is wrong and
    why, ApiError(404) names an unknown model. `check_method(name)` raises ValueError for a method the
    server cannot run."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'model' is required: the name GET /v1/models lists", "model")
    if name != model.name:
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves {model.name!r}", "model",
                       "model_not_found")
    for key, allowed in UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            raise ApiError(400, f"{key!r} is not supported by this server", key, "unsupported_parameter")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {n!r}", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be in (0, 1], got 0", "top_p")
    top_k = _integer(body, "top_k", 0, -1)
    seed = _integer(body, "seed", None, None)
    stream = _boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        include_usage = _boolean(options, "include_usage", False, "stream_options.include_usage")
    stop = _stop(body.get("stop"))
    method = body.get("method")
    if method is not None:
        if not isinstance(method, str) or not method:
            raise ApiError(400, "'method' must be a string: ar, treegraft, all-small, all-mid or a 0/1 pattern",
                           "method")
        try:
            check_method(method)
        except ValueError as e:
            raise ApiError(400, f"'method': {e}", "method") from None
    prompt_ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    room = model.context - len(prompt_ids)
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    key = next((k for k in keys if body.get(k) is not None), keys[-1])
    max_tokens = _integer(body, key, None, 1)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = "" if max_tokens is None else f" + {max_tokens} completion tokens"
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens){asked} exceeds the model's context of "
                       f"{model.context} tokens: shorten the prompt or ask for fewer tokens",
                       key if room >= 1 else ("messages" if chat else "prompt"), "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(model.default_max_tokens, room)
    return ApiRequest(chat, prompt_ids, max_tokens, SamplingParams(temperature, max(top_k, 0), top_p),
                      secrets.randbits(31) if seed is None else seed, stop, stream, include_usage, method)


def _number(body: dict, key: str, default, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"{key!r} must be a number in [{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, default, lo: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        floor = "" if lo is None else f" >= {lo}"
        raise ApiError(400, f"{key!r} must be an integer{floor}, got {value!r}", key)
    return value


def _boolean(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{key!r} must be true or false, got {value!r}", param or key)
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got "
                       f"{value!r}", "stop")
    return tuple(stops)


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty: give the text to continue", "prompt")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)
    if prompt is None or prompt == [] or prompt == "":
        raise ApiError(400, "'prompt' is required and must not be empty", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def _chat_ids(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with a role of system, developer, user or "
                           "assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not any(m["content"] for m in clean):
        raise ApiError(400, "'messages' holds no text", "messages")
    return list(tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=False))


class TextStream:
    """Token ids in, text out as it becomes final. Text that may still change (a character whose bytes
    are not all there yet) or that may be the start of a stop string is held back until later tokens
    settle it; a stop string ends the text before it (`stopped`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # given out so far
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """The new final text after `ids`; "" once stopped."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit = min((i for i in (full.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop) if i >= 0),
                  default=-1)
        if hit >= 0:
            self.stopped = True
            end = hit
        elif final:
            end = len(full)
        else:
            end = len(full.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD for now
            end -= max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if full[:end].endswith(s[:k])),
                       default=0)
        delta = full[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta


# -- bodies -----------------------------------------------------------------------------------------------
def speculation_details(stats: RequestStats | None, method: str | None = None) -> dict:
    """The per-request `metrics.speculative_decoding` object; `method`: as the request named it (default:
    the schedule's own name, e.g. 11111 for all-mid)."""
    if stats is None:
        return {}
    drafted = sum(max(0, s - 1) for s in stats.tree_sizes)
    accepted = sum(max(0, a - 1) for a in stats.accepted)
    return {"method": method or stats.method, "schedule": stats.method, "rounds": stats.rounds, "mean_accepted_tokens": round(stats.mean_accepted, 4),
            "draft_tokens": drafted, "accepted_draft_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "middle_calls": int(sum(stats.middle_calls)), "wall_s": round(stats.wall_s, 4)}


def usage(req: ApiRequest, completion_tokens: int) -> dict:
    n = len(req.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def response_body(req: ApiRequest, model: ServedModel, text: str, finish_reason: str, completion_tokens: int,
                  stats: RequestStats | None, method: str | None = None) -> dict:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(req, model, chunk=False), "choices": [choice], "usage": usage(req, completion_tokens),
            "metrics": {"speculative_decoding": speculation_details(stats, method)}}


def chunk_body(req: ApiRequest, model: ServedModel, text: str | None, finish_reason: str | None = None,
               first: bool = False) -> dict:
    """One streamed chunk with `text` (chat: the first chunk also carries the role)."""
    if req.chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    body = {**_head(req, model, chunk=True), "choices": [choice]}
    if req.include_usage:
        body["usage"] = None  # as OpenAI: only the last chunk carries usage
    return body


def usage_chunk(req: ApiRequest, model: ServedModel, completion_tokens: int, stats: RequestStats | None,
                method: str | None = None) -> dict:
    return {**_head(req, model, chunk=True), "choices": [], "usage": usage(req, completion_tokens),
            "metrics": {"speculative_decoding": speculation_details(stats, method)}}


def _head(req: ApiRequest, model: ServedModel, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
    return {"id": req.id, "object": kind, "created": int(time.time()), "model": model.name}


def sse(body: dict | str) -> str:
    """One server-sent event: `data: {json}` (or `data: [DONE]`) and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


DONE = sse("[DONE]")


# -- metrics ----------------------------------------------------------------------------------------------
class ServingMetrics:
    """Prometheus counters and histograms of one server, in a registry of its own (`render` gives the text
    exposition format)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("treegraft_requests", "Requests by endpoint and outcome "
                                "(ok, stopped, cancelled, bad_request, not_found, rejected, error)",
                                ["endpoint", "outcome"], registry=r)
        self.drafts = Counter("treegraft_drafts", "Draft trees verified by the target", ["method"], registry=r)
        self.draft_tokens = Counter("treegraft_draft_tokens", "Draft tokens sent for verification", ["method"],
                                    registry=r)
        self.accepted_tokens = Counter("treegraft_accepted_tokens", "Draft tokens the target accepted",
                                       ["method"], registry=r)
        self.middle_calls = Counter("treegraft_middle_calls", "Calls to the middle drafter", ["method"], registry=r)
        self.generated_tokens = Counter("treegraft_generated_tokens", "Tokens generated", ["method"], registry=r)
        self.ttft = Histogram("treegraft_time_to_first_token_seconds", "From the request's arrival to its first "
                              "token", registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("treegraft_inter_token_latency_seconds", "Between consecutive tokens of a request "
                             "(a round that accepts n tokens counts n gaps of 1/n of its time)", registry=r,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))

    def request_done(self, stats: RequestStats | None, method: str) -> None:
        if stats is None:
            return
        d = speculation_details(stats)
        m = method
        if stats.method != "ar":
            self.drafts.labels(m).inc(stats.rounds)
            self.draft_tokens.labels(m).inc(d["draft_tokens"])
            self.accepted_tokens.labels(m).inc(d["accepted_draft_tokens"])
            self.middle_calls.labels(m).inc(d["middle_calls"])
        self.generated_tokens.labels(m).inc(stats.new_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
