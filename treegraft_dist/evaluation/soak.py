"""A bounded soak of a running server: many greedy requests at once over mixed methods, streamed and not,
some clients leaving early, while faults are injected; every answer is classed and checked against what
plain decoding gives. `tests/jobs/test_serve_faults.py` runs a short one, `jobs/bench/soak.py` a longer one.

Classes of an answer:
  served        200 with exactly the expected text
  failed        503 before any text, or a stream that ended in one error event (503-class code) after a
                correct prefix of the expected text: the fault's own casualties, told so cleanly
  disconnected  the client left on purpose after its first event
  lost          anything else: wrong text, another status, a 5xx, a stream without [DONE], a wait past its
                bound. A sound server loses none.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

RETRY_CODES = ("engine_restarting", "engine_unavailable", "queue_timeout")


@dataclass
class SoakReport:
    served: int = 0
    failed: int = 0
    disconnected: int = 0
    lost: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # what each lost answer was

    def add(self, kind: str, status: int, problem: str = "") -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.statuses[status] += 1
        if problem:
            self.problems.append(problem)

    def row(self) -> dict:
        return {"served": self.served, "failed": self.failed, "disconnected": self.disconnected, "lost": self.lost,
                "statuses": dict(sorted(self.statuses.items()))}


@dataclass(frozen=True)
class Fault:
    """`inject()` (run in a thread) once `after` requests have ended."""

    after: int
    name: str
    inject: Callable[[], object]


async def soak(base: str, model: str, prompts: list[str], expect: Callable[[str, int], str], requests: int = 200,
               concurrency: int = 16, methods: tuple[str, ...] = ("treegraft", "ar", "all-small", "all-mid", "01001"),
               max_tokens: tuple[int, int] = (4, 16), disconnect: float = 0.1, faults: tuple[Fault, ...] = (),
               timeout_s: float = 120.0, headers: dict | None = None, seed: int = 0) -> SoakReport:
    """`requests` completions (prompts, methods, lengths and streaming drawn with `seed`), `concurrency` at
    once; `expect(prompt, n)` is the text plain greedy decoding gives for `n` tokens."""
    rng = random.Random(seed)
    plan = [(rng.choice(prompts), rng.choice(methods), rng.randint(*max_tokens), rng.random() < 0.5,
             rng.random() < disconnect) for _ in range(requests)]
    report, gate, ended = SoakReport(), asyncio.Semaphore(concurrency), [0]
    pending = sorted(faults, key=lambda f: f.after)

    async def one(http: httpx.AsyncClient, prompt: str, method: str, n: int, stream: bool, leave: bool) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "method": method,
                "stream": stream}
        want = expect(prompt, n)
        async with gate:
            try:
                kind, status, problem = await asyncio.wait_for(
                    _stream(http, body, want, leave) if stream else _plain(http, body, want), timeout_s)
            except asyncio.TimeoutError:
                kind, status, problem = "lost", 0, f"{method} {prompt!r}: no answer within {timeout_s:g} s"
            except httpx.HTTPError as e:
                kind, status, problem = "lost", 0, f"{method} {prompt!r}: {type(e).__name__}: {e}"
            report.add(kind, status, problem)
            ended[0] += 1
            while pending and ended[0] >= pending[0].after:
                fault = pending.pop(0)
                threading.Thread(target=fault.inject, name=f"fault-{fault.name}", daemon=True).start()

    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, headers=headers or {}) as http:
        await asyncio.gather(*(one(http, *p) for p in plan))
    return report


async def _plain(http: httpx.AsyncClient, body: dict, want: str) -> tuple[str, int, str]:
    resp = await http.post("/v1/completions", json=body)
    what = f"{body['method']} {body['prompt']!r}"
    if resp.status_code == 200:
        text = resp.json()["choices"][0]["text"]
        return ("served", 200, "") if text == want else ("lost", 200, f"{what}: {text!r} != {want!r}")
    if resp.status_code == 503 and resp.json()["error"]["code"] in RETRY_CODES and "Retry-After" in resp.headers:
        return "failed", 503, ""
    return "lost", resp.status_code, f"{what}: {resp.status_code} {resp.text[:300]}"


async def _stream(http: httpx.AsyncClient, body: dict, want: str, leave: bool) -> tuple[str, int, str]:
    what = f"{body['method']} {body['prompt']!r} (streamed)"
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            if resp.status_code == 503 and json.loads(resp.text)["error"]["code"] in RETRY_CODES:
                return "failed", 503, ""
            return "lost", resp.status_code, f"{what}: {resp.status_code} {resp.text[:300]}"
        events = []
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if leave:
                return "disconnected", 200, ""
    if not events or events[-1] != "[DONE]":
        return "lost", 200, f"{what}: the stream ended without [DONE]: {events[-2:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    if chunks and "error" in chunks[-1]:
        code = chunks[-1]["error"]["code"]
        if code in RETRY_CODES and want.startswith(text):
            return "failed", 503, ""
        return "lost", 200, f"{what}: error event {chunks[-1]['error']} after {text!r}"
    return ("served", 200, "") if text == want else ("lost", 200, f"{what}: {text!r} != {want!r}")


def settle(base: str, deadline_s: float = 60.0, headers: dict | None = None) -> dict:
    """/health's body once nothing runs or waits (or at the deadline): the counts a soak must leave at 0."""
    import time

    end = time.monotonic() + deadline_s
    while True:
        body = httpx.get(base + "/health", timeout=10, headers=headers or {}).json()
        if (body.get("running", 1) == 0 and body.get("waiting", 1) == 0) or time.monotonic() > end:
            return body
        time.sleep(0.25)
