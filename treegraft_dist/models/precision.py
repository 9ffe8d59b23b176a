"""`--dtype auto`: the fastest floating-point precision the device runs natively, chosen by measurement.

On a GPU that is bfloat16 where the device supports it (float16 otherwise). On a CPU it depends on the
processor: with native bf16 (avx512_bf16 or AMX) a multi-token bf16 pass is about twice as fast as fp32
(a draft tree is such a pass, BENCHMARKS.md has the figures), without it bf16 is emulated and slower.
Where the flags name native bf16 that decides it. Where they do not (another architecture, a virtual
machine that hides them) a short probe measures: the same matrix products as one decoding step (1 row)
and as a small tree (16 rows) in both precisions, bf16 chosen only when it wins both, each timing the
best of several repeats so a busy machine does not flip it. It takes well under a second and runs once
per process; `describe()` says which way it was decided and what was measured, for the logs. The
flags come first because a probe on a loaded machine is noisy, and two processes of one run (the
driver and a Ray worker) must not choose differently.

Output in bf16 is not bit-identical to fp32; the evaluation's lossless check (lossless.py) tells a
numerical near-tie from a real mismatch.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_PROBE_DIM = 2048  # a hidden size of the models this runs (1.5B: 1536, 3B: 2048)
_PROBE_ROWS = (1, 16)  # one decoding step, a small draft tree
_PROBE_REPEATS = 7


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The processor's feature flags (empty where /proc/cpuinfo does not exist)."""
    return set(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The processor's model name, e.g. "Intel(R) Xeon(R) Platinum 8488C" (the machine type elsewhere)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def physical_cores() -> int:
    """The intra-op threads torch starts with in a plain process here (no $OMP_NUM_THREADS): the physical
    cores among the processors this process may run on (hyperthreads of one core count once)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(tuple((topology / name).read_text().strip() for name in ("physical_package_id", "core_id")))
        except OSError:  # no sysfs topology: every processor counts
            cores.add(("", str(cpu)))
    return max(1, len(cores))


def _matmul_fn(rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 * _PROBE_DIM, _PROBE_DIM, generator=g).to(dtype)  # [out, in], as nn.Linear stores it
    x = torch.randn(rows, _PROBE_DIM, generator=g).to(dtype)

    def run():
        for _ in range(4):
            torch.nn.functional.linear(x, w)
    return run


def best_ms(fns: dict, repeats: int) -> dict:
    """The best time (ms) of each function over `repeats` rounds, the functions interleaved within a round:
    another process's burst only ever slows a call down, and it slows the candidates alike."""
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for fn in fns.values():  # warm-up
            fn()
        for _ in range(repeats):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                best[k] = min(best[k], (time.perf_counter() - t) * 1e3)
    return best


def probe() -> tuple[bool, str]:
    """(bf16 faster at every probed size, what was measured)."""
    ms = best_ms({(r, d): _matmul_fn(r, d) for r in _PROBE_ROWS for d in (torch.float32, torch.bfloat16)},
                 _PROBE_REPEATS)
    ms = {k: v / 4 for k, v in ms.items()}
    wins = all(ms[r, torch.bfloat16] < ms[r, torch.float32] for r in _PROBE_ROWS)
    text = ", ".join(f"{r} x {_PROBE_DIM}: fp32 {ms[r, torch.float32]:.2f} ms, bf16 {ms[r, torch.bfloat16]:.2f} ms"
                     for r in _PROBE_ROWS)
    return wins, f"probe {text} ({'bf16 faster' if wins else 'bf16 not faster at every size'})"


@functools.cache
def cpu_choice() -> Choice:
    native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags()]
    if native:
        return Choice(torch.bfloat16, f"native bf16: {' '.join(native)}")
    wins, measured = probe()
    return Choice(torch.bfloat16 if wins else torch.float32, f"no native bf16 flag; {measured}")


def auto_choice(device: torch.device) -> Choice:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice(torch.bfloat16, "GPU with bf16 support")
        return Choice(torch.float16, "GPU without bf16 support")
    if device.type == "cpu":
        return cpu_choice()
    return Choice(torch.float32, f"no bf16 probe for device type {device.type!r}")


def auto_dtype(device: torch.device) -> torch.dtype:
    return auto_choice(device).dtype


def describe(device: torch.device) -> str:
    c = auto_choice(device)
    return f"--dtype auto on {device}: {str(c.dtype).removeprefix('torch.')} ({c.reason})"
