"""CPU linear layers side by side on the embedded target: PyTorch's stock `nn.Linear`, oneDNN on packed
weights (treegraft_dist/models/kernels.py) and the compact exact fp32 kernel (treegraft_dist/models/compact.py).

The target is loaded once per variant (`--variants`, default packed and compact; the first is the
reference) and all are measured in turn in one process. `compact@REV` runs compact weights through the
kernel source of git revision REV (built under its own name), to compare kernel revisions side by side:
  1. verification ms by tree size (a chain of n nodes on a 256-token cache; best of repeats, interleaved);
  2. whole requests on benchmark prompts: our `ar`, `all-small` at fixed budgets and transformers' own
     greedy `generate`, each on every variant, the order alternating per repeat; tokens/s and whether the
     ids equal the reference variant's `ar`.

    python -m jobs.bench.kernels                        # auto dtype, 48 new tokens, 2 repeats
    python -m jobs.bench.kernels --dtype float32 --variants stock,packed,compact --budgets 8,16
    python -m jobs.bench.kernels --dtype float32 --variants compact@HEAD~1,compact   # kernel before/after
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import forward_ms
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
from treegraft_dist.models import compact, kernels
from treegraft_dist.models.loading import load_model, pick_dtype
from treegraft_dist.models.precision import cpu_model
from treegraft_dist.models.prepare import DEFAULT_TARGET, prepare_model

SIZES = (1, 2, 4, 8, 16, 32, 64)


def generate(lm, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--benchmarks", default="humaneval,gsm8k,sum")
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="packed,compact", help="of stock, packed, compact; the first is the reference")
    args = ap.parse_args()
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    names = [v for v in args.variants.split(",") if v]
    if not names or {v.partition("@")[0] for v in names} - {"stock", "packed", "compact"}:
        raise SystemExit(f"--variants {args.variants!r}: name some of stock, packed, compact, compact@REV")
    if "packed" in names and kernels.unsupported(dtype):
        raise SystemExit(f"no packed variant: {kernels.unsupported(dtype)}")
    if any(v.startswith("compact") for v in names) and (dtype != torch.float32 or compact.extension()[0] is None):
        raise SystemExit(f"no compact variant: {'fp32 only' if dtype != torch.float32 else compact.extension()[1]}")
    folder = str(prepare_model(DEFAULT_TARGET))
    groups = compact.load_groups(folder) if any(v.startswith("compact") for v in names) else {}
    kernel_modules = {v: revision_kernel(v.partition("@")[2]) for v in names if v.startswith("compact@")}

    @contextlib.contextmanager
    def kernel_of(variant: str):
        """compact@REV's layers call REV's kernel while the variant runs."""
        if variant not in kernel_modules:
            yield
            return
        current = compact.extension
        compact.extension = lambda: (kernel_modules[variant], "")
        try:
            yield
        finally:
            compact.extension = current

    def load(variant: str):
        loaded = load_model(folder, "cpu", args.dtype, pack=False)
        lm = loaded.lm
        if variant == "packed":
            kernels.pack(lm.model)
            lm.packed = True
        elif variant.startswith("compact"):
            lm.compact = compact.compress(lm.model, groups, keep_dense=(lm.head,)) > 0
            lm.head = lm.model.get_output_embeddings()
        return loaded

    loaded = {v: load(v) for v in names}
    tokenizer = loaded[names[0]].tokenizer
    lms = {v: x.lm for v, x in loaded.items()}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}")

    # 1. verification cost by tree size
    caches = {}
    for k, lm in lms.items():
        caches[k] = lm.new_cache()
        with kernel_of(k):
            lm.hidden(caches[k], torch.zeros(256, dtype=torch.int64), torch.arange(256))
    ms: dict[tuple[str, int], float] = {}
    for rep in range(3):
        for k in (lms if rep % 2 == 0 else list(lms)[::-1]):
            for n in SIZES:
                with kernel_of(k):
                    ms[k, n] = min(ms.get((k, n), float("inf")), forward_ms(lms[k], n, repeats=2, cache=caches[k]))
    print("\n| tree size | " + " | ".join(map(str, SIZES)) + " |\n" + "|---" * (len(SIZES) + 1) + "|")
    for k in lms:
        print(f"| {k} ms | " + " | ".join(f"{ms[k, n]:.0f}" for n in SIZES) + " |")
    for k in lms:
        print(f"| {k} / its 1 node | " + " | ".join(f"{ms[k, n] / ms[k, 1]:.2f}" for n in SIZES) + " |")
    for k in names[1:]:
        print(f"| {names[0]} / {k} | " + " | ".join(f"{ms[names[0], n] / ms[k, n]:.2f}x" for n in SIZES) + " |")
    sys.stdout.flush()

    # 2. whole requests
    budgets = [int(b) for b in args.budgets.split(",") if b]
    methods = ["ar"] + [f"all-small@{b}" for b in budgets] + ["generate"]
    variants = [(k, m) for k in lms for m in methods]
    prompts = {b: chat_prompt(tokenizer, [builtin(b)[0].turns[0]], []) for b in args.benchmarks.split(",")}

    def run(kernel: str, method: str, prompt: list[int], n: int) -> tuple[list[int], float]:
        lm = lms[kernel]
        with kernel_of(kernel):
            if method == "generate":
                return generate(lm, prompt, n)
            name, _, budget = method.partition("@")
            gen = Decoder(lm, None, TreeConfig(budget=int(budget or 1))).generate(prompt, n, name)
            return gen.tokens, gen.stats.wall_s

    for k, m in variants:  # untimed warm-up
        run(k, m, next(iter(prompts.values())), 4)
    rows: dict[tuple[str, str, str], list[tuple[list[int], float]]] = {}
    for rep in range(args.repeats):
        for bench, prompt in prompts.items():
            for k, m in variants if rep % 2 == 0 else variants[::-1]:
                rows.setdefault((bench, k, m), []).append(run(k, m, prompt, args.new_tokens))
    print(f"\n{args.new_tokens} new tokens, median of {args.repeats} repeats; tok/s (same ids as {names[0]} ar?)")
    print("| benchmark | " + " | ".join(f"{k} {m}" for k, m in variants) + " | "
          + " | ".join(f"{k} ar / {names[0]} ar" for k in names[1:]) + " |")
    print("|---" * (len(variants) + len(names)) + "|")
    for bench in prompts:
        ref = rows[bench, names[0], "ar"][0][0]
        tps = {(k, m): statistics.median(len(t) / s for t, s in rows[bench, k, m]) for k, m in variants}
        same = {v: all(t == ref for t, _ in rows[(bench, *v)]) for v in variants}
        print(f"| {bench} | " + " | ".join(f"{tps[v]:.2f}{'' if same[v] else ' (ids differ)'}" for v in variants)
              + " | " + " | ".join(f"{tps[k, 'ar'] / tps[names[0], 'ar']:.2f}x" for k in names[1:]) + " |")


def revision_kernel(rev: str):
    """The compact kernel as git revision `rev` has it, built as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:treegraft_dist/csrc/compact_linear.cpp"], capture_output=True,
                            text=True, cwd=Path(__file__).parent)
    if source.returncode:
        raise SystemExit(f"compact@{rev}: {source.stderr.strip()}")
    name = "treegraft_compact_linear_" + subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True,
                                                          text=True, cwd=Path(__file__).parent).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="compact-kernel-"))
    (folder / f"{name}.cpp").write_text(source.stdout)
    return compact.build_kernel(folder / f"{name}.cpp", name)


if __name__ == "__main__":
    main()
