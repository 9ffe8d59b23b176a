"""A long soak of the server: rounds of mixed requests (methods, lengths, streamed and not, clients leaving
early), with a drafter, a target worker and the coordinator killed between rounds, and the counts of every
round printed as a table: served, failed by a fault (a clean 503), disconnected, lost (must be 0), and the
running and waiting counts the server reports afterwards (must be 0).

  .venv/bin/python -m jobs.bench.soak [--rounds 5] [--requests 400] [--concurrency 16] [--no-kills]
  .venv/bin/python -m jobs.bench.soak --url http://HOST:8000 --model NAME [--api-key KEY] [--no-kills]

Without --url it serves serve.yaml's application on a tiny random pair (as the server's tests do) on a local
cluster and checks every output against transformers' greedy decoding of that target. With --url the oracle
is the server's own plain decoding (method "ar", temperature 0) of each prompt, asked once, and kills reach
only actors on this machine. `--out FILE.parquet` writes the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from jobs.bench.common import tests_on_path
from treegraft_dist.evaluation.soak import Fault, settle, soak

KILLS = ("ray::DrafterHost", "ray::TargetWorker", "ray::Coordinator")


def kill(title: str) -> int:
    """Every process on this machine titled as an actor of class `title` (a server started elsewhere)."""
    killed = 0
    for proc in psutil.process_iter(["cmdline"]):
        first = (proc.info["cmdline"] or [""])[0].split()
        if first and (first[0] == title or first[0].startswith(title + ".")):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
                killed += 1
    return killed


@contextlib.contextmanager
def tiny_server(name: str):
    """(base URL, greedy text oracle, a kill of this cluster's actors by class) of serve.yaml's application on a
    tiny random pair."""
    tests_on_path()
    from localserve import kill_actors, serve_tiny
    from tiny import hf_greedy, tiny_model

    from treegraft_dist.models.hf import CausalLM

    target = tiny_model("llama", init=0.4, seed=3)
    lm, seen = CausalLM(target), {}
    with tempfile.TemporaryDirectory() as root, serve_tiny(Path(root), target, name, max_requests=4,
                                                           max_queued=48, max_tokens=8) as (base, tok, _, temp):
        def greedy(prompt: str, n: int) -> str:
            if (prompt, n) not in seen:
                seen[prompt, n] = tok.decode(hf_greedy(lm, tok(prompt)["input_ids"], n), skip_special_tokens=True)
            return seen[prompt, n]

        yield base, greedy, lambda title: kill_actors(title, temp)


def server_oracle(base: str, model: str, headers: dict):
    seen = {}

    def greedy(prompt: str, n: int) -> str:
        if (prompt, n) not in seen:
            resp = httpx.post(base + "/v1/completions", headers=headers, timeout=600, json={
                "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "method": "ar"})
            resp.raise_for_status()
            seen[prompt, n] = resp.json()["choices"][0]["text"]
        return seen[prompt, n]

    return greedy


def wait_ready(base: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=10).status_code == 200:
                return True
        time.sleep(1)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default="tiny-soak")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="requests a round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", default="4,16", help="lengths drawn from this range")
    ap.add_argument("--no-kills", action="store_true", help="no actor is killed")
    ap.add_argument("--out", default=None, help="a Parquet file for the rows")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = [f"soak {i}: {'ab' * (i % 5)} {'x' * (i % 3)}" for i in range(24)]
    with contextlib.ExitStack() as stack:
        if args.url:
            base = args.url.rstrip("/")
            greedy, killer = server_oracle(base, args.model, headers), kill
        else:
            base, greedy, killer = stack.enter_context(tiny_server(args.model))
        rows = []
        for r in range(args.rounds):
            title = None if args.no_kills or r == 0 else KILLS[(r - 1) % len(KILLS)]
            faults = () if title is None else (Fault(args.requests // 4, title, lambda t=title: killer(t)),)
            start = time.perf_counter()
            report = asyncio.run(soak(base, args.model, prompts, greedy, requests=args.requests,
                                      concurrency=args.concurrency, max_tokens=(lo, hi), faults=faults,
                                      headers=headers, seed=r, timeout_s=300))
            wall = time.perf_counter() - start
            wait_ready(base, 600)
            after = settle(base, 120, headers)
            rows.append({"round": r, "killed": title or "-", **report.row(), "running_after": after.get("running"),
                         "waiting_after": after.get("waiting"), "rebuilds": after.get("rebuilds"),
                         "wall_s": round(wall, 1)})
            for p in report.problems[:5]:
                print(f"  lost: {p}", file=sys.stderr)
            print(_table(rows[-1:], header=r == 0), flush=True)
    if args.out:
        import pyarrow as pa

        from treegraft_dist.files import write_parquet

        write_parquet(args.out, pa.Table.from_pylist([{**r, "statuses": str(r["statuses"])} for r in rows]))
    total_lost = sum(r["lost"] for r in rows)
    print(f"\n{sum(r['served'] for r in rows)} served, {sum(r['failed'] for r in rows)} failed by a fault, "
          f"{sum(r['disconnected'] for r in rows)} disconnected, {total_lost} lost")
    return 1 if total_lost else 0


def _table(rows: list[dict], header: bool) -> str:
    keys = ["round", "killed", "served", "failed", "disconnected", "lost", "running_after", "waiting_after",
            "rebuilds", "wall_s"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] if header else []
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


if __name__ == "__main__":
    raise SystemExit(main())
