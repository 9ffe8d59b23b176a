"""CPU linear layers through oneDNN with their weights packed once.

A draft tree is verified in one pass of a few to a few dozen rows, and on a CPU that pass is almost all
matrix products against the weights. PyTorch's stock `nn.Linear` hands a small-row product to a BLAS
that, on some processors, costs about a full one-row pass per row: measured on a 2-core AMD EPYC with
AVX2 in fp32 (BENCHMARKS.md), a 2-node tree of the 1.5B target cost 1.95x a plain step and the sizer
found no tree worth verifying. oneDNN's linear with the weight reordered once into its blocked layout
reads each weight once per pass whatever the row count up to a few dozen: there the same 2-node tree
costs about 1.2x a plain step, a 16-node tree 2.7x instead of 3.3x, and the plain step itself is faster.

`choice(dtype)` decides per process and precision: packed where this torch build has oneDNN, its packed
linear takes the dtype on this processor (bf16 needs avx512bw/vl/dq or avx_ne_convert), and a short probe
does not find it slower than the stock product at both one row and a 16-row tree (it is not expected to
be; the probe guards a processor where it would be). $TREEGRAFT_LINEAR=stock or =packed overrides.
In fp32, layers whose weights have an exact compact form run compact instead where that is faster
(compact.py); packing takes the others.

`pack(model)` swaps every `nn.Linear` of a CPU model for a `PackedLinear` and drops the dense weight,
so memory stays what it was, except the output head's, which stays dense too: it is often tied to the
input embeddings, and the logit of one given token reads a row of it. A packed model cannot move to
another device or change its weights afterwards; load it again for that.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..files import write_json
from .pages import drop_file_pages
from .paths import cache_root
from .precision import best_ms, cpu_model

LINEAR_ENV = "TREEGRAFT_LINEAR"  # auto (default) | compact | packed | stock
LINEAR_MODES = ("auto", "compact", "packed", "stock")
_PROBE_DIM = 1536
PROBE_ROWS = (1, 16)
_PROBE_REPEATS = 5


@dataclass(frozen=True)
class Choice:
    packed: bool
    reason: str


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same weight in oneDNN's blocked layout, for packed_linear (done once per layer)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, the weight as `reorder` gave it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def unsupported(dtype: torch.dtype) -> str | None:
    """Why oneDNN's packed linear cannot run `dtype` here, or None where it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:
        with torch.no_grad():
            w = torch.ones(16, 16, dtype=dtype)
            packed_linear(torch.ones(2, 16, dtype=dtype), reorder(w), None)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"oneDNN's packed linear does not run {str(dtype).removeprefix('torch.')} here ({str(e).splitlines()[0]})"
    return None


def probe(dtype: torch.dtype) -> tuple[bool, str]:
    """(packed no slower than stock at some probed size, what was measured): the products of a
    [2 * 1536, 1536] weight with 1 and 16 rows, stock and packed interleaved, each the best of repeats."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 * _PROBE_DIM, _PROBE_DIM, generator=g).to(dtype)
    with torch.no_grad():
        packed = reorder(w)
    fns = {}
    for r in PROBE_ROWS:
        x = torch.randn(r, _PROBE_DIM, generator=g).to(dtype)
        fns[r, "stock"] = lambda x=x: nn.functional.linear(x, w)
        fns[r, "packed"] = lambda x=x: packed_linear(x, packed, None)
    ms = best_ms(fns, _PROBE_REPEATS)
    wins = any(ms[r, "packed"] <= ms[r, "stock"] for r in PROBE_ROWS)
    text = ", ".join(f"{r} rows: stock {ms[r, 'stock']:.2f} ms, packed {ms[r, 'packed']:.2f} ms" for r in PROBE_ROWS)
    return wins, f"probe {text}"


@functools.cache
def choice(dtype: torch.dtype) -> Choice:
    """Whether CPU linears in `dtype` run packed in this process, and why."""
    mode = os.environ.get(LINEAR_ENV, "auto")
    if mode not in LINEAR_MODES:
        raise ValueError(f"${LINEAR_ENV}={mode!r}: use {', '.join(LINEAR_MODES[:-1])} or {LINEAR_MODES[-1]}")
    if mode == "compact":  # compact.py takes the layers it can; the others are decided as under auto
        mode = "auto"
    if mode == "stock":
        return Choice(False, f"${LINEAR_ENV}=stock")
    why_not = unsupported(dtype)
    if why_not is not None:
        if mode == "packed":
            raise ValueError(f"${LINEAR_ENV}=packed: {why_not}; unset it to let the stock linear run")
        return Choice(False, why_not)
    if mode == "packed":
        return Choice(True, f"${LINEAR_ENV}=packed")
    wins, measured = probe(dtype)
    return Choice(wins, f"{measured} ({'packed' if wins else 'stock faster at every size'})")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose product runs through oneDNN on a weight packed once (`pack`); a product of
    fewer than `pad_to` rows runs with zero rows appended up to it (`row_padding`)."""

    packed_weight: torch.Tensor  # [out, in] in oneDNN's blocked (mkldnn) layout, from `reorder`
    pad_to: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1]
        if 0 < rows < self.pad_to:
            padded = x.new_zeros(self.pad_to, x.shape[-1])
            padded[:rows] = x.reshape(rows, -1)
            out = packed_linear(padded, self.packed_weight, self.bias)[:rows]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return packed_linear(x, self.packed_weight, self.bias)


def pack(model: nn.Module, pad_to: int | None = None) -> int:
    """Pack every `nn.Linear` of a CPU `model` in place (see the module docstring); returns how many.
    `pad_to`: the row padding of its products; None = measured on these weights (`row_padding`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    packed = []
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear or module.weight.device.type != "cpu":
                continue
            module.packed_weight = reorder(module.weight.detach())
            module.__class__ = PackedLinear
            if module is not head:
                # The packed copy replaces it; where it is a view of the mapped checkpoint, its pages go now,
                # not when the last layer is packed (pages.py).
                drop_file_pages([module.weight])
                module.weight = None
            packed.append(module)
    pad_to = row_padding(packed) if pad_to is None else pad_to
    for module in packed:
        module.pad_to = pad_to
    return len(packed)


def padding_of(model: nn.Module) -> int:
    """The row padding `pack` gave `model`'s products (1: none, or nothing packed)."""
    return max((m.pad_to for m in model.modules() if isinstance(m, PackedLinear)), default=1)


# -- padded small products -------------------------------------------------------------------------------
# oneDNN picks its kernel by row count, and on some processors a product of 1-3 rows streams the weights
# more slowly than one of 4: measured on a 2-vCPU Zen 4 EPYC in bf16 over 1.1 GB of packed [8960, 1536]
# weights, 1 row 42 ms, 2 rows 45, 3 rows 39, 4 rows 36, 8 rows 42; 1 row run as 4 took 30-37 ms. A one-token
# step of the 1.5B target is almost all such products (115 ms for 1 token against 91 for a 4-node tree). So
# a model's products of fewer rows run padded to the fastest of 2, 4 or 8 rows where that is measured faster,
# on its own weights. Zero rows change nothing in the others: each output row is its own dot products.
PAD_ENV = "TREEGRAFT_PAD_ROWS"  # auto (default) | off | N: pad every product of fewer than N rows to N
PAD_CANDIDATES = (2, 4, 8)
PAD_PROBE_BYTES = 384 << 20  # more than any last-level cache seen: weights this large stream from memory
PAD_MIN_GAIN = 0.93  # padding must measure at least 7% faster than one row, beyond timing noise
_PAD_REPEATS = 3
# Where two paddings measure close, the probe can pick either from one process to the next, and every cost
# profile and fitted scheduler is keyed by the padding: the first choice on a processor, for layers of
# those shapes and dtype, is recorded here (under paths.cache_root()) and kept.
PAD_RECORD = "kernels/row-padding.json"


def row_padding(linears: list[PackedLinear]) -> int:
    """Rows a product of fewer rows is padded to on these packed layers (1: no padding). Auto measures
    the products of 1 to 8 rows over the first layers that reach PAD_PROBE_BYTES of weights (about half
    a second); a model smaller than that stays in cache, where row count hardly matters, and is not padded."""
    mode = os.environ.get(PAD_ENV, "auto")
    if mode == "off":
        return 1
    if mode != "auto":
        if not mode.isdigit() or int(mode) < 1:
            raise ValueError(f"${PAD_ENV}={mode!r}: use auto, off or a row count such as 4")
        return int(mode)
    stack, size = [], 0
    for m in linears:
        stack.append(m)
        size += m.packed_weight.numel() * m.packed_weight.element_size()
        if size >= PAD_PROBE_BYTES:
            break
    if size < PAD_PROBE_BYTES:
        return 1
    path = cache_root() / PAD_RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    key = _padding_key(stack)
    if key not in record:
        ms = _sweep_ms(stack, range(1, max(PAD_CANDIDATES) + 1))
        best = min(PAD_CANDIDATES, key=ms.__getitem__)
        record[key] = best if ms[best] < PAD_MIN_GAIN * ms[1] else 1
        write_json(path, record)
    return record[key]


def _padding_key(stack: list[PackedLinear]) -> str:
    """The processor, threads, dtype and probed layer shapes a padding choice was measured for."""
    shapes = "-".join(dict.fromkeys(f"{m.out_features}x{m.in_features}" for m in stack))
    dtype = str(stack[0].packed_weight.dtype).removeprefix("torch.")
    return f"{_machine_key()}-{dtype}-{len(stack)}layers-{shapes}"


def _machine_key() -> str:
    """The processor, its cores and this process's threads, as a recorded choice's key starts."""
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model()).strip("-")
    return f"{cpu}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def _sweep_ms(stack: list[PackedLinear], rows) -> dict[int, float]:
    """Best ms of one product per layer of `stack`, for each row count."""
    dtype = stack[0].packed_weight.dtype
    dims = {m.in_features for m in stack}
    xs = {n: {d: torch.zeros(n, d, dtype=dtype).normal_() for d in dims} for n in rows}

    def sweep(n):
        for m in stack:
            packed_linear(xs[n][m.in_features], m.packed_weight, m.bias)
    return best_ms({n: functools.partial(sweep, n) for n in rows}, _PAD_REPEATS)


def describe(dtype: torch.dtype, model: nn.Module | None = None) -> str:
    c = choice(dtype)
    pad = padding_of(model) if model is not None else 1
    padded = f"; products of fewer than {pad} rows run padded to {pad} (measured faster)" if pad > 1 else ""
    return (f"CPU linear layers in {str(dtype).removeprefix('torch.')}: {'packed (oneDNN)' if c.packed else 'stock'} "
            f"({c.reason}){padded}")


# -- int8 linear layers for a drafter -------------------------------------------------------------------
# A drafter's numbers decide only what it proposes (verification is exact), so its linear layers may run in
# int8: weights quantized once per output channel, activations per call. On a CPU a one-token pass of the
# 0.5B middle drafter reads a quarter of the bytes, and the product runs on the quantized engine.
INT8_ENV = "TREEGRAFT_DRAFT_INT8"  # auto (default) | on | off
# The probe's margin can be small (1 row: bf16 0.11 ms, int8 0.09 on a Zen 4 EPYC), and on a box whose speed moves
# it picked bf16 in one process and int8 in the next, which changes the middle drafter's speed (a one-token pass
# 47 against 35 ms there), what it proposes, and the key of every profile and fitted scheduler. As with row
# padding, the first choice on a processor, threads and dtype is recorded (under paths.cache_root()) and kept.
INT8_RECORD = "kernels/int8.json"


def int8_unsupported(dtype: torch.dtype) -> str | None:
    """Why int8 linears cannot replace this CPU model's linears, or None where they can."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"int8 drafting runs on fp32, bf16 or fp16 models, not {str(dtype).removeprefix('torch.')}"
    engines = torch.backends.quantized.supported_engines
    if not {"x86", "fbgemm"} & set(engines):
        return f"this torch build has no x86 quantized engine (engines: {', '.join(engines)})"
    return None


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    out_features, in_features = weight.shape
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    with warnings.catch_warnings():  # quantized tensors are deprecated upstream; this torch (<2.15) has them
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scale.double(), torch.zeros(out_features, dtype=torch.int64), 0,
                                       torch.qint8)
        layer = DynamicLinear(in_features, out_features, dtype=torch.qint8)
        layer.set_weight_bias(q, bias)
    return layer


class Int8Linear(nn.Module):
    """An int8 linear layer (`_int8_linear`) in a model of another precision: the quantized engine takes
    and gives fp32, so activations are cast on the way in and out."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], both in self.dtype
        return self.inner(x.float()).to(self.dtype)


def _int8_layer(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The int8 layer for an fp32 `weight` in a model of `dtype` (wrapped outside fp32)."""
    layer = _int8_linear(weight, bias)
    return layer if dtype == torch.float32 else Int8Linear(layer, dtype)


def int8_probe(dtype: torch.dtype = torch.float32, repeats: int = _PROBE_REPEATS) -> tuple[bool, str]:
    """(int8 faster than the `dtype` product this process runs at both 1 and 16 rows, what was measured)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 * _PROBE_DIM, _PROBE_DIM, generator=g)
    name = str(dtype).removeprefix("torch.")
    with torch.no_grad():
        dense = w.to(dtype)
        if choice(dtype).packed:
            packed = reorder(dense)
            base = lambda x: packed_linear(x, packed, None)  # noqa: E731
        else:
            base = lambda x: nn.functional.linear(x, dense)  # noqa: E731
        q = _int8_layer(w, None, dtype)
    fns = {}
    for r in PROBE_ROWS:
        x = torch.randn(r, _PROBE_DIM, generator=g).to(dtype)
        fns[r, name] = lambda x=x: base(x)
        fns[r, "int8"] = lambda x=x: q(x)
    ms = best_ms(fns, repeats)
    wins = all(ms[r, "int8"] < ms[r, name] for r in PROBE_ROWS)
    text = ", ".join(f"{r} rows: {name} {ms[r, name]:.2f} ms, int8 {ms[r, 'int8']:.2f} ms" for r in PROBE_ROWS)
    return wins, f"probe {text}"


@dataclass(frozen=True)
class Int8Choice:
    int8: bool
    reason: str


@functools.cache
def int8_choice(dtype: torch.dtype) -> Int8Choice:
    """Whether a CPU drafter's linears in `dtype` run in int8 in this process, and why."""
    mode = os.environ.get(INT8_ENV, "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"${INT8_ENV}={mode!r}: use auto, on or off")
    if mode == "off":
        return Int8Choice(False, f"${INT8_ENV}=off")
    why_not = int8_unsupported(dtype)
    if why_not is not None:
        if mode == "on":
            raise ValueError(f"${INT8_ENV}=on: {why_not}; unset it")
        return Int8Choice(False, why_not)
    if mode == "on":
        return Int8Choice(True, f"${INT8_ENV}=on")
    path = cache_root() / INT8_RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    linear = "packed" if choice(dtype).packed else "stock"
    key = f"{_machine_key()}-{str(dtype).removeprefix('torch.')}-{linear}"
    if key not in record:
        wins, measured = int8_probe(dtype, repeats=3 * _PROBE_REPEATS)  # once a machine: a longer look
        record[key] = {"int8": wins, "measured": measured}
        write_json(path, record)
    wins, measured = record[key]["int8"], record[key]["measured"]
    return Int8Choice(wins, f"{measured} ({'int8' if wins else 'int8 not faster at every size'}; recorded in {path})")


def quantize_int8(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU fp32, bf16 or fp16 `model` by an int8 one (weights per output
    channel, dynamic activations; `Int8Linear` outside fp32); returns how many. The weights are final afterwards."""
    count = 0
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                bias = None if child.bias is None else child.bias.detach().float()
                setattr(parent, name, _int8_layer(child.weight.detach().float(), bias, child.weight.dtype))
                # The int8 copy replaces it: where it is a view of the mapped checkpoint, its pages go now, not
                # when the last layer is done (1.3 GB at once for the embedded middle drafter in fp32).
                drop_file_pages([child.weight])
                count += 1
    return count
