"""Resident memory of a mapped checkpoint, given back tensor by tensor.

transformers maps a safetensors checkpoint and, where the file's dtype is the model's, keeps its weights as
views of the mapping. Every page of it that was read stays resident, counted in the process's memory, until
the last view goes, and the whole mapping goes only then. A CPU model whose linears are replaced by packed
copies (kernels.pack) reads every weight once to pack it: without help the process holds the whole file
beside the whole packed model at the end of packing (the fp32 1.5B target: 7.1 GB of file pages and 6.2 GB
of packed weights, 14.4 GB at its peak on a Zen 4 EPYC). `drop_file_pages(t)`, called once `t` is no longer
read, unmaps its pages from this process (the page cache keeps them, and a later read would fault them back
in from the file), so packing holds one layer of the file at a time.

Only whole pages of a tensor inside a mapped `.safetensors` file are touched: memory torch allocated, any other
mapping (shared memory, a library) and a page the tensor shares with a neighbour are never given back this way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

_MADV_DONTNEED = 4  # Linux: drop these pages from the process; a file-backed page is read again on access


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _checkpoint_ranges() -> list[tuple[int, int]]:
    """[start, end) of every mapping of a .safetensors file in this process (/proc/self/maps). safetensors
    maps it private: a page nobody wrote is the file's, and one somebody wrote belongs to the tensor on it."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[1].startswith("r") and parts[5].rstrip("\n").endswith(".safetensors"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_file_pages(tensors: list[torch.Tensor]) -> int:
    """Give back the pages of each tensor in `tensors` that lie wholly inside a mapping of a .safetensors
    file; the caller promises none of them is read again. Returns the bytes given back
    (0 off Linux, for CPU tensors torch allocated, and for anything on a GPU)."""
    if sys.platform != "linux" or not tensors:
        return 0
    # Read afresh each call: a range kept from an earlier call could since hold memory torch allocated.
    ranges = _checkpoint_ranges()
    if not ranges:
        return 0
    page, dropped = mmap.PAGESIZE, 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if not any(lo <= start and end <= hi for lo, hi in ranges):
            continue
        # Whole pages only: a page the tensor shares with its neighbour in the file stays.
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo and _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0:
            dropped += hi - lo
    return dropped
