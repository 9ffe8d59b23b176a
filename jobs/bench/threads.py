"""A drafter's forward in a plain actor against the same in an actor with a concurrency group, side by side.

  .venv/bin/python -m jobs.bench.threads [--pair embedded|tiny] [--calls 14] [--nodes 16] [--dtype auto]
        [--threads N]

Ray runs the methods of an actor that declares concurrency groups on a pool thread, those of a plain actor on
the worker's main thread. Two actors load the middle drafter on the same kernels (this process's probes pick
them, as `jobs.bench.serve --linear same` does), one of each kind, the grouped one with a call parked in its
second group as `DrafterHost` once kept one; they take turns, in alternating order, timing a forward over
`--nodes` tree nodes inside the actor (costs.forward_ms, the figure the scheduler's cost profile reads).
Prints the median and best milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading

import ray
import torch

from actors.resources import for_device
from jobs.bench.common import pair_paths, pin_kernels, start_ray
from treegraft_dist.models.loading import DTYPES, load_model, pick_dtype


class Forwards:
    """Holds the middle drafter and times its forwards."""

    def __init__(self, path: str, dtype: str, threads: int):
        torch.set_num_threads(threads)
        self.lm = load_model(path, "cpu", dtype, drafter=True).lm
        self._never = threading.Event()

    def ready(self) -> bool:
        return True

    def forward_ms(self, nodes: int) -> float:
        from treegraft_dist.decoding.costs import forward_ms

        return forward_ms(self.lm, nodes, drafting=True)

    def park(self) -> None:
        self._never.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("tiny", "embedded"), default="embedded")
    ap.add_argument("--calls", type=int, default=14)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both actors (default: for_device's)")
    args = ap.parse_args()
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    print(f"dtype {dtype}; both actors: {pin_kernels(dtype)}", flush=True)
    start_ray(num_cpus=os.cpu_count())
    threads = args.threads or for_device("cpu", 1).torch_threads
    name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as d:
        _, m_path, _ = pair_paths(args.pair, d)
        plain = ray.remote(num_cpus=0.1)(Forwards).remote(m_path, name, threads)
        Grouped = ray.remote(concurrency_groups={"parked": 1})(Forwards)
        grouped = Grouped.options(num_cpus=0.1).remote(m_path, name, threads)
        ray.get([plain.ready.remote(), grouped.ready.remote()])
        parked = grouped.park.options(concurrency_group="parked").remote()  # held until the end, as the watch was
        sides = {"plain actor (main thread)": plain, "with a concurrency group (pool thread)": grouped}
        ms: dict[str, list[float]] = {k: [] for k in sides}
        for i in range(args.calls):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for k in order:
                ms[k].append(ray.get(sides[k].forward_ms.remote(args.nodes)))
        ray.kill(grouped)  # the parked call never returns
        del parked
    print(f"\n{args.pair} middle drafter, {args.nodes}-node forwards, {threads} torch threads, "
          f"{args.calls} calls each\n")
    print("| actor | median ms | best ms |")
    print("|---|---:|---:|")
    for k, v in ms.items():
        print(f"| {k} | {statistics.median(v):.1f} | {min(v):.1f} |")
    a, b = (statistics.median(v) for v in ms.values())
    print(f"\npool thread / main thread: {b / a:.2f}x (median)")
    ray.shutdown()


if __name__ == "__main__":
    main()
