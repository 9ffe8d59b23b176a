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
alike; one warm-up request per method (not timed) comes first. With a time limit (cfg.time_limit) a run leaves
methods out of its last prompts, or those prompts, to end in time, and says so (timelimit.py).

The method registry is methods.py; reading results back, the summary table and the chart are summary.py.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
from tqdm import tqdm

from ..decoding.config import TreeConfig
from ..decoding.costs import CANDIDATES, CostModel, choose_budget, latency_profile
from ..decoding.engine import AR_METHOD, Decoder, Generation
from ..decoding.schedule import SCHEDULES, ReplaySchedule, ShallowTreeHeuristic
from ..decoding.scheduler import fitted_tree
from ..decoding.sizing import CopyReach, TreeSizer
from ..files import write_parquet
from ..models.loading import LoadedModel
from ..models.paths import cache_root
from ..scheduling.artifact import load_artifact
from ..scheduling.collect import Collector
from ..scheduling.device import PROFILE_KEY, resolve_scheduler
from ..scheduling.value import ValuePlanner
from .benchmarks import BENCHMARKS, Question, builtin, chat_prompt, load_questions
from .lossless import EXACT, MISMATCH, NEAR_TIE, Check, classify
from .methods import (
    ALL_METHODS,
    CAPPED,
    DEEP,
    DEFAULT_METHODS,
    ORACLE,
    PACED,
    PUBLISHED,
    SHALLOW,
    SIZED,
    TREEGRAFT,
    UNPINNED,
    VALUE_PLANNER,
    WIDTH,
    artifact_base,
    deepen_of,
    fixed_base,
    is_method,
    is_ours,
    is_sized,
    width_of,
    without_settings,
)
from .peers import PEER_METHODS, run_peer
from .summary import Summary, summarize
from .timelimit import TimeLimit, plan

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
    time_limit: float | None = None  # seconds for the whole run (timelimit.py says what a run leaves out for it)
    started: float | None = None  # time.monotonic() when the command began (default: when this config is made)

    def __post_init__(self):
        if self.prompts_per_benchmark < 1:
            raise ValueError(f"--prompts-per-benchmark must be at least 1, got {self.prompts_per_benchmark}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"--time-limit must be positive, got {self.time_limit}")
        if self.started is None:
            self.started = time.monotonic()
        one_budget = self.budget == "auto" or isinstance(self.budget, int) and self.budget >= 1
        if not (one_budget or isinstance(self.budget, dict)):
            raise ValueError(f"--budget must be 'auto', an integer >= 1 or METHOD=N,..., got {self.budget!r}")
        if AR_METHOD not in self.methods:
            self.methods = [AR_METHOD] + list(self.methods)  # the reference every output is checked against
        for m in self.methods:
            if not is_method(m):
                raise ValueError(f"unknown method {m!r}: use {', '.join(ALL_METHODS)} or a 5-bit pattern such "
                                 f"as 01001 (a fixed one or treegraft with {PUBLISHED}: the published tree settings; "
                                 f"{SHALLOW}: no deepening layers; {UNPINNED}: a copy's chain pruned by score; "
                                 f"{CAPPED}: never past the budget; "
                                 f"with {SIZED}: trees sized per round; {WIDTH}N: width N; {DEEP}N: up to N "
                                 "deepening layers)")
        if isinstance(self.budget, dict):
            bad = {m: b for m, b in self.budget.items() if not isinstance(b, int) or b < 1}
            if bad:
                raise ValueError(f"--budget: every budget must be an integer >= 1, got {bad}")
            stray = [m for m in self.budget if m not in self.methods or m in PEER_METHODS or m == AR_METHOD]
            if stray:
                raise ValueError(f"--budget names {', '.join(stray)}, which is not one of our tree methods in "
                                 f"--methods ({', '.join(m for m in self.methods if m not in PEER_METHODS)})")


@dataclass
class Prompt:
    benchmark: str
    prompt_id: str
    turn: int
    ids: list[int]
    rank: int = 0  # the question's place in its set: prompts of rank 0 are the first round


def select_questions(cfg: EvalConfig) -> list[Question]:
    """The first N questions of every set, round-robin (question 1 of each set, then question 2 ...),
    so a run stopped part-way has covered every benchmark about equally."""
    sets = [builtin(name)[: cfg.prompts_per_benchmark] for name in cfg.benchmarks]
    sets += [load_questions(path)[: cfg.prompts_per_benchmark] for path in cfg.benchmark_files]
    return [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]


class Evaluation:
    """One run: decoders per method (with their budgets), the loop, the outputs."""

    def __init__(self, target: LoadedModel, middle: LoadedModel | None, cfg: EvalConfig, log=print, engine=None,
                 clock: Callable[[], float] = time.monotonic):
        """`engine`: a DistributedEngine (anything with Decoder.generate's signature) that runs our methods
        instead of in-process decoders; its tree settings are fixed, so the budget must be a number. `clock`
        times the runs for --time-limit (cfg.started is on it)."""
        self.target, self.middle, self.cfg, self.log, self.engine = target, middle, cfg, log, engine
        self.clock = clock
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
        self.reaches: dict[str, CopyReach] = {}  # per other method of ours, learning across its requests
        self._verify_ms: dict[int, float] | None = None
        self._timed_decoders: dict[int, Decoder] = {}  # budget -> the decoder whose timings the others reuse
        self.rows: list[dict] = []
        self.scheduler, self.heads = self._load_scheduler()

    def _load_scheduler(self):
        """(LearnedScheduler, ValueHeads or None) for the artifact methods: --scheduler's artifact (refused if
        fitted for another device profile), else the one fitted for this device from the trajectories shipped
        for the pair (scheduling/device.py); (None, None) when none is needed or, for treegraft alone, neither
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
                                      TreeConfig(), self.log, any_width=True)
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
                 f"{profile.get('budget')}, tree width {scheduler.width}, call cap {profile.get('call_cap')} (signals: {', '.join(scheduler.subset)})")
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
        """This device's verification ms by tree size (measured once, cached: costs.latency_profile)."""
        if self._verify_ms is None:
            self._verify_ms = latency_profile(self.target.lm, self.target.source, cache_root(self.cfg.cache_dir))
            self.log("verification latency by tree size (ms): "
                     + ", ".join(f"{b}: {ms:.0f}" for b, ms in self._verify_ms.items()))
        return self._verify_ms

    def _decoder(self, method: str, budget: int, probes: tuple[int, ...] = ()) -> Decoder:
        tree = TreeConfig(budget=budget, **({"long_chain": 0, "deepen": 0, "middle_window": 0} if PUBLISHED in method
                                            else {"deepen": 0} if SHALLOW in method
                                            else {"pin_match": 0} if UNPINNED in method else {}))
        if artifact_base(method) and PUBLISHED not in method:
            tree = fitted_tree(tree, self.scheduler, budget=False)  # the width it was fitted for
        if width_of(method) is not None:
            tree = dataclasses.replace(tree, top_k=width_of(method))
        if deepen_of(method) is not None:
            tree = dataclasses.replace(tree, deepen=deepen_of(method))
        sizer, reach = None, None
        if is_sized(method):
            costs = self.verify_ms()
            sizer = self.sizers.setdefault(method, TreeSizer(costs, max_size=max(costs)))
        elif method != AR_METHOD and CAPPED not in method and tree.long_chain and tree.pin_match:
            # A copied span the budget cuts short may be verified further where that pays.
            reach = self.reaches.setdefault(method, CopyReach(self.verify_ms()))
        # The forward times a decoder measures on first use depend on its budget alone. With a scheduler fitted
        # for this device they are its cost profile's (as its signals were in the fit); else measured once a
        # budget (a method's warm-up decoder measures them, its timed one reuses them).
        if self.scheduler is not None:
            timings = CostModel.from_dict(self.scheduler.info.cost_profile).timings(tree.budget)
        else:
            first = self._timed_decoders.get(tree.budget)
            timings = first.measured_timings if first is not None else None
        # treegraft@paced drafts only while drafting pays (sizing.Payoff), as the server runs a request alone.
        decoder = Decoder(self.target.lm, self.middle.lm if self.middle else None, tree, timings=timings,
                          probe_budgets=probes, sizer=sizer, reach=reach,
                          verify_ms=self.verify_ms() if without_settings(method) == TREEGRAFT + PACED else None)
        if timings is None:
            self._timed_decoders[tree.budget] = decoder
        return decoder

    def runner(self, method: str, budget: int, probes=()) -> Callable[[list[int], int], Generation]:
        if method in PEER_METHODS:
            mid = self.middle.lm if self.middle else None
            return lambda ids, n: run_peer(method, self.target.lm, mid, ids, n, self.eos)
        suffixes = (PUBLISHED, SHALLOW, UNPINNED, CAPPED, SIZED, PACED, WIDTH, DEEP)
        if self.engine is not None and any(tag in method for tag in suffixes):
            raise ValueError(f"{method}: the distributed engine runs one tree config at its budget; drop the suffix")
        decoder = self.engine if self.engine is not None else self._decoder(method, budget, probes)
        if artifact_base(method) == ORACLE:
            return self._oracle(decoder, budget)
        if artifact_base(method) == VALUE_PLANNER:
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
        collector = Collector(self.target.lm, self.middle.lm, decoder.cfg, cost, (budget,),
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
        out, seen = [], {}
        for q in questions:
            turns = q.turns if self.cfg.multi_turn else q.turns[:1]
            answers: list[str] = []
            rank = seen[q.benchmark] = seen.get(q.benchmark, -1) + 1
            for k in range(len(turns)):
                ids = chat_prompt(self.target.tokenizer, list(turns[: k + 1]), answers)
                out.append(Prompt(q.benchmark, q.question_id, k + 1, ids, rank))
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
        limit = TimeLimit(cfg.time_limit, cfg.started, clock=self.clock) if cfg.time_limit else None
        methods, seconds, notes, mismatches = list(cfg.methods), {}, [], []
        for i, p in enumerate(prompts):
            if limit is not None and p.rank > 0:
                methods = self._fit_time(limit, prompts, i, methods, seconds, notes, bar)
                if not methods:
                    break
            results = {}
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for method in order:
                bar.set_postfix_str(f"{p.benchmark}/{p.prompt_id} {method}")
                t0 = self.clock()
                results[method] = runners[method](p.ids, cfg.max_new_tokens)
                seconds.setdefault((method, p.benchmark), []).append(self.clock() - t0)
                bar.update()
            reference = results[AR_METHOD].tokens
            for method in methods:
                budget = None if method in PEER_METHODS or method == AR_METHOD else self.budgets[method]
                row = self.judge(method, p, results[method], reference, budget)
                if row["verdict"] == MISMATCH and is_ours(method):
                    mismatches.append((method, p.benchmark, p.prompt_id))
                self.rows.append(row)
            write_parquet(cfg.out / "results.parquet", pa.Table.from_pylist(self.rows))
        bar.close()
        summary = summarize(pa.Table.from_pylist(self.rows), cfg.methods)
        summary = dataclasses.replace(summary, notes=notes + summary.notes)
        summary.write(cfg.out)
        return dataclasses.replace(summary, mismatches=mismatches)

    def _fit_time(self, limit: TimeLimit, prompts: list[Prompt], i: int, methods: list[str], seconds: dict,
                  notes: list[str], bar) -> list[str]:
        """The methods prompt i and those after it run with to end within the time limit (none: stop here)."""
        remaining = [q.benchmark for q in prompts[i:]]
        p = plan(limit.left(), remaining, methods, seconds)
        if p.stop:
            ran = Counter(q.benchmark for q in prompts[:i])
            note = (f"--time-limit {limit.describe()}: stopped before prompt {i + 1} of {len(prompts)} "
                    f"({prompts[i].benchmark}/{prompts[i].prompt_id}): the rest needed about {p.need_s / 60:.1f} min "
                    f"with {max(p.left_s, 0) / 60:.1f} min left; prompts run per benchmark: "
                    + ", ".join(f"{b} {n}" for b, n in ran.items()))
            notes.append(note)
            tqdm.write(note, file=sys.stderr)
            bar.total = bar.n
            return []
        if p.drop:
            note = (f"--time-limit {limit.describe()}: {', '.join(p.drop)} left out from prompt {i + 1} of "
                    f"{len(prompts)} ({prompts[i].benchmark}/{prompts[i].prompt_id} on): the rest needed about "
                    f"{p.need_s / 60:.1f} min with {max(p.left_s, 0) / 60:.1f} min left; run them with --methods "
                    f"{','.join([AR_METHOD] + p.drop)} to cover every prompt")
            notes.append(note)
            tqdm.write(note, file=sys.stderr)
            bar.total -= len(p.drop) * (len(prompts) - i)
        return [m for m in methods if m not in p.drop]

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
