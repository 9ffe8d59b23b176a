"""An evaluation's results read back: per (benchmark, method) speedups over `ar`, accepted tokens, middle
calls and verdicts, their means, the summary table (Markdown and CSV) and the speedup chart (PNG).

The speedup of a method on a benchmark is its tokens per second (total new tokens / total wall time over the
same prompts, prefill included) over `ar`'s (see evaluate.py for why tokens per second, not wall time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..decoding.engine import AR_METHOD
from ..files import replacing, write_csv, write_text
from ..scheduling.collect import HELD_OUT_BENCHMARKS
from .benchmarks import BENCHMARKS
from .lossless import EXACT, MISMATCH, NEAR_TIE
from .methods import is_ours


@dataclass
class Summary:
    """Per (benchmark, method) and per method over all benchmarks."""

    rows: list[dict]
    methods: list[str]
    benchmarks: list[str]
    mismatches: list = field(default_factory=list)
    # What the run left out (a method on fewer prompts, a stop) and outputs that went their own way after a near-tie.
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        split = [g for g in ("(held-in)", "(held-out)") if any(r["benchmark"] == g for r in self.rows)]
        head = ("| method | " + " | ".join(self.benchmarks) + " | mean speedup | "
                + "".join(f"{g[1:-1]} mean | " for g in split)
                + "accepted/round | tok/s | mid calls/round | exact/near-tie/mismatch |")
        sep = "|" + "---|" * (len(self.benchmarks) + 6 + len(split))
        lines = [head, sep]
        for m in self.methods:
            per = {r["benchmark"]: r for r in self.rows if r["method"] == m}
            mean = per["(mean)"]
            cells = [f"{per[b]['speedup']:.2f}x" if b in per else "-" for b in self.benchmarks]
            cells += [f"{mean['speedup']:.2f}x"] + [f"{per[g]['speedup']:.2f}x" for g in split]
            acc = "-" if mean["mean_accepted"] != mean["mean_accepted"] else f"{mean['mean_accepted']:.2f}"
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {acc} | "
                         f"{mean['tokens_per_s']:.2f} | {mean['middle_calls_per_round']:.2f} | "
                         f"{_verdict_cell(mean)} |")
        return "\n".join(lines + ([""] + [f"- {n}" for n in self.notes] if self.notes else []))

    def write(self, out: Path) -> None:
        write_text(out / "summary.md", self.table() + "\n")
        write_csv(out / "summary.csv", self.rows)
        plot_speedups(self, out / "speedup.png")


def _verdict_cell(row: dict) -> str:
    return f"{row['exact']}/{row['near_tie']}/{row['mismatch']}"


def row_verdict(row: dict) -> str:
    """A result row's verdict; rows written before verdicts existed have only `lossless`."""
    return row.get("verdict") or (EXACT if row["lossless"] else MISMATCH)


def summarize(t: pa.Table, methods: list[str]) -> Summary:
    """Per (benchmark, method): speedup = the method's tokens/s over ar's (see the module docstring)."""
    rows = []
    benches = sorted(set(t.column("benchmark").to_pylist()), key=lambda b: list(BENCHMARKS).index(b)
                     if b in BENCHMARKS else len(BENCHMARKS))
    ar_rows = {_prompt_key(r): r for r in t.filter(pc.field("method") == AR_METHOD).to_pylist()}
    ar_count = len(ar_rows)
    notes = []
    for m in methods:
        per_bench = []
        mine = [r for r in t.filter(pc.field("method") == m).to_pylist() if _prompt_key(r) in ar_rows]
        if not mine:
            notes.append(f"{m} has no row on a prompt ar ran: left out")
            continue
        if len(mine) < ar_count:
            notes.append(f"{m} ran on {len(mine)} of the {ar_count} prompts: its speedups are over those prompts")
        apart = [f"{r['benchmark']}/{r['prompt_id']}" + (f" from token {r['diverge_at']}"
                                                         if r.get("diverge_at") is not None else "")
                 for r in mine if row_verdict(r) == NEAR_TIE]
        if apart:  # a rounding flip at a near-tie: the rest of that output is other text, decoded at its own speed
            notes.append(f"{m} decoded other text than ar after a near-tie on {', '.join(apart)}: its speed there "
                         "is on that text")
        for b in benches:
            sub = [r for r in mine if r["benchmark"] == b]
            if not sub:
                continue
            ar = [ar_rows[_prompt_key(r)] for r in sub]  # ar on the same prompts
            ar_rate = sum(r["new_tokens"] for r in ar) / sum(r["wall_s"] for r in ar)
            wall = sum(r["wall_s"] for r in sub)
            tokens = sum(r["new_tokens"] for r in sub)
            rounds = sum(r["rounds"] for r in sub)
            accepted = sum(r["mean_accepted"] * r["rounds"] for r in sub if r["rounds"])
            verdicts = [row_verdict(r) for r in sub]
            row = {"method": m, "benchmark": b, "prompts": len(sub), "speedup": tokens / wall / ar_rate,
                   "mean_accepted": accepted / rounds if rounds else float("nan"),
                   "tokens_per_s": tokens / wall, "middle_calls_per_round":
                       sum(r["middle_calls"] for r in sub) / rounds if rounds else 0.0,
                   "exact": verdicts.count(EXACT), "near_tie": verdicts.count(NEAR_TIE),
                   "mismatch": verdicts.count(MISMATCH)}
            per_bench.append(row)
            rows.append(row)
        rows.append(_mean_row(m, "(mean)", per_bench))
        held_out = [r for r in per_bench if r["benchmark"] in HELD_OUT_BENCHMARKS]
        if held_out and len(held_out) < len(per_bench):
            # The scheduler never saw these benchmarks (nor any evaluated prompt): report them apart.
            rows.append(_mean_row(m, "(held-in)", [r for r in per_bench if r not in held_out]))
            rows.append(_mean_row(m, "(held-out)", held_out))
    ran = [m for m in methods if any(r["method"] == m for r in rows)]
    return Summary(rows, ran, benches, notes=notes)


def summarize_folder(out: Path) -> Summary:
    """The summary of an eval folder's results.parquet, rewritten to summary.md, summary.csv and the chart: for a
    run that was interrupted (its rows hold every prompt it finished) or a folder copied from elsewhere."""
    out = Path(out)
    path = out / "results.parquet"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give the --out folder of a `treegraft eval` run")
    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file ({e})") from None
    missing = {"method", "benchmark", "prompt_id", "new_tokens", "wall_s", "rounds", "mean_accepted",
               "middle_calls", "lossless"} - set(t.column_names)
    if missing or not len(t):
        raise ValueError(f"{path} is not an eval result table (missing columns: {', '.join(sorted(missing)) or '-'}, "
                         f"{len(t)} rows)")
    methods = list(dict.fromkeys(t.column("method").to_pylist()))
    if AR_METHOD not in methods:
        raise ValueError(f"{path} has no {AR_METHOD!r} rows: speedups are measured against them")
    rows = t.to_pylist()
    # Every speedup compares a method with ar on the same prompts (summarize): a row without ar's is left out.
    with_ar = {_prompt_key(r) for r in rows if r["method"] == AR_METHOD}
    rows = [r for r in rows if _prompt_key(r) in with_ar]
    summary = summarize(pa.Table.from_pylist(rows), methods)
    summary.write(out)
    mismatches = [(r["method"], r["benchmark"], r["prompt_id"]) for r in rows
                  if row_verdict(r) == MISMATCH and is_ours(r["method"])]
    return dataclasses.replace(summary, mismatches=mismatches)


def _prompt_key(row: dict) -> tuple:
    return row["benchmark"], row["prompt_id"], row.get("turn", 0)


def _mean_row(method: str, name: str, per_bench: list[dict]) -> dict:
    n = len(per_bench)
    return {"method": method, "benchmark": name, "prompts": sum(r["prompts"] for r in per_bench),
            "speedup": sum(r["speedup"] for r in per_bench) / n,
            "mean_accepted": _nanmean([r["mean_accepted"] for r in per_bench]),
            "tokens_per_s": sum(r["tokens_per_s"] for r in per_bench) / n,
            "middle_calls_per_round": sum(r["middle_calls_per_round"] for r in per_bench) / n,
            **{k: sum(r[k] for r in per_bench) for k in ("exact", "near_tie", "mismatch")}}


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def plot_speedups(summary: Summary, path: Path, title: str = "Speedup by benchmark") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = summary.benchmarks + ["(mean)"]
    methods = [m for m in summary.methods if m != AR_METHOD]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(groups)), 4.2))
    for j, m in enumerate(methods):
        vals = [next((r["speedup"] for r in summary.rows if r["method"] == m and r["benchmark"] == g), 0.0)
                for g in groups]
        ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over ar (tokens/s)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncols=min(len(methods), 4))
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
