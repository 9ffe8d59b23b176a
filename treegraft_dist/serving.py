"""The OpenAI-compatible API without the server: request bodies checked and turned into what the engine
takes, token ids turned into text as it becomes final (stop strings included), response and stream-chunk
bodies, errors in OpenAI's shape, and the Prometheus metrics. `jobs/serve.py` puts this behind Ray Serve.

Every top-level field of a request body is either applied (`_APPLIED`), accepted only at a value that
changes nothing (`_NEUTRAL`), or answered with a 400 `unsupported_parameter` that names it: nothing a
client asks for is silently ignored.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .decoding.sampling import GREEDY_BELOW, SamplingParams
from .decoding.stats import RequestStats

# The largest request body read. The longest prompt a served context holds is far smaller: 128k tokens as
# token ids ("151643," each) are about 1 MiB, and as text all escaped to \uXXXX about 3 MiB; anything
# larger can only be an error or an attack, and is refused before it is parsed.
MAX_BODY_BYTES = 4 << 20
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_TOKEN_IDS = 64
MAX_USER = 256  # characters of the end-user id; the server logs it
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # every integer parameter stays within these


# The parameters each endpoint applies, keyed by `chat`.
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
           "stop_token_ids", "seed", "method", "user")
_APPLIED = {False: frozenset(_COMMON + ("prompt",)),
            True: frozenset(_COMMON + ("messages", "max_completion_tokens"))}

# Parameters of OpenAI's and vLLM's request schemas that this server does not implement, each with the
# values at which it changes nothing (null, the default, always passes too); any other value is a 400.
_NEUTRAL_BOTH = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "logit_bias": ({},), "min_tokens": (0,), "ignore_eos": (False,), "best_of": (1,),
    "use_beam_search": (False,), "length_penalty": (1,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "bad_words": ([],),
    "response_format": ({"type": "text"},), "priority": (0,),
}
_NEUTRAL = {  # keyed by `chat`
    # Completions' logprobs is a count, and 0 still asks for the chosen tokens' log-probabilities.
    False: {**_NEUTRAL_BOTH, "logprobs": (), "echo": (False,), "suffix": ("",), "add_special_tokens": (True,)},
    True: {**_NEUTRAL_BOTH, "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "tools": ([],),
           "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
           "parallel_tool_calls": (True, False), "store": (False,), "metadata": ({},), "modalities": (["text"],),
           "add_generation_prompt": (True,), "continue_final_message": (False,), "add_special_tokens": (False,),
           "service_tier": ("auto", "default"), "audio": (), "prediction": (), "reasoning_effort": (),
           "verbosity": (), "web_search_options": (), "prompt_cache_key": (), "safety_identifier": ()},
}
_STREAM_APPLIED, _STREAM_NEUTRAL = frozenset({"include_usage"}), {"continuous_usage_stats": (False,)}


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


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}


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
    seed: int  # within int64; torch's Generator.manual_seed wraps a negative seed into its unsigned range
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    method: str | None  # None: the server's default
    stop_token_ids: tuple[int, ...] = ()  # end the completion as an end-of-sequence id does
    user: str | None = None  # the client's id for its end user, for the server's logs
    id: str = ""

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def decode_body(raw: bytes, limit: int = MAX_BODY_BYTES):
    """The JSON value of a request body: ApiError(413) beyond `limit` bytes, ApiError(400) when it is not
    UTF-8 JSON (NaN and Infinity, which Python's json reads, included) or is nested too deeply to read."""
    if len(raw) > limit:
        raise ApiError(413, f"the request body is {len(raw)} bytes; this server reads at most {limit}: shorten "
                       "the prompt", code="request_too_large")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: it is nested too deeply to read") from None
    except ValueError as e:  # not UTF-8, not JSON, NaN, or an integer of more digits than Python reads
        raise ApiError(400, f"the request body is not valid JSON: {_cut(str(e))}") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_request(body, chat: bool, model: ServedModel, tokenizer, check_method: Callable[[str], None]) -> ApiRequest:
    """`body` (the decoded JSON) checked against `model`; ApiError(400) says which parameter is wrong and
    why, ApiError(404) names an unknown model. `check_method(name)` raises ValueError for a method the
    server cannot run. Any JSON value gives an ApiRequest or an ApiError, never another exception."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'model' is required: the name GET /v1/models lists", "model")
    if name != model.name:
        raise ApiError(404, f"the model {_show(name)} does not exist here; this server serves {model.name!r}",
                       "model", "model_not_found")
    _check_fields(body, _APPLIED[chat], _NEUTRAL[chat])
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {_show(n)}", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be in (0, 1], got 0", "top_p")
    top_k = max(_integer(body, "top_k", 0, -1, INT64_MAX), 0)  # -1 and 0: no top-k
    seed = _integer(body, "seed", None, INT64_MIN, INT64_MAX)
    stream = _boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        _check_fields(options, _STREAM_APPLIED, _STREAM_NEUTRAL, "stream_options")
        include_usage = _boolean(options, "include_usage", False, "stream_options.include_usage")
    stop = _stop(body.get("stop"))
    stop_token_ids = _stop_token_ids(body.get("stop_token_ids"), len(tokenizer))
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER or not _unicode(user)):
        raise ApiError(400, f"'user' must be text of at most {MAX_USER} characters, got {_show(user)}", "user")
    method = body.get("method")
    if method is not None:
        if not isinstance(method, str) or not method or not _unicode(method):
            raise ApiError(400, "'method' must be a string: ar, treegraft, all-small, all-mid or a 0/1 pattern",
                           "method")
        try:
            check_method(method)
        except ValueError as e:
            raise ApiError(400, f"'method': {_cut(str(e), 400)}", "method") from None
    prompt_ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    room = model.context - len(prompt_ids)
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    key = next((k for k in keys if body.get(k) is not None), keys[-1])
    max_tokens = _integer(body, key, None, 1, INT64_MAX)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = "" if max_tokens is None else f" + {max_tokens} completion tokens"
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens){asked} exceeds the model's context of "
                       f"{model.context} tokens: shorten the prompt or ask for fewer tokens",
                       key if room >= 1 else ("messages" if chat else "prompt"), "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(model.default_max_tokens, room)
    sampling = SamplingParams(0.0 if temperature < GREEDY_BELOW else temperature, top_k, top_p)
    return ApiRequest(chat, prompt_ids, max_tokens, sampling, secrets.randbits(31) if seed is None else seed, stop,
                      stream, include_usage, method, stop_token_ids, user)


def _check_fields(body: dict, applied, neutral: dict, parent: str | None = None) -> None:
    """Every field of `body` is applied, or neutral at a value that changes nothing; else a 400."""
    for key, value in body.items():
        if key in applied:
            continue
        label = key if parent is None else f"{parent}.{key}"
        param = parent or _printable(key)
        if key not in neutral:
            raise ApiError(400, f"unknown parameter {_show(label)}: this server does not support it, remove it "
                           f"(the parameters applied{'' if parent is None else ' in ' + repr(parent)} are "
                           f"{', '.join(sorted(applied))})", param, "unsupported_parameter")
        if value is not None and not any(_same(value, v) for v in neutral[key]):
            values = " or ".join(json.dumps(v) for v in (None, *neutral[key]))
            raise ApiError(400, f"{label!r} is not supported by this server: remove it, or set it to {values} "
                           f"(got {_show(value)})", param, "unsupported_parameter")


def _same(value, neutral) -> bool:
    """Equality as JSON means it: true is not 1, 1 is 1.0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"{key!r} must be a number in [{lo:g}, {hi:g}], got {_show(value)}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    """An integer in [lo, hi] (an integral float such as 5.0 is not one, as in OpenAI's schema)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"{key!r} must be an integer in [{_bound(lo)}, {_bound(hi)}], got {_show(value)}", key)
    return value


def _bound(n: int) -> str:
    return {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}.get(n, str(n))


def _boolean(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{key!r} must be true or false, got {_show(value)}", param or key)
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s and _unicode(s) for s in stops)):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got "
                       f"{_show(value)}", "stop")
    return tuple(stops)


def _stop_token_ids(value, vocab: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)):
        raise ApiError(400, f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids in "
                       f"[0, {vocab}), got {_show(value)}", "stop_token_ids")
    return tuple(value)


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty: give the text to continue", "prompt")
        if not _unicode(prompt):
            raise ApiError(400, "'prompt' is not valid Unicode text (it holds a lone surrogate)", "prompt")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab}): "
                           f"{', '.join(_show(t) for t in bad[:5])}", "prompt")
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
        if not _unicode(content):
            raise ApiError(400, f"messages[{i}].content is not valid Unicode text (it holds a lone surrogate)",
                           "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not any(m["content"] for m in clean):
        raise ApiError(400, "'messages' holds no text", "messages")
    return list(tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=False))


def _unicode(text: str) -> bool:
    """False for a string JSON's \\ud800-style escapes made that is not text: a lone surrogate, which the
    tokenizer and UTF-8 output cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    return text if _unicode(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _show(value) -> str:
    """A value as an error message quotes it: short, and safe to send as UTF-8 whatever the client sent."""
    if isinstance(value, str):
        return _cut(repr(value))  # repr escapes lone surrogates
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        return _cut(json.dumps(value))
    except (RecursionError, ValueError, TypeError):  # nested too deeply, or an integer too long to print
        return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
    return {"method": method or stats.method, "schedule": stats.method, "rounds": stats.rounds,
            "mean_accepted_tokens": round(stats.mean_accepted, 4), "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
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
    """Prometheus counters, gauges and histograms of one server. By default in a prometheus_client registry of
    its own (`render` gives the text exposition format); `kinds` builds them elsewhere instead (jobs/serve.py
    records the same series through Ray's metrics): {"counter": f(name, doc, labels), "gauge": f(name, doc,
    labels), "histogram": f(name, doc, labels, buckets)}, each metric with prometheus_client's `labels(...)`,
    `inc`, `set` and `observe`."""

    def __init__(self, kinds: dict | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        kinds = kinds or {"counter": lambda n, d, labels: Counter(n, d, labels, registry=r),
                          "gauge": lambda n, d, labels: Gauge(n, d, labels, registry=r),
                          "histogram": lambda n, d, labels, b: Histogram(n, d, labels, registry=r, buckets=b)}
        counter, gauge, histogram = kinds["counter"], kinds["gauge"], kinds["histogram"]
        self.requests = counter("treegraft_requests", "Requests by endpoint and outcome (ok, cancelled, bad_request, "
                                "unauthorized, not_found, rejected, unavailable, error)", ["endpoint", "outcome"])
        self.running = gauge("treegraft_requests_running", "Requests decoding now", [])
        self.waiting = gauge("treegraft_requests_waiting", "Requests waiting for room to run (in the replica's "
                             "queue or for KV cache room)", [])
        self.kv_usage = gauge("treegraft_kv_cache_usage", "Fraction of the KV cache budget the running requests "
                              "reserve", [])
        self.rebuilds = gauge("treegraft_target_group_rebuilds", "Target group rebuilds after a lost worker", [])
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Rounds that accepted a "
                                        "draft token at each position of the accepted path", ["position"])
        self.drafts = counter("treegraft_drafts", "Draft trees verified by the target", ["method"])
        self.draft_tokens = counter("treegraft_draft_tokens", "Draft tokens sent for verification", ["method"])
        self.accepted_tokens = counter("treegraft_accepted_tokens", "Draft tokens the target accepted", ["method"])
        self.middle_calls = counter("treegraft_middle_calls", "Calls to the middle drafter", ["method"])
        self.generated_tokens = counter("treegraft_generated_tokens", "Tokens generated", ["method"])
        self.queue_time = histogram("treegraft_request_queue_time_seconds", "From the request's arrival to its "
                                    "admission", [], LATENCY_BUCKETS)
        self.e2e = histogram("treegraft_e2e_request_latency_seconds", "From the request's arrival to its end", [],
                             LATENCY_BUCKETS)
        self.ttft = histogram("treegraft_time_to_first_token_seconds", "From the request's arrival to its first "
                              "token", [], LATENCY_BUCKETS)
        self.itl = histogram("treegraft_inter_token_latency_seconds", "Between consecutive tokens of a request (a "
                             "round that accepts n tokens counts n gaps of 1/n of its time)", [],
                             (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))

    def request_ended(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def engine_state(self, health: dict, running: int, waiting: int) -> None:
        """The gauges, from the engine's health (`DistributedEngine.health`) and the replica's own counts."""
        self.running.set(running)
        self.waiting.set(waiting + health.get("waiting", 0))
        self.kv_usage.set(kv_usage(health))
        self.rebuilds.set(health.get("rebuilds", 0))

    def queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def latency(self, seconds: float) -> None:
        self.e2e.observe(seconds)

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
            for pos, n in enumerate(accepted_per_position(stats)):
                self.accepted_per_pos.labels(str(pos)).inc(n)
        self.generated_tokens.labels(m).inc(stats.new_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


LATENCY_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)


def kv_usage(health: dict) -> float:
    """The fraction of the engine's KV cache budget reserved, from `DistributedEngine.health`'s counts."""
    cap = health.get("kv_capacity_tokens") or 0
    return health.get("kv_used_tokens", 0) / cap if cap else 0.0


def accepted_per_position(stats: RequestStats) -> list[int]:
    """How many of a request's rounds accepted a draft token at each position of their path: a round that
    accepts n tokens (its bonus token included) accepted draft tokens at positions 0 .. n-2."""
    counts = [0] * max((a - 1 for a in stats.accepted), default=0)
    for a in stats.accepted:
        for pos in range(a - 1):
            counts[pos] += 1
    return counts
