"""The server's request checks and text streaming without a server: OpenAI parameters checked into what
the engine takes, stop strings cut exactly where one-shot decoding would, characters whose bytes span tokens
are never half-sent, and the error and response bodies keep OpenAI's shape."""

import json

import pytest
import torch
from tiny import VOCAB, char_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treegraft_dist.decoding.stats import RequestStats
from treegraft_dist.serving import (
    _APPLIED,
    _NEUTRAL,
    INT64_MAX,
    INT64_MIN,
    MAX_BODY_BYTES,
    ApiError,
    ServedModel,
    TextStream,
    chunk_body,
    decode_body,
    parse_request,
    response_body,
    speculation_details,
)

MODEL = ServedModel("m", context=64, eos_ids=(), default_max_tokens=10)
TOK = char_tokenizer()
HI = [{"role": "user", "content": "hi"}]


def _parse(body, chat=False, check=lambda m: None):
    return parse_request({"model": "m", **body}, chat, MODEL, TOK, check)


def _error(body, chat=False) -> ApiError:
    with pytest.raises(ApiError) as e:
        _parse(body, chat)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    return e.value


def byte_tokenizer():
    """Byte-level: every byte its own token, so a character of several UTF-8 bytes spans several tokens."""
    vocab = {c: i for i, c in enumerate(sorted(set(pre_tokenizers.ByteLevel.alphabet())))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_request_becomes_engine_arguments():
    req = _parse({"prompt": "abc", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
                  "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "method": "ar"})
    assert req.prompt_ids == TOK("abc")["input_ids"] and req.max_tokens == 5
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.seed) == (0.5, 0.9, 7, 3)
    assert (req.stop, req.stream, req.include_usage, req.method) == (("x",), True, True, "ar")
    assert req.id.startswith("cmpl-")
    default = _parse({"prompt": [1, 2, 3]})
    assert default.prompt_ids == [1, 2, 3] and default.max_tokens == 10 and default.sampling.temperature == 1.0
    assert _parse({"prompt": "y" * 60}).max_tokens == 4  # what is left of the context
    chat = _parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "max_completion_tokens": 3}, chat=True)
    assert chat.max_tokens == 3 and chat.id.startswith("chatcmpl-")
    assert chat.prompt_ids == TOK("[user] hi\n[assistant] ")["input_ids"]


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "a", "top_k": -2}, 400, "top_k"),
    ({"prompt": "a", "seed": "1"}, 400, "seed"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 500]}, 400, "prompt"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "echo": True}, 400, "echo"),
    ({"prompt": "a", "model": None}, 400, "model"),
    ({"prompt": "a", "model": "other"}, 404, "model"),
])
def test_bad_parameters(body, status, param):
    e = _error(body)
    assert (e.status, e.param) == (status, param)


@pytest.mark.parametrize("field,value,got", [
    ("seed", INT64_MAX, INT64_MAX), ("seed", INT64_MIN, INT64_MIN), ("seed", -5, -5),
    ("temperature", 1e-40, 0.0), ("temperature", 1e-5, 1e-5), ("temperature", 2, 2.0), ("temperature", 0, 0.0),
    ("top_p", 1, 1.0), ("top_p", 1e-9, 1e-9),
    ("top_k", -1, 0), ("top_k", 0, 0), ("top_k", 1, 1), ("top_k", 10**6, 10**6),  # beyond the vocabulary: all
    ("stop_token_ids", [0, VOCAB - 1], (0, VOCAB - 1)), ("stop_token_ids", [], ()), ("stop_token_ids", None, ()),
    ("max_tokens", 63, 63), ("user", "end-user-7", "end-user-7"), ("n", 1, None),
])
def test_bounds_that_pass(field, value, got):
    req = _parse({"prompt": "a", field: value})
    where = {"seed": req.seed, "temperature": req.sampling.temperature, "top_p": req.sampling.top_p,
             "top_k": req.sampling.top_k, "stop_token_ids": req.stop_token_ids, "max_tokens": req.max_tokens,
             "user": req.user}
    assert where.get(field) == got and type(where.get(field)) is type(got)


@pytest.mark.parametrize("field,value", [
    ("seed", INT64_MAX + 1), ("seed", INT64_MIN - 1), ("seed", 2**64), ("seed", 1.0), ("seed", True),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 2.0000001), ("temperature", -1e-9),
    ("temperature", True), ("temperature", "1"), ("temperature", 10**400),
    ("top_p", 0), ("top_p", 0.0), ("top_p", float("nan")), ("top_p", 1.0000001), ("top_p", False),
    ("top_k", -2), ("top_k", 5.0), ("top_k", 2**64), ("top_k", True),
    ("max_tokens", 5.0), ("max_tokens", 0), ("max_tokens", 10**100), ("max_tokens", "5"),
    ("n", 2), ("n", 1.0), ("n", True), ("n", 0),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5), ("stop_token_ids", [1] * 65), ("stop_token_ids", [2**64]),
    ("user", 7), ("user", "u" * 257), ("user", "\ud800"),
    ("stop", "\udfff"), ("stream", 1), ("method", ""), ("prompt", [10**100]), ("prompt", "a\ud800b"),
])
def test_bounds_that_fail_name_the_parameter(field, value):
    e = _error({"prompt": "a", field: value})
    assert (e.status, e.param) == (400, field)
    json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # sendable whatever was sent


def test_max_tokens_in_chat_is_max_completion_tokens_first():
    assert _parse({"messages": HI, "max_completion_tokens": 3, "max_tokens": 9}, chat=True).max_tokens == 3
    assert _parse({"messages": HI, "max_tokens": 9}, chat=True).max_tokens == 9
    assert _error({"messages": HI, "max_completion_tokens": 2.0}, chat=True).param == "max_completion_tokens"
    assert _error({"messages": [{"role": "user", "content": "\ud800"}]}, chat=True).param == "messages"


def test_a_negative_seed_seeds_torch():
    for seed in (INT64_MIN, -5, INT64_MAX):
        g = torch.Generator().manual_seed(_parse({"prompt": "a", "seed": seed}).seed)
        assert torch.rand(1, generator=g).item() == torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


@pytest.mark.parametrize("chat", [False, True])
def test_every_unimplemented_parameter_passes_only_at_its_default(chat):
    body = {"messages": HI} if chat else {"prompt": "a"}
    for field, values in _NEUTRAL[chat].items():
        for value in (None, *values):
            _parse({**body, field: value}, chat)
        for value in ({"x": 1}, "on", 0.5, 7):
            if value not in values:
                e = _error({**body, field: value}, chat)
                assert (e.status, e.param, e.code) == (400, field, "unsupported_parameter")
                assert "not supported by this server" in e.message and "remove it" in e.message


def test_every_parameter_of_openais_completions_is_applied_or_neutral():
    from openai.types.completion_create_params import CompletionCreateParamsBase

    openai_params = set(CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert openai_params <= _APPLIED[False] | set(_NEUTRAL[False])


@pytest.mark.parametrize("body,chat", [
    ({"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
      "response_format": {"type": "text"}, "logprobs": None, "best_of": 1, "echo": False, "suffix": "",
      "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True}, False),
    ({"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
      "response_format": None, "store": False, "presence_penalty": 0}, True),
])
def test_defaults_of_unimplemented_parameters_are_accepted(body, chat):
    req = _parse({**body, **({"messages": HI} if chat else {"prompt": "a"})}, chat)
    assert req.sampling.temperature == 1.0 and req.stop_token_ids == ()


@pytest.mark.parametrize("body,chat,param", [
    ({"presence_penalty": 1.5}, False, "presence_penalty"),
    ({"presence_penalty": False}, False, "presence_penalty"),  # a boolean is never a number
    ({"frequency_penalty": -1}, True, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, True, "response_format"),
    ({"response_format": {"type": "text", "strict": True}}, False, "response_format"),
    ({"logit_bias": {"5": 100}}, False, "logit_bias"),
    ({"logprobs": 0}, False, "logprobs"),  # completions: still asks for the chosen tokens' log-probabilities
    ({"logprobs": 3}, False, "logprobs"),
    ({"logprobs": True}, True, "logprobs"),
    ({"top_logprobs": 0}, False, "top_logprobs"),  # a chat parameter only
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True, "tools"),
    ({"tool_choice": "auto"}, True, "tool_choice"),
    ({"echo": True}, True, "echo"),
    ({"foo": 1}, False, "foo"),
    ({"foo": None}, True, "foo"),
    ({"prompt": "a"}, True, "prompt"),
    ({"messages": HI}, False, "messages"),
    ({"max_completion_tokens": 3}, False, "max_completion_tokens"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, False, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, False, "stream_options"),
])
def test_unsupported_parameters_are_named(body, chat, param):
    base = {"messages": HI} if chat else {"prompt": "a"}
    e = _error({**base, **body}, chat)
    assert (e.status, e.param, e.code) == (400, param, "unsupported_parameter")
    assert param in e.message and "remove it" in e.message


def test_decode_body():
    assert decode_body(b'{"model": "m", "prompt": "\\u00e9"}') == {"model": "m", "prompt": "\u00e9"}
    assert decode_body(b"[]" + b" " * (MAX_BODY_BYTES - 2)) == []
    cases = [(b" " * (MAX_BODY_BYTES + 1), 413, "request_too_large"), (b"{not json", 400, None),
             (b'{"a": "\xff"}', 400, None), (b'{"temperature": NaN}', 400, None), (b"[-Infinity]", 400, None),
             (b"[" * 100_000, 400, None), (b"1" * 5000, 400, None), (b"", 400, None)]
    for raw, status, code in cases:
        with pytest.raises(ApiError) as e:
            decode_body(raw)
        assert (e.value.status, e.value.code) == (status, code)
        assert status == 413 or "not valid JSON" in e.value.message
    with pytest.raises(ApiError) as e:
        decode_body(b"[1, 2]", limit=5)
    assert e.value.status == 413 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_the_method_check_is_the_servers():
    def check(m):
        if m != "ar":
            raise ValueError(f"unknown method {m!r}")

    assert _parse({"prompt": "a", "method": "ar"}, check=check).method == "ar"
    with pytest.raises(ApiError, match="unknown method 'fast'"):
        _parse({"prompt": "a", "method": "fast"}, check=check)


def test_a_full_queue_error_says_when_to_retry():
    e = ApiError(429, "full", code="queue_full", retry_after=0.2)
    assert e.headers() == {"Retry-After": "1"} and e.body()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("stop", [(), ("lo w",), ("o", "zz"), ("ld!",), ("world", "lo")])
def test_text_streams_as_one_shot_decoding_cuts_it(stop):
    tok = char_tokenizer()
    ids = tok("hello world!")["input_ids"]
    want = tok.decode(ids)
    hits = [want.find(s) for s in stop if s in want]
    want = want[: min(hits)] if hits else want
    for step in (1, 2, 5):
        stream = TextStream(tok, stop)
        text = "".join(stream.push(ids[i: i + step]) for i in range(0, len(ids), step)) + stream.finish()
        assert text == want and stream.stopped == bool(hits)


def test_multibyte_characters_are_never_sent_half_done():
    tok = byte_tokenizer()
    text = "naïve — 東京 ok"
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text)  # some characters span several tokens
    stream = TextStream(tok)
    parts = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


def test_bodies_carry_speculation_details():
    stats = RequestStats("treegraft", prompt_tokens=3, new_tokens=7, rounds=3, accepted=[3, 2, 2],
                         tree_sizes=[8, 8, 4], middle_calls=[1, 0, 2])
    d = speculation_details(stats)
    assert d == {**d, "method": "treegraft", "rounds": 3, "draft_tokens": 17, "accepted_draft_tokens": 4,
                 "middle_calls": 3, "mean_accepted_tokens": round(7 / 3, 4), "acceptance_rate": round(4 / 17, 4)}
    req = _parse({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                  "stream_options": {"include_usage": True}}, chat=True)
    body = response_body(req, MODEL, "abc", "length", 7, stats)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "abc"
    assert body["usage"]["total_tokens"] == len(req.prompt_ids) + 7
    first = chunk_body(req, MODEL, "", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None


def test_accepted_tokens_per_position_and_the_engine_gauges():
    from treegraft_dist.serving import ServingMetrics, accepted_per_position

    stats = RequestStats("01001", new_tokens=9, rounds=4, accepted=[1, 3, 4, 1], tree_sizes=[1, 6, 6, 6],
                         middle_calls=[0, 1, 1, 0])
    assert accepted_per_position(stats) == [2, 2, 1]
    assert accepted_per_position(RequestStats("ar")) == []
    m = ServingMetrics()
    m.request_done(stats, "treegraft")
    m.engine_state({"waiting": 2, "kv_used_tokens": 30, "kv_capacity_tokens": 120, "rebuilds": 1}, running=3,
                   waiting=1)
    text = m.render().decode()
    for series, value in (('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}', 2.0),
                          ('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="2"}', 1.0),
                          ("treegraft_requests_running", 3.0), ("treegraft_requests_waiting", 3.0),
                          ("treegraft_kv_cache_usage", 0.25), ("treegraft_target_group_rebuilds", 1.0)):
        assert f"{series} {value}" in text, series
