"""The server that one request cannot break, on a real `serve run` of serve.yaml with a tiny pair and an API
key: hundreds of generated bodies (valid, at the bounds, malformed) get 200 or a 4xx in OpenAI's shape and
never rebuild the target group; the bodies that used to take the group down are 400s or greedy; a soak of 200
mixed requests with client disconnects, then a drafter, a target worker and the coordinator killed under load,
serves every completed request exactly and fails the others cleanly with 503; the counts return to 0."""

import asyncio
import json
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from localserve import kill_actors, serve_tiny
from tiny import hf_greedy, tiny_model

from treegraft_dist.evaluation.soak import Fault, settle, soak
from treegraft_dist.models.hf import CausalLM

pytestmark = pytest.mark.integration

NAME, KEY = "tiny-faults", "sk-test-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_REQUESTS, MAX_QUEUED, QUEUE_TIMEOUT = 4, 24, 8


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", init=0.4, seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory, target):
    with serve_tiny(tmp_path_factory.mktemp("faults"), target, NAME, env_vars={"TREEGRAFT_API_KEY": KEY},
                    max_requests=MAX_REQUESTS, max_queued=MAX_QUEUED, max_tokens=8,
                    queue_timeout=QUEUE_TIMEOUT) as served:
        yield served


@pytest.fixture(scope="module")
def greedy(server, target):
    """text(prompt, n): what plain greedy decoding of the target gives, cached."""
    tok, lm, seen = server[1], CausalLM(target), {}

    def text(prompt: str, n: int) -> str:
        if (prompt, n) not in seen:
            seen[prompt, n] = tok.decode(hf_greedy(lm, tok(prompt)["input_ids"], n), skip_special_tokens=True)
        return seen[prompt, n]

    return text


def post(base: str, body: dict, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": NAME, **body}, headers={**AUTH, **(headers or {})},
                      timeout=timeout)


def health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=10).json()


def check_error_shape(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], resp.text
    assert not re.search(r"pid=|ip=|actor_id|Traceback|ray::", resp.text), resp.text
    return err


def test_an_api_key_guards_every_route_but_health(server):
    base = server[0]
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for resp in (httpx.get(base + "/v1/models", headers=headers, timeout=10),
                     httpx.get(base + "/metrics", headers=headers, timeout=10),
                     httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "hi"}, headers=headers,
                                timeout=10)):
            assert resp.status_code == 401, resp.text
            assert check_error_shape(resp)["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"] == NAME


def test_the_bodies_that_used_to_rebuild_the_group(server, greedy):
    """seed 2**64 with sampling, a temperature of 1e-40: a 400 and greedy output, no rebuild; stop_token_ids end
    the completion; penalties and a JSON response format are refused by name; the request id comes back."""
    base, tok = server[0], server[1]
    resp = post(base, {"prompt": "abc", "temperature": 1, "seed": 2**64, "max_tokens": 4})
    assert resp.status_code == 400 and check_error_shape(resp)["param"] == "seed"
    resp = post(base, {"prompt": "abc", "temperature": 1e-40, "max_tokens": 6})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy("abc", 6)
    for field, value in (("presence_penalty", 1.5), ("response_format", {"type": "json_object"}),
                         ("frequency_penalty", -1), ("foo", 1)):
        resp = post(base, {"prompt": "abc", field: value})
        err = check_error_shape(resp)
        assert resp.status_code == 400 and (err["param"], err["code"]) == (field, "unsupported_parameter")
    full = greedy("The cat", 8)
    stop_id = tok(full[3])["input_ids"][-1]
    resp = post(base, {"prompt": "The cat", "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(full[3]) + 1]
    resp = post(base, {"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "my-req-1"})
    assert resp.headers["X-Request-Id"] == "my-req-1" and resp.json()["id"] == "my-req-1"
    bad = post(base, {"prompt": "abc", "n": 3}, headers={"X-Request-Id": "my-req-2"})
    assert bad.status_code == 400 and bad.headers["X-Request-Id"] == "my-req-2"
    line = re.compile(r"request id=my-req-1 endpoint=completions method=treegraft prompt_tokens=3 "
                      r"completion_tokens=2 status=200 ttft_ms=\d+ total_ms=\d+")
    assert _wait_for(lambda: line.search(server[2].read_text()), 30), server[2].read_text()[-3000:]
    assert health(base)["rebuilds"] == 0


def _bodies():
    """Request bodies: mostly one bad or boundary field on a valid body, some wholly arbitrary JSON."""
    weird = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.floats(min_value=-1e-30, max_value=1e-30), st.text(max_size=20),
                      st.lists(st.integers(-5, 200), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                 max_size=3))
    fields = st.sampled_from(["temperature", "top_p", "top_k", "seed", "max_tokens", "n", "stop", "stop_token_ids",
                              "stream", "stream_options", "logprobs", "presence_penalty", "frequency_penalty",
                              "logit_bias", "response_format", "method", "prompt", "model", "user", "echo",
                              "min_p", "suffix", "best_of", "unknown_field", "\u00e9\u4e2d"])
    base = {"model": NAME, "prompt": "fuzz", "max_tokens": 3, "temperature": 0}
    one_field = st.builds(lambda k, v: {**base, k: v}, fields, weird)
    bounds = st.builds(lambda t, p, s, k: {**base, "temperature": t, "top_p": p, "seed": s, "top_k": k},
                       st.sampled_from([0, 1e-5, 1e-6, 2.0, 2.0000001]), st.sampled_from([1e-9, 1.0, 0.5]),
                       st.sampled_from([-2**63, 2**63 - 1, 2**63, -1, 0]), st.sampled_from([-1, 0, 1, 95, 10**6]))
    nested = st.recursive(st.integers() | st.text(max_size=4), lambda c: st.lists(c, max_size=3)
                          | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=12)
    anything = st.builds(lambda x: {**base, "prompt": x}, nested) | nested
    return st.one_of(one_field, one_field, bounds, anything)


def test_generated_bodies_never_break_the_server(server, greedy):
    base = server[0]
    statuses = []

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=_bodies(), chat=st.booleans())
    def one(body, chat):
        if chat and isinstance(body, dict) and "prompt" in body:
            body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [
                {"role": "user", "content": body["prompt"]}]}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        resp = httpx.post(base + path, content=json.dumps(body, allow_nan=True), headers={
            **AUTH, "Content-Type": "application/json"}, timeout=120)
        statuses.append(resp.status_code)
        assert resp.status_code == 200 or 400 <= resp.status_code < 500, (body, resp.status_code, resp.text)
        if resp.status_code != 200:
            check_error_shape(resp)

    one()
    assert len(statuses) >= 200 and statuses.count(200) >= 10 and len(set(statuses)) >= 2
    assert health(base)["rebuilds"] == 0
    assert post(base, {"prompt": "after fuzz", "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"] \
        == greedy("after fuzz", 8)


def test_an_oversized_body_is_413(server):
    resp = httpx.post(server[0] + "/v1/completions", content=b"{" + b" " * (5 << 20) + b"}", headers={
        **AUTH, "Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and check_error_shape(resp)


def test_a_soak_with_disconnects_and_killed_actors(server, greedy):
    """200 requests, 16 at once, with random disconnects, then one drafter, one target worker and the
    coordinator killed under load: nothing is lost, every failure is a clean 503, the counts return to 0,
    and the replica recovers (Serve replaces it once its engine is dead)."""
    base = server[0]
    prompts = [f"soak {i}: {'ab' * (i % 4)}" for i in range(12)]
    common = dict(concurrency=16, headers=AUTH, timeout_s=150)
    calm = asyncio.run(soak(base, NAME, prompts, greedy, requests=200, seed=1, **common))
    assert calm.lost == 0, calm.problems[:5]
    assert calm.served >= 150, calm.row()
    assert (settle(base)["running"], settle(base)["waiting"]) == (0, 0)

    temp = server[3]
    faults = (Fault(10, "drafter", lambda: kill_actors("ray::DrafterHost", temp)),
              Fault(30, "target", lambda: kill_actors("ray::TargetWorker", temp)))
    hurt = asyncio.run(soak(base, NAME, prompts, greedy, requests=80, seed=2, faults=faults, **common))
    assert hurt.lost == 0, hurt.problems[:5]
    assert hurt.served >= 20, hurt.row()
    assert health(base)["rebuilds"] == 1 or _wait_for(lambda: health(base)["rebuilds"] == 1, 120)

    _wait_for(lambda: health(base)["status"] == "ok", 180)
    assert kill_actors("ray::Coordinator", temp) == 1
    start = time.monotonic()
    resp = post(base, {"prompt": "x", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 503 and time.monotonic() - start < 30, resp.text
    check_error_shape(resp)
    assert _wait_for(lambda: _answers(base, greedy), 300), "the replica was not replaced after its engine died"
    body = settle(base)
    assert (body["running"], body["waiting"], body["rebuilds"]) == (0, 0, 0)


def _answers(base: str, greedy) -> bool:
    try:
        resp = post(base, {"prompt": "back", "max_tokens": 6, "temperature": 0}, timeout=60)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy("back", 6)


def _wait_for(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if condition():
                return True
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    return False
