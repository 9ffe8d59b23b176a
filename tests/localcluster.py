"""A real local Ray cluster in a temporary folder (`ray start --head`), for tests that drive Ray's own command
line tools (`ray job submit`, `serve run`) against it, and its clean stop."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import psutil

BIN = Path(sys.executable).parent  # the venv: `ray`, `serve`, and `python` for a job's entrypoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(temp: str) -> None:
    """End this cluster's processes only: those whose command line names its temporary folder, and their
    children (workers, a job's driver), by pid."""
    roots = [p for p in psutil.process_iter(["cmdline"])
             if p.pid != os.getpid() and any(temp in a for a in p.info["cmdline"] or ())]
    procs = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                procs[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=5)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=5)


class Head(NamedTuple):
    env: dict  # the environment its command line tools need
    gcs: str  # the GCS address (host:port)
    dashboard: str | None  # the dashboard's URL, if it runs one
    temp: str  # its temporary folder, which names all its processes
    metrics: str  # the URL of Ray's Prometheus endpoint on this node


@contextmanager
def head_node(dashboard: bool):
    """The `Head` of a head node on free ports."""
    temp = tempfile.mkdtemp(prefix="tg-ray-")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    # Every port named: the defaults (the dashboard agent's 52365, the client server's 10001) may be taken
    # by another Ray instance on this machine, and then the job agent never comes up.
    metrics = free_port()
    ports = [f"--metrics-export-port={metrics}", *(f"--{name}={free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "ray-client-server-port", "node-manager-port", "object-manager-port"))]
    web = ([f"--include-dashboard=true", "--dashboard-host", "127.0.0.1", f"--dashboard-port={dash}"] if dashboard
           else ["--include-dashboard=false"])
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={gcs}", *ports, "--num-cpus", "2", *web,
                        "--temp-dir", temp, "--disable-usage-stats"], env=env, check=True, capture_output=True,
                       timeout=180)
        yield Head(env, f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}" if dashboard else None, temp,
                   f"http://127.0.0.1:{metrics}/metrics")
    finally:
        stop(temp)
        shutil.rmtree(temp, ignore_errors=True)
