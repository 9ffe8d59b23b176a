import os

import torch

from treegraft_dist.models import precision
from treegraft_dist.models.loading import ModelError, pick_dtype


def test_auto_on_cpu_follows_the_flags_or_the_probe():
    choice = precision.auto_choice(torch.device("cpu"))
    assert pick_dtype("auto", torch.device("cpu")) == choice.dtype
    native = [f for f in precision.NATIVE_BF16_FLAGS if f in precision.cpu_flags()]
    if native:
        assert choice.dtype == torch.bfloat16 and native[0] in choice.reason
    else:
        assert "probe" in choice.reason
    assert precision.describe(torch.device("cpu")).startswith("--dtype auto on cpu: ")


def test_probe_follows_the_timings(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2"})
    precision.cpu_choice.cache_clear()
    fast = {torch.float32: 2.0, torch.bfloat16: 1.0}
    # best_ms times 4 products per call: a probe's ms are per product.
    monkeypatch.setattr(precision, "best_ms", lambda fns, repeats: {(r, d): 4 * fast[d] for r, d in fns})
    choice = precision.cpu_choice()
    assert choice.dtype == torch.bfloat16 and "fp32 2.00 ms, bf16 1.00 ms" in choice.reason
    precision.cpu_choice.cache_clear()
    # bf16 slower for one decoding step (emulated bf16): fp32 stays.
    monkeypatch.setattr(precision, "best_ms", lambda fns, repeats: {
        (r, d): 12.0 if d == torch.bfloat16 and r == 1 else 4.0 for r, d in fns})
    assert precision.cpu_choice().dtype == torch.float32
    # Native flags decide without a probe.
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "amx_bf16"})
    precision.cpu_choice.cache_clear()
    assert precision.cpu_choice().dtype == torch.bfloat16
    precision.cpu_choice.cache_clear()


def test_the_real_probe_measures_both_precisions():
    wins, text = precision.probe()
    assert isinstance(wins, bool) and text.count("fp32") == 2 and text.count("bf16") >= 2


def test_explicit_dtypes_and_bad_names():
    assert pick_dtype("float32", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    try:
        pick_dtype("fp8", torch.device("cpu"))
    except ModelError as e:
        assert "unknown dtype" in str(e) and "bfloat16" in str(e)
    else:
        raise AssertionError("fp8 accepted")


def test_cpu_flags_reads_proc_cpuinfo():
    flags = precision.cpu_flags()
    assert isinstance(flags, set)
    if os.path.exists("/proc/cpuinfo") and os.uname().machine == "x86_64":
        assert "sse2" in flags  # every x86-64 processor has it
