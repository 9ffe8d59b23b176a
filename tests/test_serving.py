"""The server's request checks and text streaming without a server: OpenAI parameters checked into what
the engine takes, stop strings cut exactly where one-shot decoding would, characters whose bytes span tokens
are never half-sent, and the error and response bodies keep OpenAI's shape."""

import pytest
from tiny import char_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treegraft_dist.decoding.stats import RequestStats
from treegraft_dist.serving import (
    ApiError,
    ServedModel,
    TextStream,
    chunk_body,
    parse_request,
    response_body,
    speculation_details,
)

MODEL = ServedModel("m", context=64, eos_ids=(), default_max_tokens=10)


def _parse(body, chat=False, check=lambda m: None):
    return parse_request({"model": "m", **body}, chat, MODEL, char_tokenizer(), check)


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
    assert req.prompt_ids == char_tokenizer()("abc")["input_ids"] and req.max_tokens == 5
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.seed) == (0.5, 0.9, 7, 3)
    assert (req.stop, req.stream, req.include_usage, req.method) == (("x",), True, True, "ar")
    assert req.id.startswith("cmpl-")
    default = _parse({"prompt": [1, 2, 3]})
    assert default.prompt_ids == [1, 2, 3] and default.max_tokens == 10 and default.sampling.temperature == 1.0
    assert _parse({"prompt": "y" * 60}).max_tokens == 4  # what is left of the context
    chat = _parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "max_completion_tokens": 3}, chat=True)
    assert chat.max_tokens == 3 and chat.id.startswith("chatcmpl-")
    assert chat.prompt_ids == char_tokenizer()("[user] hi\n[assistant] ")["input_ids"]


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
    with pytest.raises(ApiError) as e:
        _parse(body)
    assert (e.value.status, e.value.param) == (status, param)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


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
