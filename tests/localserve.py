"""A real `serve run` of the repository's serve.yaml, its args pointed at a tiny pair, on a local cluster
(`ray start --head`): for the server's end-to-end tests."""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import httpx
import yaml
from localcluster import BIN, free_port, head_node
from tiny import char_tokenizer, perturbed_copy, save_tiny

REPO = Path(__file__).resolve().parents[1]


class Served(NamedTuple):
    base: str  # the server's URL
    tok: object  # the tokenizer of the tiny pair
    log: Path  # what `serve run` printed, the replica's log lines included
    temp: str  # the Ray cluster's folder (kill_actors takes it)
    ray_metrics: str  # the URL of Ray's Prometheus endpoint on the cluster's node


@contextmanager
def serve_tiny(root: Path, target, name: str, env_vars: dict | None = None, **args):
    """The `Served` of serve.yaml's application on `target` and a perturbed copy as the middle drafter, on CPU
    in fp32, one replica; `args` override the application's, `env_vars` are the replicas' environment."""
    tok = char_tokenizer()
    t_dir = save_tiny(root / "target", target, tok)
    m_dir = save_tiny(root / "middle", perturbed_copy(target, 0.2, 1), tok)
    config = yaml.safe_load((REPO / "serve.yaml").read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"] = {**app["args"], "target": t_dir, "middle": m_dir, "model_name": name, "device": "cpu",
                   "dtype": "float32", **args}
    app["deployments"] = [{"name": "treegraft", "num_replicas": 1}]  # one replica: the tests count its state
    if env_vars:
        app["runtime_env"] = {"env_vars": env_vars}
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = root / "serve.log"
    with head_node(dashboard=False) as head:
        proc = subprocess.Popen([str(BIN / "serve"), "run", str(path), "--address", head.gcs], cwd=REPO, env=head.env,
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(proc, base, log, time.monotonic() + 240)
            yield Served(base, tok, log, head.temp, head.metrics)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_until_serving(proc, base: str, log: Path, deadline: float) -> None:
    """Until GET /health answers 200; fails with the server's log if it exits or the deadline passes."""
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def kill_actors(title: str, temp: str) -> int:
    """SIGKILL the worker processes of Ray actors of class `title` (titled ray::Class, or ray::Class.method
    while they run a call) in the cluster of folder `temp` only; how many."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if any(temp in a for a in p.info["cmdline"] or ())]
    killed = set()
    for root in roots:
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for proc in children:
            try:
                first = (proc.cmdline() or [""])[0].split()
                if proc.pid not in killed and first and (first[0] == title or first[0].startswith(title + ".")):
                    proc.kill()
                    killed.add(proc.pid)
            except psutil.NoSuchProcess:  # it ended between the listing and the kill
                continue
    return len(killed)
