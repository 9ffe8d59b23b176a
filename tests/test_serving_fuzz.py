"""Any JSON body is a checked request or a 4xx in OpenAI's shape, never another exception: generated bodies
(valid, at the bounds, malformed: huge and negative integers, tiny and huge floats, NaN, wrong types, lone
surrogates, deep nesting, unknown fields) through `parse_request` for both endpoints, and bytes through
`decode_body`. A request that passes keeps every bound."""

import json
from functools import reduce

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import VOCAB, char_tokenizer

from treegraft_dist.serving import (
    _APPLIED,
    _NEUTRAL,
    GREEDY_BELOW,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_TOKEN_IDS,
    ApiError,
    ApiRequest,
    ServedModel,
    decode_body,
    parse_request,
)

MODEL = ServedModel("m", context=64, eos_ids=(), default_max_tokens=10)
TOK = char_tokenizer()
SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

ODD = [0, 1, -1, 2, 63, 64, VOCAB - 1, VOCAB, INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64, 10**100,
       -(10**100), 0.0, -0.0, 1e-40, 1e-5, 0.5, 1.0, 2.0, 5.0, 1e300, float("nan"), float("inf"), float("-inf"),
       True, False, None, "", "a", "ar", "text", "none", "m", "\u6771\u4eac", "\U0001f600", "\x00", "\ud800",
       "a\udfffb", "x" * 300]
scalars = st.one_of(st.sampled_from(ODD), st.integers(), st.floats(), st.text(max_size=8))
nested = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
deep = st.integers(1, 400).map(lambda depth: reduce(lambda inner, _: [inner], range(depth), 0))
json_values = st.one_of(scalars, nested, nested, deep)
texts = st.text(max_size=20) | st.sampled_from(["\ud800", "a\udfffb", "\U0001f600", "\x00", "\u6771\u4eac"])

valid = {  # per applied field: values within its bounds
    "temperature": st.sampled_from([0, 1e-40, 1e-5, 2]) | st.floats(0, 2), "top_p": st.floats(1e-9, 1),
    "top_k": st.sampled_from([-1, 0]) | st.integers(1, INT64_MAX), "seed": st.integers(INT64_MIN, INT64_MAX),
    "max_tokens": st.integers(1, 40), "max_completion_tokens": st.integers(1, 40), "n": st.just(1),
    "stream": st.booleans(), "stop": st.sampled_from(["a", ["b", "cd"], []]), "user": st.text(max_size=10),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=MAX_STOP_TOKEN_IDS), "method": st.just("ar"),
}
edges = {  # per applied field: values at its bounds and just beyond them
    "temperature": st.sampled_from([-0.0, 1e-40, 1e-5, 2, 2.0000001, -1e-9]) | st.floats(0, 2e-5),
    "top_p": st.sampled_from([0, 1e-9, 1, 1.0000001]),
    "top_k": st.sampled_from([-2, -1, 0, 1, VOCAB, INT64_MAX, INT64_MAX + 1]),
    "seed": st.sampled_from([INT64_MIN - 1, INT64_MIN, INT64_MAX, INT64_MAX + 1, 2**64]),
    "max_tokens": st.sampled_from([-1, 0, 1, 5.0, 63, 64, 10**100]),
    "max_completion_tokens": st.sampled_from([-1, 0, 1, 5.0, 63, 64, 10**100]),
    "n": st.sampled_from([1, 1.0, 2, True]), "stream": st.sampled_from([1, "true"]),
    "user": st.sampled_from(["u" * 256, "u" * 257, "\ud800"]), "method": st.sampled_from(["", 1]),
    "stop": st.sampled_from(["\ud800", [""], ["a"] * 4, ["a"] * 5]),
    "stop_token_ids": st.sampled_from([[VOCAB - 1], [VOCAB], [-1], [0] * MAX_STOP_TOKEN_IDS,
                                       [0] * (MAX_STOP_TOKEN_IDS + 1), [True], [1.0], 5]),
}
others = sorted(_APPLIED[False] | _APPLIED[True] | set(_NEUTRAL[False]) | set(_NEUTRAL[True])) \
    + ["foo", "\u00e9", "\ud800", ""]


@st.composite
def bodies(draw, chat: bool):
    """Mostly a valid body (some fields in bounds, some unimplemented ones at their defaults) with, most
    often, one probe: a field at or beyond its bounds, or any field with any value. Now and then any JSON
    value at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": draw(texts)}]}
    else:
        body = {"model": "m", "prompt": draw(texts | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))}
    applied = sorted(_APPLIED[chat] & set(valid))
    for key in draw(st.lists(st.sampled_from(applied), max_size=4, unique=True)):
        body[key] = draw(valid[key])
    neutral = _NEUTRAL[chat]
    for key in draw(st.lists(st.sampled_from(sorted(neutral)), max_size=2, unique=True)):
        body[key] = draw(st.sampled_from((None, *neutral[key])))
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = draw(st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values)
    probe = draw(st.integers(0, 5))
    if probe == 0:
        body[draw(st.sampled_from(others))] = draw(json_values)
    elif probe > 1:
        key = draw(st.sampled_from(applied))
        body[key] = draw(edges[key])
    return body


def check(body, chat: bool) -> ApiRequest | None:
    try:
        req = parse_request(body, chat, MODEL, TOK, lambda m: None)
    except ApiError as e:
        assert 400 <= e.status < 500, (body, e.status, e.message)
        error = e.body()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # sendable whatever the client sent
        return None
    s = req.sampling
    assert s.temperature == 0.0 or GREEDY_BELOW <= s.temperature <= 2.0
    assert 0.0 < s.top_p <= 1.0 and type(s.top_k) is int and s.top_k >= 0
    assert type(req.seed) is int and INT64_MIN <= req.seed <= INT64_MAX
    assert len(req.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(type(t) is int and 0 <= t < VOCAB for t in req.stop_token_ids + tuple(req.prompt_ids))
    assert type(req.max_tokens) is int and 1 <= req.max_tokens <= MODEL.context - len(req.prompt_ids)
    for text in (req.user or "", *req.stop):
        text.encode("utf-8")  # no lone surrogate reaches the server's logs or stop matching
    return req


@SETTINGS
@given(body=bodies(chat=False))
def test_any_completions_body_is_a_request_or_a_4xx(body):
    check(body, chat=False)


@SETTINGS
@given(body=bodies(chat=True))
def test_any_chat_body_is_a_request_or_a_4xx(body):
    check(body, chat=True)


@SETTINGS
@given(raw=st.binary(max_size=64) | bodies(chat=False).map(lambda b: json.dumps(b).encode("utf-8")))
def test_any_bytes_are_json_or_a_4xx(raw):
    try:
        body = decode_body(raw, limit=4096)
    except ApiError as e:
        assert (e.status, e.code) == (413, "request_too_large") or (e.status == 400 and "not valid JSON" in e.message)
        return
    check(body, chat=False)
