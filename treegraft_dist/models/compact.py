"""fp32 linear layers over weights stored compactly and exactly (CPU).

A CPU decoding step reads every weight once, so it costs what the weights weigh. Many fp32 models hold
values that a smaller form represents exactly:
  bf16 / fp16   a model published in 16 bits and loaded in fp32 (most hub checkpoints);
  int8 groups   a model dequantized from a GGUF k-quant or q8 file (the embedded pair): each weight is
                fl(fl(A * q) - B) with a small integer q and an fp32 scale A and offset B per group of 16 or
                32 columns, exactly as the GGUF reader computed it. prepare.py keeps (q, A, B) beside the
                converted folder (GROUPS_FILE).
`CompactLinear` keeps such a form (a quarter to a half of the fp32 bytes) and multiplies in fp32 with a
small C++ kernel (csrc/compact_linear.cpp, AVX2/FMA, built on first use): the weights it multiplies are
the fp32 weights to the bit, so the model computes what it did in fp32, up to the order of additions.
Every output sums in one fixed order whatever the number of rows, so a tree pass, prefill and a
one-token pass give the same linear outputs bit for bit.

A form is used only where it reproduces the fp32 tensor exactly (checked when the layer is converted);
any other layer keeps the oneDNN packed or stock path (kernels.py). `choice()` decides per process:
compact where the processor has AVX2/FMA/F16C, the extension builds, and a short probe finds it faster than
the packed product at one row and at most TREE_SLACK slower at a 16-row tree. $TREEGRAFT_LINEAR=compact
forces it where it can run, =packed or =stock turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import kernels
from .kernels import LINEAR_ENV, PROBE_ROWS
from .paths import GROUPS_FILE
from .precision import best_ms, cpu_flags

DTYPE = torch.float32  # the precision compact layers compute in (and the only one they replace)
_SOURCE = Path(__file__).parent / "csrc" / "compact_linear.cpp"
_NEEDS_FLAGS = ("avx2", "fma", "f16c")
_BF16, _FP16, _GROUPS = 0, 1, 2
_EMPTY = torch.empty(0)
# A real model's weights stream from memory: the probe's fp32 matrix (52 MB, a 1.5B model's MLP projection) is
# larger than a last-level cache slice, where a smaller one (18 MB) stayed cached and hid what compact saves.
_PROBE_SHAPE = (8960, 1536)
# Best of 15: at 16 rows the two paths can be within 15% of each other, and best of 5 flipped between runs.
_PROBE_REPEATS = 15
# How much slower than the packed product the probe's 16-row product may be, where its one-row product is
# faster: a decode is mostly one-row and small-tree passes, and the probe's bf16 form (2 bytes a weight) is
# its least compact one. On a 2-vCPU AVX2 EPYC the probe's 16 rows came out 0.85-1.03x of packed from run to
# run, while the embedded target (int8 groups) verified faster compact at every size measured (1 node: 98
# against 296 ms; 12 nodes: 364 against 441 ms): with a strict test, runs there flipped to the slower path.
TREE_SLACK = 1.15
# Costs measured with one revision of the kernel do not hold for another: cost profiles name it (costs.model_key).
KERNEL_VERSION = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:8]


@dataclass(frozen=True)
class Choice:
    compact: bool
    reason: str


@functools.cache
def extension():
    """(the compiled kernel module or None, why not)."""
    missing = [f for f in _NEEDS_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"this processor lacks {', '.join(missing)}"
    try:
        module = build_kernel(_SOURCE, "treegraft_compact_linear")
    except Exception as e:  # a missing compiler, headers or ninja: the packed path still runs
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"the compact kernel did not build ({first[:160]})"
    return module, ""


def build_kernel(source: str | os.PathLike, name: str):
    """Compile (or load the cached build of) a compact kernel source as the Python module `name`."""
    from torch.utils.cpp_extension import load

    try:  # the ninja build tool from PyPI: its binary is not on PATH unless the venv is activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    return load(name, [str(source)], extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


@dataclass
class CompactWeight:
    """An exact compact form of an fp32 weight [N, K]: 16-bit values, or int8 groups with scales."""

    kind: int
    n: int
    k: int
    w16: torch.Tensor = _EMPTY  # [N, K] int16 bits (bf16 or fp16)
    q: torch.Tensor = _EMPTY  # [N, K] int8
    scale: torch.Tensor = _EMPTY  # [N, K / group] fp32
    offset: torch.Tensor = _EMPTY  # [N, K / group] fp32, or empty for none
    group: int = 0

    def args(self) -> tuple:
        return self.kind, self.w16, self.q, self.scale, self.offset, self.group

    def decode(self) -> torch.Tensor:  # [N, K] fp32
        """The fp32 weight, decoded in torch (each multiply and subtract rounded, as the kernel does)."""
        if self.kind == _BF16:
            return self.w16.view(torch.bfloat16).float()
        if self.kind == _FP16:
            return self.w16.view(torch.float16).float()
        w = self.scale.repeat_interleave(self.group, dim=1) * self.q.float()
        if self.offset.numel():
            w = w - self.offset.repeat_interleave(self.group, dim=1)
        return w

    def rows(self, index: torch.Tensor) -> CompactWeight:  # index: [N'] int64 row ids
        """The form of weight[index] (a drafting head over some ids)."""
        pick = lambda t: t[index].contiguous() if t.numel() else t  # noqa: E731
        return CompactWeight(self.kind, len(index), self.k, pick(self.w16), pick(self.q), pick(self.scale),
                             pick(self.offset), self.group)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w16, self.q, self.scale, self.offset))


@dataclass(frozen=True)
class Groups:
    """int8 groups for one tensor as prepare.py stored them."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K / group] fp32
    offset: torch.Tensor  # [N, K / group] fp32 or empty
    group: int

    def form(self) -> CompactWeight:
        return CompactWeight(_GROUPS, self.q.shape[0], self.q.shape[1], q=self.q, scale=self.scale,
                             offset=self.offset, group=self.group)


def fingerprint(first_row: torch.Tensor) -> str:  # first_row: [K]
    """A key for a weight: the bytes of its first row's first 64 values (fp32)."""
    return hashlib.sha1(first_row[:64].float().contiguous().numpy().tobytes()).hexdigest()


def load_groups(folder: str | os.PathLike, only: set[str] | None = None) -> dict[str, Groups]:
    """The int8 group forms prepare.py kept beside a model folder, keyed by `fingerprint` ({} if none); `only`:
    the fingerprints wanted (each form's first row is read to tell, the rest only for those)."""
    path = Path(folder) / GROUPS_FILE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    out: dict[str, Groups] = {}
    with safe_open(path, framework="pt") as f:
        meta, keys = f.metadata() or {}, set(f.keys())
        for name, group in meta.items():
            if not name.startswith("group:"):
                continue
            base = name.removeprefix("group:")
            names = [f"{base}.q", f"{base}.scale"] + ([f"{base}.offset"] if f"{base}.offset" in keys else [])
            q, scale, *offset = (f.get_slice(n)[0:1] for n in names)  # first rows: enough for the key
            key = fingerprint(Groups(q, scale, offset[0] if offset else _EMPTY, int(group)).form().decode()[0])
            if only is not None and key not in only:
                continue
            q, scale, *offset = (f.get_tensor(n) for n in names)
            out[key] = Groups(q, scale, offset[0] if offset else _EMPTY, int(group))
    return out


def exact_form(weight: torch.Tensor, groups: dict[str, Groups] | None = None) -> CompactWeight | None:
    """The smallest form that holds the fp32 `weight` [N, K] exactly, or None."""
    if weight.dtype != DTYPE or weight.dim() != 2 or weight.shape[1] % 8:
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    if groups:
        g = groups.get(fingerprint(weight[0]))
        if g is not None and tuple(g.q.shape) == (n, k) and holds(g.form(), weight):
            return g.form()
    for kind, dtype in ((_BF16, torch.bfloat16), (_FP16, torch.float16)):
        form = CompactWeight(kind, n, k, w16=weight.to(dtype).view(torch.int16))
        if holds(form, weight):
            return form
    return None


def holds(form: CompactWeight, weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether `form` decodes to `weight` [N, K] bit for bit (compared `rows` rows at a time: a whole decoded
    copy of an output head would weigh as much as the head)."""
    return all(torch.equal(decode(form.rows(torch.arange(s, min(s + rows, form.n)))), weight[s : s + rows])
               for s in range(0, form.n, rows))


def decode(form: CompactWeight) -> torch.Tensor:  # [N, K] fp32
    """The fp32 weight a form holds, decoded as `exact_form` checked it (the kernel's decoder where it runs)."""
    ext, _ = extension()
    return ext.decode(*form.args()) if ext is not None else form.decode()


class RowTable:
    """An fp32 matrix [N, K] kept in an exact compact form, for reads of a few rows at a time: an embedding's
    lookups, the rows of an output head that drafting gathers. Each read decodes just its rows, to the fp32
    values to the bit, where the matrix itself would weigh two to four times as much."""

    def __init__(self, form: CompactWeight):
        self.form = form
        self.shape = (form.n, form.k)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., K] fp32
        ids = torch.as_tensor(ids, dtype=torch.int64)
        return decode(self.form.rows(ids.reshape(-1))).view(*ids.shape, self.form.k)

    @property
    def nbytes(self) -> int:
        return self.form.nbytes


class CompactEmbedding(nn.Module):
    """An input embedding over a `RowTable`: the rows `nn.Embedding` would return, bit for bit (no padding
    row gradient, no max_norm: a decoding model's lookups only)."""

    def __init__(self, table: RowTable):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., K] fp32
        return self.table[input_ids]

    def extra_repr(self) -> str:
        kind = ("bf16", "fp16", f"int8 groups of {self.table.form.group}")[self.table.form.kind]
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"


def probe() -> tuple[bool, str]:
    """(compact faster than the packed fp32 product at 1 row and at most TREE_SLACK slower at 16, what was
    measured)."""
    ext, _ = extension()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*_PROBE_SHAPE, generator=g).to(torch.bfloat16).float()
    form = exact_form(w)
    packed = kernels.reorder(w) if kernels.choice(DTYPE).packed else None
    dense = (lambda x: nn.functional.linear(x, w)) if packed is None else (lambda x: kernels.packed_linear(x, packed, None))
    fns = {}
    for r in PROBE_ROWS:
        x = torch.randn(r, _PROBE_SHAPE[1], generator=g)
        fns[r, "dense"] = lambda x=x: dense(x)
        fns[r, "compact"] = lambda x=x: ext.linear(x, *form.args(), None)
    ms = best_ms(fns, _PROBE_REPEATS)
    one, tree = min(PROBE_ROWS), max(PROBE_ROWS)
    wins = ms[one, "compact"] < ms[one, "dense"] and ms[tree, "compact"] <= TREE_SLACK * ms[tree, "dense"]
    text = ", ".join(f"{r} rows: fp32 {ms[r, 'dense']:.2f} ms, compact {ms[r, 'compact']:.2f} ms" for r in PROBE_ROWS)
    return wins, f"probe {text}"


@functools.cache
def choice() -> Choice:
    """Whether fp32 CPU linears with an exact compact form run compact in this process, and why."""
    mode = os.environ.get(LINEAR_ENV, "auto")
    if mode in ("packed", "stock"):
        return Choice(False, f"${LINEAR_ENV}={mode}")
    ext, why_not = extension()
    if ext is None:
        if mode == "compact":
            raise ValueError(f"${LINEAR_ENV}=compact: {why_not}; unset it to let the packed path run")
        return Choice(False, why_not)
    if mode == "compact":
        return Choice(True, f"${LINEAR_ENV}=compact")
    wins, measured = probe()
    return Choice(wins, f"{measured} ({'compact' if wins else 'compact slower'})")


class CompactLinear(nn.Module):
    """A linear layer over a `CompactWeight`, fp32 in and out. `weight` stays only where a caller reads
    rows of it (an output head: `keep_dense`)."""

    def __init__(self, form: CompactWeight, bias: torch.Tensor | None, dense: torch.Tensor | None = None):
        super().__init__()
        self.form = form
        self.in_features, self.out_features = form.k, form.n
        # bias [N]; weight (the dense copy, where kept) [N, K] fp32
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.weight = None if dense is None else nn.Parameter(dense, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] fp32 -> [..., N] fp32
        ext, _ = extension()
        return ext.linear(x, *self.form.args(), self.bias)

    def extra_repr(self) -> str:
        kind = ("bf16", "fp16", f"int8 groups of {self.form.group}")[self.form.kind]
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def compress(model: nn.Module, groups: dict[str, Groups] | None = None, keep_dense: tuple = ()) -> int:
    """Replace every fp32 CPU `nn.Linear` of `model` whose weight has an exact compact form by a
    `CompactLinear` (in place); modules in `keep_dense` keep their fp32 weight too. Returns how many."""
    count = 0
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                    continue
                form = exact_form(child.weight, groups)
                if form is None:
                    continue
                dense = child.weight.detach() if child in keep_dense else None
                setattr(parent, name, CompactLinear(form, child.bias, dense))
                count += 1
    return count


def compact_head(head: nn.Module, index: torch.Tensor) -> CompactLinear | None:
    """A drafting head over rows `index` ([V'] int64 ids) of a compact output head (None where `head` is
    not compact)."""
    if not isinstance(head, CompactLinear):
        return None
    bias = None if head.bias is None else head.bias[index]
    return CompactLinear(head.form.rows(index), bias)


def summary(model: nn.Module) -> str:
    """How many of `model`'s linear layers run compact, by form, e.g. "197 of 197 linears compact (int8 groups 197)"."""
    kinds: dict[str, int] = {}
    total = 0
    for m in model.modules():
        if isinstance(m, CompactLinear):
            name = ("bf16", "fp16", "int8 groups")[m.form.kind]
            kinds[name] = kinds.get(name, 0) + 1
        if isinstance(m, (nn.Linear, CompactLinear)) or type(m).__name__ == "Linear":
            total += 1
    forms = ", ".join(f"{k} {v}" for k, v in kinds.items())
    return f"{sum(kinds.values())} of {total} linears compact{f' ({forms})' if forms else ''}"


def describe() -> str:
    c = choice()
    return f"compact fp32 linears: {'on' if c.compact else 'off'} ({c.reason})"


if __name__ == "__main__":  # python -m treegraft_dist.models.compact: build the kernel and print the decision
    print(describe(), file=sys.stderr)
