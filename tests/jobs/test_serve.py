"""The OpenAI-compatible server: a real `serve run` of the repository's serve.yaml (its args pointed at a tiny
pair) on a local cluster (`ray start --head`), driven by the official `openai` client. Completions and chat,
streamed and not, equal the target's own greedy decoding; bad requests get the right status and error body;
32 concurrent streaming clients all get their whole, correct output; killing the drafter actors under load
changes no output, and killing the target worker fails its requests with a clear error before the rebuilt
group serves the next ones; a full queue answers 429 with Retry-After; a client that leaves stops its
request; Prometheus metrics count it all."""

import asyncio
import re
import subprocess
import time

import httpx
import openai
import pytest
from localcluster import BIN, free_port
from localserve import kill_actors, serve_tiny, wait_until_serving
from tiny import char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model

from treegraft_dist.models.hf import CausalLM

pytestmark = pytest.mark.integration

NAME = "tiny-serve"
MAX_REQUESTS, MAX_QUEUED = 4, 30


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", init=0.4)


@pytest.fixture(scope="module")
def server(tmp_path_factory, target):
    """(base URL, tokenizer, log path) of `serve run` on serve.yaml with a tiny pair."""
    with serve_tiny(tmp_path_factory.mktemp("serve"), target, NAME, max_requests=MAX_REQUESTS,
                    max_queued=MAX_QUEUED, max_tokens=16, queue_timeout=600) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def oracle(target, ids: list[int], n: int) -> list[int]:
    return hf_greedy(CausalLM(target), ids, n)


def chat_ids(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def spec(resp) -> dict:
    return resp.model_extra["metrics"]["speculative_decoding"]


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


@pytest.mark.parametrize("method", [None, "ar", "all-mid", "01001"])
def test_completion_equals_plain_decoding(client, server, target, method):
    tok = server[1]
    prompt = "def add(a, b):"
    want = oracle(target, tok(prompt)["input_ids"], 14)
    extra = {} if method is None else {"method": method}
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=14, temperature=0, extra_body=extra)
    assert resp.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), 14)
    s = spec(resp)
    assert s["method"] == (method or "treegraft")
    assert s["rounds"] >= 1 and s["mean_accepted_tokens"] >= 1
    if method == "ar":
        assert (s["rounds"], s["draft_tokens"], s["middle_calls"]) == (13, 0, 0)
    else:
        assert s["draft_tokens"] > 0 and 0 <= s["accepted_draft_tokens"] <= s["draft_tokens"]
    if method == "all-mid":
        assert s["middle_calls"] > 0


def test_streamed_completion_with_usage(client, server, target):
    tok = server[1]
    prompt = "The quick brown fox"
    want = tok.decode(oracle(target, tok(prompt)["input_ids"], 15), skip_special_tokens=True)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=15, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 15
    assert spec(last)["method"] == "treegraft"


def test_chat_equals_plain_decoding_streamed_and_not(client, server, target):
    tok = server[1]
    question = "What is two plus two?"
    want = tok.decode(oracle(target, chat_ids(tok, question), 12), skip_special_tokens=True)
    messages = [{"role": "user", "content": question}]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == want
    assert resp.usage.prompt_tokens == len(chat_ids(tok, question))
    assert spec(resp)["draft_tokens"] > 0
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"method": "all-small"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_sampling_is_seeded(client, server, target):
    tok = server[1]
    prompt = "Once upon a time"
    full = tok.decode(oracle(target, tok(prompt)["input_ids"], 16), skip_special_tokens=True)
    stop = full[6:8]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "@@"],
                                         stream=stream)
        if stream:
            chunks = list(resp)
            assert "".join(c.choices[0].text for c in chunks) == cut
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert (resp.choices[0].text, resp.choices[0].finish_reason) == (cut, "stop")
    sampled = [client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.9,
                                         seed=seed, extra_body={"top_k": 20}).choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2] and len(sampled[0]) > 0


@pytest.mark.parametrize("body,status,param,code", [
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": "x" * 600}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "hi", "n": 2}, 400, "n", None),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"prompt": "hi", "method": "fastest"}, 400, "method", None),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
])
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    resp = httpx.post(server[0] + "/v1/completions", json={"model": NAME, **body}, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_bad_chat_and_bodies(server, client):
    for body in ({"messages": []}, {"messages": [{"role": "robot", "content": "hi"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}):
        resp = httpx.post(server[0] + "/v1/chat/completions", json={"model": NAME, **body}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
    resp = httpx.post(server[0] + "/v1/completions", content=b"{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "y" * 700}])


def test_32_concurrent_streaming_clients(server, target):
    tok = server[1]
    prompts = [f"Request {i}: count to {i % 7}" for i in range(32)]
    methods = ["treegraft", "all-small", "ar", "all-mid"]

    async def one(aclient, i):
        stream = await aclient.completions.create(model=NAME, prompt=prompts[i], max_tokens=12, temperature=0,
                                                  stream=True, extra_body={"method": methods[i % 4]})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    texts = asyncio.run(run_all())
    for p, text in zip(prompts, texts):
        assert text == tok.decode(oracle(target, tok(p)["input_ids"], 12), skip_special_tokens=True), p


async def stream_until_started(base: str, bodies: list[dict], started: int, then) -> tuple[object, list[list[str]]]:
    """Stream every body at once; once `started` streams have sent text, call `then()` (in a thread); returns
    its result and each stream's data lines (without the "data: " prefix)."""
    seen, go = set(), asyncio.Event()

    async def one(http, i, body):
        lines = []
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    seen.add(i)
                    if len(seen) >= started:
                        go.set()
        return lines

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        tasks = [asyncio.create_task(one(http, i, b)) for i, b in enumerate(bodies)]
        await go.wait()
        result = await asyncio.to_thread(then)
        return result, await asyncio.gather(*tasks)


def streamed_text(lines: list[str]) -> str:
    import json

    return "".join(c["choices"][0]["text"] for c in map(json.loads, lines[:-1]) if c.get("choices"))


def test_drafter_actors_killed_under_load_change_no_output(server, target):
    """16 streams over every kind of method; the n-gram and middle drafter actors are killed while they run:
    every output is still the target's greedy decoding, and the restarted drafters serve the next request."""
    base, tok = server[0], server[1]
    prompts = [f"Load {i}: abcab{'c' * (i % 3)}" for i in range(16)]
    methods = ["treegraft", "all-mid", "01001", "all-small"]
    bodies = [{"model": NAME, "prompt": p, "max_tokens": 120, "temperature": 0, "stream": True,
               "method": methods[i % 4]} for i, p in enumerate(prompts)]
    killed, streams = asyncio.run(stream_until_started(base, bodies, MAX_REQUESTS,
                                                       lambda: kill_actors("ray::DrafterHost", server[3])))
    assert killed == 2  # the n-gram actor and the middle drafter
    for p, lines in zip(prompts, streams):
        assert lines[-1] == "[DONE]" and "error" not in lines[-2], lines[-2:]
        assert streamed_text(lines) == tok.decode(oracle(target, tok(p)["input_ids"], 120), skip_special_tokens=True), p
    later = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": "after", "max_tokens": 20, "temperature": 0, "method": "all-mid"}).json()
    assert later["choices"][0]["text"] == tok.decode(oracle(target, tok("after")["input_ids"], 20), skip_special_tokens=True)
    assert later["metrics"]["speculative_decoding"]["middle_calls"] > 0  # a middle drafter again


def test_a_target_rank_killed_under_load_fails_its_requests_clearly_then_serves(server, target):
    """The target worker dies under load: the requests it was serving end with a clear error event (503,
    engine_restarting), none with wrong text; the group is rebuilt and later requests are served correctly."""
    import json

    base, tok = server[0], server[1]
    bodies = [{"model": NAME, "prompt": f"rank {i}", "max_tokens": 300, "temperature": 0, "stream": True,
               "method": ["ar", "all-small"][i % 2]} for i in range(8)]
    killed, streams = asyncio.run(stream_until_started(base, bodies, 2, lambda: kill_actors("ray::TargetWorker", server[3])))
    assert killed == 1
    failed = 0
    for body, lines in zip(bodies, streams):
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])
        want = tok.decode(oracle(target, tok(body["prompt"])["input_ids"], 300), skip_special_tokens=True)
        if "error" in last:
            failed += 1
            assert last["error"]["code"] == "engine_restarting" and "lost a worker" in last["error"]["message"]
            assert want.startswith(streamed_text(lines[:-1] + ["[DONE]"]))  # what it sent before was right
        else:
            assert streamed_text(lines) == want
    assert failed >= 1
    deadline = time.monotonic() + 180
    while True:  # the group is rebuilt: 503 with Retry-After until then
        resp = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": "later", "max_tokens": 20, "temperature": 0, "method": "01001"})
        if resp.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(float(resp.headers.get("Retry-After", 1)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tok.decode(oracle(target, tok("later")["input_ids"], 20),
                                                           skip_special_tokens=True)


def test_a_full_queue_answers_429_and_the_rest_are_served(server, target):
    tok = server[1]
    n, tokens = MAX_REQUESTS + MAX_QUEUED + 8, 300
    want = tok.decode(oracle(target, tok("z")["input_ids"], tokens), skip_special_tokens=True)

    async def run_all():
        async with httpx.AsyncClient(base_url=server[0], timeout=600) as http:
            body = {"model": NAME, "prompt": "z", "max_tokens": tokens, "temperature": 0, "method": "ar"}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(n)))

    answers = asyncio.run(run_all())
    full = [a for a in answers if a.status_code == 429]
    served = [a for a in answers if a.status_code == 200]
    assert len(full) + len(served) == n and len(served) >= MAX_REQUESTS + MAX_QUEUED and full
    for a in full:
        assert int(a.headers["Retry-After"]) >= 1 and a.json()["error"]["code"] == "queue_full"
    assert all(a.json()["choices"][0]["text"] == want for a in served)


def test_a_client_that_leaves_stops_its_request(server):
    base = server[0]
    body = {"model": NAME, "prompt": "abc", "max_tokens": 400, "temperature": 0, "stream": True, "method": "ar"}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while httpx.get(base + "/health", timeout=10).json()["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(base + "/health", timeout=10).json()["active"] == 0
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert _value(metrics, 'treegraft_requests_total{endpoint="completions",outcome="cancelled"}') >= 1


def test_prometheus_metrics(server, client):
    client.completions.create(model=NAME, prompt="metrics", max_tokens=8, temperature=0, extra_body={"method": "all-mid"})
    assert httpx.post(server[0] + "/v1/completions", json={"model": NAME, "prompt": ""}, timeout=30).status_code == 400
    text = httpx.get(server[0] + "/metrics", timeout=10).text
    assert _value(text, 'treegraft_requests_total{endpoint="completions",outcome="ok"}') >= 1
    assert _value(text, 'treegraft_requests_total{endpoint="completions",outcome="bad_request"}') >= 1
    assert _value(text, 'treegraft_drafts_total{method="all-mid"}') >= 1
    assert _value(text, 'treegraft_draft_tokens_total{method="all-mid"}') >= _value(
        text, 'treegraft_accepted_tokens_total{method="all-mid"}')
    assert _value(text, 'treegraft_middle_calls_total{method="all-mid"}') >= 1
    assert _value(text, "treegraft_time_to_first_token_seconds_count") >= 1
    assert _value(text, "treegraft_inter_token_latency_seconds_count") >= 7
    assert _value(text, "treegraft_request_queue_time_seconds_count") >= 1
    assert _value(text, "treegraft_e2e_request_latency_seconds_count") >= 1
    assert _value(text, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') >= 0
    assert _value(text, "treegraft_requests_running") == 0 and _value(text, "treegraft_kv_cache_usage") == 0
    assert _value(text, "treegraft_target_group_rebuilds") >= 0


def test_ray_metrics_endpoint_has_the_series(server, client):
    """The same series through Ray's metrics, read where a cluster's Prometheus reads them: Ray's metrics
    endpoint on the node (its agent exports what the replica recorded every few seconds)."""
    client.completions.create(model=NAME, prompt="ray metrics", max_tokens=6, temperature=0)
    wanted = ('ray_treegraft_requests_total{', 'ray_treegraft_generated_tokens_total{', "ray_treegraft_requests_running{",
              "ray_treegraft_requests_waiting{", "ray_treegraft_kv_cache_usage{", "ray_treegraft_target_group_rebuilds{",
              "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{", "ray_treegraft_request_queue_time_seconds_count{",
              "ray_treegraft_e2e_request_latency_seconds_count{")
    text, deadline = "", time.monotonic() + 90
    while not all(w in text for w in wanted) and time.monotonic() < deadline:
        time.sleep(2)
        text = httpx.get(server.ray_metrics, timeout=10).text
    missing = [w for w in wanted if w not in text]
    assert not missing, f"{missing} not at Ray's endpoint; its treegraft lines: " + "\n".join(
        line for line in text.splitlines() if "treegraft" in line or "vllm" in line)[:3000]
    ok = [line for line in text.splitlines() if line.startswith("ray_treegraft_requests_total{")
          and 'outcome="ok"' in line and 'endpoint="completions"' in line]
    assert ok and float(ok[0].rsplit(" ", 1)[1]) >= 1, ok


def _value(text: str, series: str) -> float:
    m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.M)
    assert m, f"{series} not in the metrics:\n{text[:3000]}"
    return float(m.group(1))


def test_treegraft_serve_starts_the_same_application(tmp_path, target):
    """`treegraft serve` on a local Ray of its own, given trajectories of its pair: the replica fits the
    scheduler for its device (in a Ray task, cached in --cache-dir) and names it in its log, the default method
    runs it and equals plain decoding, the models endpoint answers, then SIGTERM stops it cleanly."""
    import os
    import signal

    from tiny import write_trajectories

    from treegraft_dist.decoding.config import TreeConfig
    from treegraft_dist.decoding.costs import CostModel
    from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt

    tok = char_tokenizer()
    middle = perturbed_copy(target, 0.2, 1)
    t_dir = save_tiny(tmp_path / "target", target, tok)
    m_dir = save_tiny(tmp_path / "middle", middle, tok)
    prompts = [(b, q.question_id, chat_prompt(tok, [q.turns[0]], [])[-40:]) for b in ("gsm8k", "qa")
               for q in builtin(b)[:3]]
    cost = CostModel("elsewhere", 0.2, 0.1, {1: 3.0, 64: 8.0}, {1: 5.0, 4: 5.5, 16: 7.0})
    traj = write_trajectories(tmp_path / "traj", CausalLM(target), CausalLM(middle), (t_dir, m_dir), prompts,
                              TreeConfig(), cost, (1, 4, 16), 8)
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(BIN / "treegraft"), "serve", "--target", t_dir, "--middle", m_dir, "--model-name",
                             NAME, "--port", str(port), "--dtype", "float32", "--trajectories", str(traj),
                             "--cache-dir", str(tmp_path / "cache")], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        wait_until_serving(proc, base, log, deadline)
        assert re.search(r"scheduler fitted for this device \(.*float32.*\) from .*traj at budget \d+",
                         log.read_text()), log.read_text()[-6000:]
        assert len(list((tmp_path / "cache" / "schedulers").glob("*.npz"))) == 1
        body = {"model": NAME, "prompt": "hello", "max_tokens": 10, "temperature": 0}
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert resp["choices"][0]["text"] == tok.decode(oracle(target, tok("hello")["input_ids"], 10),
                                                        skip_special_tokens=True)
        assert httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"] == NAME
        while "treegraft: serving on" not in log.read_text():  # the endpoint can answer before serve.run returns
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # as a service manager stops it; Ctrl-C takes the same path
        assert proc.wait(120) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
