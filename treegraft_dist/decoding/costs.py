"""Hardware-aware tree budget: how many nodes to verify per round on this device.

A bigger tree is accepted deeper but costs more to verify; where that trade lands depends on the device
(on a GPU a 64-node pass costs about what a 1-token pass does; on a CPU it costs several times more).
`--budget auto` measures target verification latency against tree size once per (model, device),
caches it, then observes acceptance at every candidate budget during a warm-up decode at the largest
one (the accepted length of a smaller, pruned tree follows from the target's greedy continuation
without another target pass) and picks the budget with the most expected tokens per second.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..files import write_json
from ..models import compact, kernels
from ..models.hf import CausalLM, compact_cache
from ..models.precision import cpu_model
from .stats import synchronize
from .tree import ORIGIN_NGRAM, DraftTree, Proposal
from .verify import tree_attention

CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # 1 = the root only: plain decoding
PROFILE_PAST = 256  # cached tokens behind the profiled block: a typical prompt length
MAX_COST_RATIO = 4.0
# A cached one-node cost this many times a fresh pass's was measured on a busy machine (another process's
# threads only ever slow a pass down): the profile is measured again. A fresh pass much slower than the
# cache means the machine is busy now, and the cache is kept.
STALE_RATIO = 1.5
DRAFT_TOPK = 10  # children a drafting pass ranks (the published K)


def forward_ms(lm: CausalLM, block: int, past: int = PROFILE_PAST, repeats: int = 3, cache=None,
               drafting: bool = False) -> float:
    """Best time of one forward over a `block`-node tree (a chain) on a `past`-token cache; `cache`, when
    given, already holds those `past` tokens and is restored after each timed pass. `drafting`: the pass
    ends as a drafter's does (top-k over the draft vocabulary, CausalLM.top_logprobs), not with the full
    logits verification takes."""
    tree = DraftTree(0)
    n = block - 1
    if n:
        chain = np.concatenate([[0], 1 + np.arange(n - 1)]).astype(np.int64)
        tree.graft(Proposal(1, chain, np.arange(1, n + 1) % lm.vocab_size, np.zeros(n), ORIGIN_NGRAM), 1)
    attend, positions = tree_attention(tree, past)
    ids = torch.from_numpy(tree.token_list().copy())
    if cache is None:
        cache = lm.new_cache()
        lm.hidden(cache, torch.zeros(past, dtype=torch.int64), torch.arange(past))
    times = []
    for _ in range(repeats + 1):
        synchronize(lm.device)  # the cache's last compaction (or fill) is not this pass's work
        t = time.perf_counter()
        h = lm.hidden(cache, ids, positions, attend)
        lm.top_logprobs(h, DRAFT_TOPK) if drafting else lm.logits(h)
        synchronize(lm.device)
        times.append((time.perf_counter() - t) * 1e3)
        compact_cache(cache, past, torch.zeros(0, dtype=torch.int64))
    # The best repeat, not the median: another process's burst only ever slows a pass down, and a profile
    # measured on a busy machine is cached for good.
    return min(times[1:])


def measured_when_busy(lm: CausalLM, cached_ms: float, path: Path, block: int = 1, drafting: bool = False) -> bool:
    """Whether the cached cost `cached_ms` of a `block`-node pass is STALE_RATIO times what one measured now
    costs (it was measured while something else used the device); says so when it is."""
    fresh = forward_ms(lm, block, repeats=2, drafting=drafting)
    if cached_ms <= STALE_RATIO * fresh:
        return False
    print(f"treegraft: {path.name}: a {block}-token pass measured {cached_ms:.0f} ms there and {fresh:.0f} ms now: "
          "it was measured on a busy machine, measuring again", file=sys.stderr)
    return True


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    # Costs differ between processors of one architecture (AMX or not, cache sizes): the model name is part of it.
    model = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model()).strip("-")
    return f"cpu-{model}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def model_key(lm: CausalLM, source: str) -> str:
    name = Path(source.rstrip("/")).name or "model"
    # Compact, packed or int8 linears and a drafting head over fewer ids cost differently: a profile is per kernel path
    # and draft vocabulary too.
    vocab = "" if lm.draft_vocab is None else f"-v{len(lm.draft_vocab)}"
    kernel = f"-compact{compact.KERNEL_VERSION}" if lm.compact else ""  # and per revision of the compact kernel
    pad = kernels.padding_of(lm.model) if lm.packed else 1  # and per row padding of its small products
    packed = f"-packed{f'-pad{pad}' if pad > 1 else ''}" if lm.packed else ""
    return (f"{name}-{lm.num_params}-{str(lm.dtype).removeprefix('torch.')}{kernel}"
            f"{packed}{'-int8' if lm.quantized else ''}{vocab}")


def latency_profile(lm: CausalLM, source: str, cache_dir: Path) -> dict[int, float]:
    """Verification ms per candidate tree size, measured once per (model, device) and cached as JSON.

    Sizes are measured smallest first and the profile stops at the first one costing more than
    MAX_COST_RATIO single-node passes: such a tree would need that many times the acceptance to pay."""
    path = cache_dir / "profiles" / f"{model_key(lm, source)}--{device_name(lm.device)}.json"
    if path.is_file():
        cached = {int(k): v for k, v in json.loads(path.read_text())["verify_ms"].items()}
        if not measured_when_busy(lm, cached[min(cached)], path):
            return cached
    cache = lm.new_cache()
    lm.hidden(cache, torch.zeros(PROFILE_PAST, dtype=torch.int64), torch.arange(PROFILE_PAST))
    measured: dict[int, float] = {}
    for b in tqdm(CANDIDATES, desc="profiling verification latency", unit="size", file=sys.stderr):
        ms = forward_ms(lm, b, repeats=2, cache=cache)
        if measured and ms > MAX_COST_RATIO * measured[CANDIDATES[0]]:
            break
        measured[b] = ms
    # A bigger block never costs less: a pass of fewer rows than the padded count runs as that count
    # (kernels.row_padding), and any other dip is timing noise, so take the lower envelope from above.
    profile, floor = {}, float("inf")
    for b in sorted(measured, reverse=True):
        floor = min(floor, measured[b])
        profile[b] = floor
    profile = dict(sorted(profile.items()))
    write_json(path, {"model": source, "device": device_name(lm.device), "past": PROFILE_PAST,
                      "verify_ms": {str(k): v for k, v in profile.items()}})
    return profile


def choose_budget(verify_ms: dict[int, float], accepted_at: dict[int, list[int]], draft_ms: float) -> int:
    """The budget with the most expected tokens per round-second: mean accepted length at that budget
    over (drafting time per round + verification time at that budget)."""
    rate = {b: float(np.mean(accepted_at[b])) / (draft_ms + verify_ms[b]) for b in accepted_at if accepted_at[b]}
    if not rate:
        raise ValueError("no acceptance observed: run a warm-up decode with budget probes first")
    return max(rate, key=lambda b: (rate[b], -b))
