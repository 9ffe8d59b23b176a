"""A request waits at most its queue timeout, on a real `serve run` of serve.yaml with a tiny pair and one slot:
one long request holds the slot, 20 more wait, and the next one gets 503 queue_timeout with Retry-After after
about the queue timeout, not after the 20 ahead of it; the counts return to 0 once the clients leave.

One slot, so the holder runs alone and its trees are not sized for load: a middle call at every layer of a
round keeps it running for several queue timeouts (with four slots, four holders under load take plain
steps and may end before the queue times out, which hands the late request a slot)."""

import asyncio
import re
import time

import httpx
import pytest
from localserve import serve_tiny
from tiny import hf_greedy, tiny_model

from treegraft_dist.evaluation.soak import settle
from treegraft_dist.models.hf import CausalLM

pytestmark = pytest.mark.integration

NAME, KEY = "tiny-queue", "sk-test-4567"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUEUE_TIMEOUT = 4


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", init=0.4, seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory, target):
    with serve_tiny(tmp_path_factory.mktemp("queue"), target, NAME, env_vars={"TREEGRAFT_API_KEY": KEY},
                    max_requests=1, max_queued=24, max_tokens=8, queue_timeout=QUEUE_TIMEOUT) as served:
        yield served


async def _drain(lines) -> None:
    async for _ in lines:
        pass


def test_a_request_waits_at_most_its_queue_timeout(server, target):
    base, tok = server[0], server[1]
    # Sampled, with a middle call at every layer of a round: it outlasts the queue timeout by far.
    long = {"model": NAME, "prompt": "long", "max_tokens": 440, "temperature": 1, "seed": 1, "method": "all-mid",
            "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120) as http:
            holder = await http.send(http.build_request("POST", "/v1/completions", json=long), stream=True)
            assert holder.status_code == 200
            lines = holder.aiter_lines()
            await anext(lines)  # it runs
            reading = asyncio.create_task(_drain(lines))
            fillers = [asyncio.create_task(http.post("/v1/completions", json={**long, "stream": False}))
                       for _ in range(20)]
            # The late request goes once the fillers wait (the count stops growing).
            seen = -1
            while (waiting := (await http.get("/health")).json()["waiting"]) != seen or not waiting:
                seen = waiting
                await asyncio.sleep(0.1)
            start = time.monotonic()
            late = await http.post("/v1/completions", json={"model": NAME, "prompt": "late", "max_tokens": 2})
            waited = time.monotonic() - start
            still = not reading.done()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
            await holder.aclose()
            return late, waited, still

    late, waited, still = asyncio.run(run())
    assert still, "the holder ended before the late request timed out: the test needs a longer holder"
    assert late.status_code == 503, late.text
    err = late.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_timeout", late.text
    assert not re.search(r"pid=|ip=|actor_id|Traceback|ray::", late.text), late.text
    assert int(late.headers["Retry-After"]) >= 1
    assert QUEUE_TIMEOUT - 1 <= waited <= QUEUE_TIMEOUT + 20
    body = settle(base)
    assert (body["running"], body["waiting"]) == (0, 0)
    # The slot is free again and serves greedy output.
    resp = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "after", "max_tokens": 6,
                                                      "temperature": 0}, headers=AUTH, timeout=120)
    want = tok.decode(hf_greedy(CausalLM(target), tok("after")["input_ids"], 6), skip_special_tokens=True)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
