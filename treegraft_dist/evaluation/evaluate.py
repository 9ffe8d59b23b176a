"""Evaluation: methods x prompts on one model pair, every output checked against plain decoding.

Rows go to DIR/results.parquet (rewritten atomically after every prompt, so an interrupted run keeps
what it finished; prompts go round-robin over the benchmarks, so that is a balanced subset); the summary
to DIR/summary.md and DIR/summary.csv; the chart to DIR/speedup.png.

Every output gets a verdict against `ar` (`lossless.classify`): exact, near-tie (in bf16/fp16 the first
differing token is one the target nearly ties with ar's, within the rounding tolerance of the dtype, and
the rest is the target's own greedy continuation) or mismatch. Only a mismatch in one of our methods fails
the run; near-ties are noted; the peers' verdicts are only reported.

Speed is compared on equal token counts: the speedup of a method on a benchmark is its tokens per second
(total new tokens / total wall time over the same prompts, prefill included) over `ar`'s. When the token
counts are equal that is exactly the ratio of wall times; after a near-tie a method's output may be
shorter or longer than ar's (it stopped at eos elsewhere), and the ratio of wall times would credit or
charge it for tokens it did not decode. Methods run interleaved per prompt, so machine noise hits them
alike; one warm-up request per method (not timed) comes first.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from ..decoding.config import TreeConfig
from ..decoding.costs import CANDIDATES, CostModel, choose_budget, latency_profile
from ..decoding.engine import AR_METHOD, Decoder, Generation
from ..decoding.schedule import NAMED_SCHEDULES, SCHEDULES, ReplaySchedule, ShallowTreeHeuristic
from ..decoding.sizing import TreeSizer
from ..files import replacing, write_text
from ..models.loading import LoadedModel
from ..models.prepare import cache_root
from ..scheduling.collect import HELD_OUT_BENCHMARKS, Collector
from ..scheduling.device import PROFILE_KEY, resolve_scheduler
from ..scheduling.value import ValuePlanner, load_artifact
from .benchmarks import BENCHMARKS, Question, builtin, chat_prompt, load_questions
from .lossless import EXACT, MISMATCH, NEAR_TIE, Check, classify
from .peers import PEER_METHODS, run_peer

TREEGRAFT = "treegraft"
VALUE_PLANNER = "value-planner"
ORACLE = "oracle"
OUR_FIXED = tuple(NAMED_SCHEDULES)
DEFAULT_METHODS = (AR_METHOD, "all-small", "all-mid", TREEGRAFT) + PEER_METHODS
# Methods read from a scheduler artifact; value-planner and oracle are for studying the scheduler (the
# oracle enumerates all 32 schedules of every round before its timed decode), so not in the default list.
ARTIFACT_METHODS = (TREEGRAFT, VALUE_PLANNER, ORACLE)
ALL_METHODS = DEFAULT_METHODS + (VALUE_PLANNER, ORACLE)
WARMUP_PROMPTS = 2
COST_CONTEXT_BENCHMARK = "humaneval"  # its last question: the context an n-gram step is timed on
WARMUP_TOKENS = 12  # per warm-up prompt when probing budgets; the other warm-ups need only a few tokens


@dataclass
class EvalConfig:
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    benchmark_files: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompts_per_benchmark: int = 2
    max_new_tokens: int = 64
    out: Path = Path("out/eval")
    multi_turn: bool = False
    budget: int | str | dict = 64  # or "auto", or {method: budget} (the methods not named: auto)
    cache_dir: Path | None = None
    scheduler: Path | None = None  # artifact for treegraft / value-planner / oracle (default: the packaged one)
    pair: tuple[str, str] | None = None  # (target, middle) as named on the command line: selects the artifact

    def __post_init__(self):
        if self.prompts_per_benchmark < 1:
            raise ValueError(f"--prompts-per-benchmark must be at least 1, got {self.prompts_per_benchmark}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        one_budget = self.budget == "auto" or isinstance(self.budget, int) and self.budget >= 1
        if not (one_budget or isinstance(self.budget, dict)):
            raise ValueError(f"--budget must be 'auto', an integer >= 1 or METHOD=N,..., got {self.budget!r}")
        if AR_METHOD not in self.methods:
            self.methods = [AR_METHOD] + list(self.methods)  # the reference every output is checked against
        for m in self.methods:
            if not is_method(m):
                raise ValueError(f"unknown method {m!r}: use {', '.join(ALL_METHODS)} or a 5-bit pattern such "
                                 f"as 01001 (a fixed one with {PUBLISHED}: the published tree settings; with "
                                 f"{SIZED}: trees sized per round)")
        if isinstance(self.budget, dict):
            bad = {m: b for m, b in self.budget.items() if not isinstance(b, int) or b < 1}
            if bad:
                raise ValueError(f"--budget: every budget must be an integer >= 1, got {bad}")
            stray = [m for m in self.budget if m not in self.methods or m in PEER_METHODS or m == AR_METHOD]
            if stray:
                raise ValueError(f"--budget names {', '.join(stray)}, which is not one of our tree methods in "
                                 f"--methods ({', '.join(m for m in self.methods if m not in PEER_METHODS)})")


# A fixed schedule with this suffix (all-small@published) runs with the published tree settings: no long
# n-gram chains (config.py), so one run compares the extension with the paper's settings side by side.
PUBLISHED = "@published"


# A fixed schedule or treegraft with this suffix (all-small@sized, all-small@published@sized, treegraft@sized)
# sizes every round's tree from calibrated acceptance and this device's verification costs (sizing.py) instead
# of pruning to its budget (plain treegraft: the budget its scheduler was fitted for).
SIZED = "@sized"


def artifact_base(m: str) -> str | None:
    """The artifact method (treegraft, value-planner, oracle) a name runs, with @sized for treegraft; else None."""
    if m in ARTIFACT_METHODS:
        return m
    return TREEGRAFT if m == TREEGRAFT + SIZED else None


def fixed_base(m: str) -> str | None:
    """The schedule of a fixed method (all-small, all-mid, a pattern, optionally @published, @sized), else None."""
    base = m.removesuffix(SIZED).removesuffix(PUBLISHED)
    return base if base in OUR_FIXED or re.fullmatch(r"[01]+", base) else None


def is_method(m: str) -> bool:
    return m in ALL_METHODS or fixed_base(m) is not None or artifact_base(m) is not None


def is_sized(m: str) -> bool:
    return m.endswith(SIZED) and (fixed_base(m) is not None or artifact_base(m) is not None)


def is_ours(m: str) -> bool:
    """Methods whose outputs must equal `ar` (a mismatch fails the run); peers are only reported."""
    return m not in PEER_METHODS


@dataclass
class Prompt:
    benchmark: str
    prompt_id: str
    turn: int
    ids: list[int]


def select_questions(cfg: EvalConfig) -> list[Question]:
    """The first N questions of every set, round-robin (question 1 of each set, then question 2 ...),
    so a run stopped part-way has covered every benchmark about equally."""
    sets = [builtin(name)[: cfg.prompts_per_benchmark] for name in cfg.benchmarks]
    sets += [load_questions(path)[: cfg.prompts_per_benchmark] for path in cfg.benchmark_files]
    return [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]


class Evaluation:
    """One run: decoders per method (with their budgets), the loop, the outputs."""

    def __init__(self, target: LoadedModel, middle: LoadedModel | None, cfg: EvalConfig, log=print, engine=None):
        """`engine`: a DistributedEngine (anything with Decoder.generate's signature) that runs our methods
        instead of in-process decoders; its tree settings are fixed, so the budget must be a number."""
        self.target, self.middle, self.cfg, self.log, self.engine = target, middle, cfg, log, engine
        need_middle = [m for m in cfg.methods if m not in (AR_METHOD, "hf-pld") and fixed_base(m) != "all-small"]
        if middle is None and need_middle:
            raise ValueError(f"methods {', '.join(need_middle)} need a middle drafter; drop them or give --middle")
        if engine is not None and ORACLE in cfg.methods:
            raise ValueError("oracle enumerates every schedule with the models in this process: run it without "
                             "--distributed")
        if engine is not None and (not isinstance(cfg.budget, int) or set(cfg.methods) & set(PEER_METHODS)):
            raise ValueError("a distributed evaluation needs a numeric --budget and runs our methods only: "
                             f"drop {', '.join(PEER_METHODS)} from --methods")
        self.eos = target.eos_ids
        self.budgets: dict[str, int] = {}
        self.sizers: dict[str, TreeSizer] = {}  # per sized method, learning across its requests
        self._verify_ms: dict[int, float] | None = None
        self.rows: list[dict] = []
        self.scheduler, self.heads = self._load_scheduler()

    def _load_scheduler(self):
        """(LearnedScheduler, ValueHeads or None) for the artifact methods: --scheduler's artifact (refused if
        fitted for another device profile), else the one fitted for this device from the trajectories shipped
        for the pair (device_scheduler.py); (None, None) when none is needed or, for treegraft alone, neither
        exists (then the documented heuristic runs)."""
        wanted = list(dict.fromkeys(artifact_base(m) for m in self.cfg.methods if artifact_base(m)))
        if not wanted:
            return None, None
        if self.engine is not None:
            found = self._remote_scheduler()
        else:
            context = chat_prompt(self.target.tokenizer, [builtin(COST_CONTEXT_BENCHMARK)[-1].turns[0]], [])
            found = resolve_scheduler(self.cfg.scheduler, self.cfg.pair, self.target.lm, self.target.source,
                                      self.middle.lm, self.middle.source, cache_root(self.cfg.cache_dir), context,
                                      TreeConfig(), self.log)
        if found is None:
            if wanted != [TREEGRAFT]:
                raise ValueError(f"{', '.join(m for m in wanted if m != TREEGRAFT)} need a scheduler and no "
                                 f"trajectories ship for {self.cfg.pair}: collect them (`treegraft collect`), fit "
                                 "one (`treegraft fit`) and pass --scheduler PATH")
            self.log(f"no scheduler for {self.cfg.pair}: treegraft runs the shallow-tree heuristic "
                     "(fit one with `treegraft collect` and `treegraft fit`, then pass --scheduler)")
            return None, None
        scheduler, heads = found
        if VALUE_PLANNER in wanted and heads is None:
            raise ValueError("the scheduler artifact holds no value heads, which value-planner needs: refit it with "
                             "`treegraft fit`")
        profile = scheduler.info.cost_profile
        self.log(f"scheduler: fitted for {profile.get(PROFILE_KEY, '(no profile recorded)')} at budget "
                 f"{profile.get('budget')}, call cap {profile.get('call_cap')} (signals: {', '.join(scheduler.subset)})")
        return scheduler, heads

    def _remote_scheduler(self):
        """With the models in actors only --scheduler's artifact can run, and its profile is not checked here."""
        if self.cfg.scheduler is None:
            return None
        found = load_artifact(self.cfg.scheduler, expect_pair=self.cfg.pair)
        self.log(f"distributed: the artifact's cost profile ({found[0].info.cost_profile.get(PROFILE_KEY)}) is not "
                 "checked against the actors' devices")
        return found

    # -- methods --------------------------------------------------------------------------------------
    def verify_ms(self) -> dict[int, float]:
        """This device's verification ms by tree size (measured once, cached: budget.latency_profile)."""
        if self._verify_ms is None:
            self._verify_ms = latency_profile(self.target.lm, self.target.source, cache_root(self.cfg.cache_dir))
            self.log("verification latency by tree size (ms): "
                     + ", ".join(f"{b}: {ms:.0f}" for b, ms in self._verify_ms.items()))
        return self._verify_ms

    def _decoder(self, method: str, budget: int, probes: tuple[int, ...] = ()) -> Decoder:
        tree = TreeConfig(budget=budget, **({"long_chain": 0} if PUBLISHED in method else {}))
        sizer = None
        if is_sized(method):
            costs = self.verify_ms()
            sizer = self.sizers.setdefault(method, TreeSizer(costs, max_size=max(costs)))
        return Decoder(self.target.lm, self.middle.lm if self.middle else None, tree, probe_budgets=probes,
                       sizer=sizer)

    def runner(self, method: str, budget: int, probes=()) -> Callable[[list[int], int], Generation]:
        if method in PEER_METHODS:
            mid = self.middle.lm if self.middle else None
            return lambda ids, n: run_peer(method, self.target.lm, mid, ids, n, self.eos)
        if self.engine is not None and (PUBLISHED in method or SIZED in method):
            raise ValueError(f"{method}: the distributed engine runs one tree config at its budget; drop the suffix")
        decoder = self.engine if self.engine is not None else self._decoder(method, budget, probes)
        if method == ORACLE:
            return self._oracle(decoder, budget)
        if method == VALUE_PLANNER:
            return lambda ids, n: decoder.generate(ids, n, ValuePlanner(self.heads, self._call_cap()), self.eos)
        if artifact_base(method) == TREEGRAFT:
            policy = self.scheduler or ShallowTreeHeuristic()
        else:
            policy = fixed_base(method) or method  # ar, or a fixed schedule without its suffix
        return lambda ids, n: decoder.generate(ids, n, policy, self.eos)

    def _call_cap(self) -> int | None:
        return self.scheduler.info.cost_profile.get("call_cap") if self.scheduler else None

    def _oracle(self, decoder, budget: int) -> Callable[[list[int], int], Generation]:
        """Best schedule of every round in hindsight: an untimed pass enumerates all 32 schedules per round
        along the target's greedy decode (under the artifact's cost model and call cap), then the timed
        decode replays the chosen ones."""
        cost = CostModel.from_dict(self.scheduler.info.cost_profile)
        collector = Collector(self.target.lm, self.middle.lm, TreeConfig(budget=budget), cost, (budget,),
                              self._call_cap())

        def run(ids: list[int], n: int) -> Generation:
            patterns = ["".join(map(str, SCHEDULES[r.behaviour])) for r in collector.rounds(ids, n, self.eos)]
            return decoder.generate(ids, n, ReplaySchedule(patterns, ORACLE), self.eos)

        return run

    def warm_up(self, prompts: list[list[int]]) -> dict[str, Callable]:
        """Untimed requests per method; with --budget auto they also pick each method's budget from the
        acceptance observed at every candidate budget over all warm-up prompts (a method given its own
        budget, METHOD=N, keeps it)."""
        runners = {}
        fixed = self.cfg.budget if isinstance(self.cfg.budget, dict) else {}
        ours = [m for m in self.cfg.methods if m not in PEER_METHODS and m != AR_METHOD]
        auto = self.cfg.budget == "auto" or bool(fixed) and any(m not in fixed for m in ours)
        if auto:
            profile = self.verify_ms()
            probes = tuple(profile)  # the sizes worth measuring on this device
        for method in tqdm(self.cfg.methods, desc="warm-up", file=sys.stderr):
            if method in fixed:
                self.budgets[method] = fixed[method]
                self.runner(method, self.budgets[method])(prompts[0], 8)
            elif auto and artifact_base(method) and not is_sized(method) and self.scheduler is not None:
                # The scheduler was fitted for one budget: its decisions assume that tree size.
                self.budgets[method] = int(self.scheduler.info.cost_profile["budget"])
                self.runner(method, self.budgets[method])(prompts[0], 8)
            elif auto and is_sized(method):
                # Its sizer picks each round's size up to the largest this device measured.
                self.budgets[method] = max(profile)
                self.runner(method, self.budgets[method])(prompts[0], 8)
            elif auto and method not in PEER_METHODS and method != AR_METHOD:
                accepted_at, draft_s, rounds = {}, 0.0, 0
                for ids in prompts:
                    s = self.runner(method, max(probes), probes)(ids, WARMUP_TOKENS).stats
                    for b, acc in s.accepted_at_budget.items():
                        accepted_at.setdefault(b, []).extend(acc)
                    draft_s += sum(s.seconds[k] for k in ("ngram", "middle", "scheduler", "other"))
                    rounds += s.rounds
                self.budgets[method] = choose_budget(profile, accepted_at, 1e3 * draft_s / max(rounds, 1))
            else:
                self.budgets[method] = self.cfg.budget if isinstance(self.cfg.budget, int) else max(CANDIDATES)
                self.runner(method, self.budgets[method])(prompts[0], 8)
            runners[method] = self.runner(method, self.budgets[method])
        if not isinstance(self.cfg.budget, int):
            self.log("budgets: " + ", ".join(f"{m}: {b}" for m, b in self.budgets.items()
                                                    if m not in PEER_METHODS and m != AR_METHOD))
        return runners

    # -- the run --------------------------------------------------------------------------------------
    def prompts(self, questions: list[Question], answer: Callable[[list[int]], list[int]]) -> list[Prompt]:
        """First turns (all turns with --multi-turn: later turns carry the reference answers so far)."""
        out = []
        for q in questions:
            turns = q.turns if self.cfg.multi_turn else q.turns[:1]
            answers: list[str] = []
            for k in range(len(turns)):
                ids = chat_prompt(self.target.tokenizer, list(turns[: k + 1]), answers)
                out.append(Prompt(q.benchmark, q.question_id, k + 1, ids))
                if k + 1 < len(turns):
                    answers.append(self.target.tokenizer.decode(answer(ids), skip_special_tokens=True))
        return out

    def run(self) -> "Summary":
        cfg = self.cfg
        questions = select_questions(cfg)
        # Warm-up prompts: the last question of up to WARMUP_PROMPTS benchmarks, outside the evaluated ones.
        warm = [builtin(b)[-1] for b in cfg.benchmarks[:WARMUP_PROMPTS]] or questions[-1:]
        runners = self.warm_up([chat_prompt(self.target.tokenizer, [q.turns[0]], []) for q in warm])
        ar = runners[AR_METHOD]
        prompts = self.prompts(questions, lambda ids: ar(ids, cfg.max_new_tokens).tokens)
        cfg.out.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=len(prompts) * len(cfg.methods), desc="eval", unit="run", file=sys.stderr)
        mismatches = []
        for i, p in enumerate(prompts):
            results = {}
            order = cfg.methods[i % len(cfg.methods):] + cfg.methods[: i % len(cfg.methods)]
            for method in order:
                bar.set_postfix_str(f"{p.benchmark}/{p.prompt_id} {method}")
                results[method] = runners[method](p.ids, cfg.max_new_tokens)
                bar.update()
            reference = results[AR_METHOD].tokens
            for method in cfg.methods:
                budget = None if method in PEER_METHODS or method == AR_METHOD else self.budgets[method]
                row = self.judge(method, p, results[method], reference, budget)
                if row["verdict"] == MISMATCH and is_ours(method):
                    mismatches.append((method, p.benchmark, p.prompt_id))
                self.rows.append(row)
            write_parquet_atomic(pa.Table.from_pylist(self.rows), cfg.out / "results.parquet")
        bar.close()
        summary = summarize(pa.Table.from_pylist(self.rows), cfg.methods)
        summary.write(cfg.out)
        return dataclasses.replace(summary, mismatches=mismatches)

    def judge(self, method: str, p: Prompt, gen: Generation, reference: list[int], budget: int | None) -> dict:
        """The result row of `gen` (`method` on prompt `p`) with its verdict against ar's `reference` tokens on
        the same prompt; a mismatch in one of our methods and a near-tie are printed."""
        check = classify(self.target.lm, p.ids, reference, gen.tokens)
        where = f"{p.benchmark}/{p.prompt_id} (turn {p.turn})"
        if check.verdict == MISMATCH and is_ours(method):
            tqdm.write(f"MISMATCH: {method} differs from ar on {where}: {check.reason}", file=sys.stderr)
        elif check.verdict == NEAR_TIE:
            tqdm.write(f"near-tie (rounding, not a mismatch): {method} on {where}: {check.reason}", file=sys.stderr)
        return _row(method, p, gen, check, budget)


def _row(method: str, p: Prompt, gen: Generation, check: Check, budget: int | None) -> dict:
    s = gen.stats
    return {
        "method": method, "benchmark": p.benchmark, "prompt_id": p.prompt_id, "turn": p.turn,
        "prompt_tokens": len(p.ids), "new_tokens": s.new_tokens, "wall_s": s.wall_s,
        "rounds": s.rounds, "mean_accepted": s.mean_accepted if s.rounds else float("nan"),
        "middle_calls": sum(s.middle_calls), "middle_calls_per_round": s.middle_calls_per_round,
        "mean_tree_size": sum(s.tree_sizes) / len(s.tree_sizes) if s.tree_sizes else float("nan"),
        "tokens_per_s": s.tokens_per_s, "budget": budget,
        # `lossless` (True iff identical) is kept for readers of older result files.
        "lossless": check.verdict == EXACT, "verdict": check.verdict, "diverge_at": check.diverge_at,
        "logit_gap": check.logit_gap, "tolerance": check.tolerance,
        **{f"{k}_s": v for k, v in s.seconds.items()},
    }


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    with replacing(path) as tmp:
        pq.write_table(table, tmp)


@dataclass
class Summary:
    """Per (benchmark, method) and per method over all benchmarks."""

    rows: list[dict]
    methods: list[str]
    benchmarks: list[str]
    mismatches: list = field(default_factory=list)

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
            cells = [f"{per[b]['speedup']:.2f}x" for b in self.benchmarks]
            cells += [f"{mean['speedup']:.2f}x"] + [f"{per[g]['speedup']:.2f}x" for g in split]
            acc = "-" if mean["mean_accepted"] != mean["mean_accepted"] else f"{mean['mean_accepted']:.2f}"
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {acc} | "
                         f"{mean['tokens_per_s']:.2f} | {mean['middle_calls_per_round']:.2f} | "
                         f"{_verdict_cell(mean)} |")
        return "\n".join(lines)

    def write(self, out: Path) -> None:
        write_text(out / "summary.md", self.table() + "\n")
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(self.rows[0]))
        w.writeheader()
        w.writerows(self.rows)
        write_text(out / "summary.csv", buf.getvalue())
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
    ar_rate = {}
    for b in benches:
        ar = t.filter((pc.field("method") == AR_METHOD) & (pc.field("benchmark") == b))
        ar_rate[b] = pc.sum(ar.column("new_tokens")).as_py() / pc.sum(ar.column("wall_s")).as_py()
    for m in methods:
        per_bench = []
        for b in benches:
            sub = t.filter((pc.field("method") == m) & (pc.field("benchmark") == b)).to_pylist()
            wall = sum(r["wall_s"] for r in sub)
            tokens = sum(r["new_tokens"] for r in sub)
            rounds = sum(r["rounds"] for r in sub)
            accepted = sum(r["mean_accepted"] * r["rounds"] for r in sub if r["rounds"])
            verdicts = [row_verdict(r) for r in sub]
            row = {"method": m, "benchmark": b, "prompts": len(sub), "speedup": tokens / wall / ar_rate[b],
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
    return Summary(rows, methods, benches)


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
    have: dict[tuple, set] = {}
    for r in rows:
        have.setdefault(_prompt_key(r), set()).add(r["method"])
    # Speedups compare methods on the same prompts: a prompt some method lacks is left out of every mean.
    rows = [r for r in rows if have[_prompt_key(r)] == set(methods)]
    if not rows:
        raise ValueError(f"{path}: no prompt has a row for every method ({', '.join(methods)})")
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
        vals = [next(r["speedup"] for r in summary.rows if r["method"] == m and r["benchmark"] == g) for g in groups]
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
