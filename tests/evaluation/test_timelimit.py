"""`treegraft eval --time-limit`: what a run leaves out to end in time, and that it says so."""

import itertools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny import char_tokenizer, perturbed_copy, tiny_model

from treegraft_dist.evaluation.evaluate import EvalConfig, Evaluation
from treegraft_dist.evaluation.summary import summarize, summarize_folder
from treegraft_dist.evaluation.timelimit import RESERVE_S, parse_seconds, plan, project
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import LoadedModel

METHODS = ["ar", "all-small", "all-mid", "treegraft", "treegraft@sized", "hf-assisted", "hf-pld"]
# Seconds a run of each method took, per benchmark, in the first round.
SECONDS = {(m, b): [s * (2 if b == "humaneval" else 1)]
           for m, s in zip(METHODS, [20, 15, 14, 11, 12, 12, 13]) for b in ("gsm8k", "humaneval")}


@pytest.mark.parametrize("text, seconds", [("900", 900), ("90s", 90), ("15m", 900), ("1.5m", 90), ("1h", 3600)])
def test_a_limit_reads_seconds_minutes_or_hours(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "15 minutes", "m", "20x"])
def test_a_bad_limit_says_what_is_accepted(text):
    with pytest.raises(ValueError, match=r"--time-limit must be a positive number of seconds or minutes \(900"):
        parse_seconds(text)


def test_the_projection_uses_each_methods_time_on_the_same_benchmark():
    # humaneval's runs took twice gsm8k's; a benchmark a method has not run takes its mean elsewhere.
    assert project(["gsm8k", "humaneval"], ["ar"], SECONDS) == pytest.approx(20 + 40)
    assert project(["qa"], ["ar", "hf-pld"], SECONDS) == pytest.approx(30 + 19.5)
    assert project(["gsm8k"], ["never-ran"], SECONDS) == 0.0


def test_a_run_that_fits_leaves_nothing_out():
    p = plan(1000.0, ["gsm8k", "humaneval"], METHODS, SECONDS)
    assert (p.drop, p.stop, p.need_s) == ([], False, pytest.approx(3 * 97))


def test_methods_are_left_out_last_listed_first_never_ar_treegraft_or_the_peers():
    # humaneval's prompt first (so none of these can wait for a later one): all need 291 s, the kept 168.
    remaining = ["humaneval", "gsm8k"]
    assert plan(291 - 36, remaining, METHODS, SECONDS).drop == ["treegraft@sized"]
    assert plan(291 - 37, remaining, METHODS, SECONDS).drop == ["treegraft@sized", "all-mid"]
    p = plan(168, remaining, METHODS, SECONDS)
    assert (p.drop, p.stop) == (["treegraft@sized", "all-mid", "all-small"], False)


def test_a_method_is_left_out_only_from_the_last_prompt_that_leaves_the_rest_time_enough():
    # 255 s: the rest fits without treegraft@sized (its 12 + 24 s). gsm8k's prompt with it (97 s) and humaneval's
    # without (170 s) need 267: it is left out now. With 270 s it runs gsm8k's prompt and is left out later.
    assert plan(255, ["gsm8k", "humaneval"], METHODS, SECONDS).drop == ["treegraft@sized"]
    p = plan(270, ["gsm8k", "humaneval"], METHODS, SECONDS)
    assert (p.drop, p.stop) == ([], False)
    assert plan(270 - 97, ["humaneval"], METHODS, SECONDS).drop == ["treegraft@sized"]


def test_the_kept_methods_go_on_while_the_next_prompt_fits_then_the_run_stops():
    # The kept methods need 56 s for gsm8k's prompt and 112 for humaneval's.
    p = plan(167, ["gsm8k", "humaneval"], METHODS, SECONDS)
    assert (p.drop, p.stop) == (["treegraft@sized", "all-mid", "all-small"], False)
    assert plan(56, ["gsm8k", "humaneval"], METHODS, SECONDS).stop is False
    p = plan(55, ["gsm8k", "humaneval"], METHODS, SECONDS)
    assert p.stop and p.left_s == 55


def _row(method, prompt, tokens, wall):
    return {"method": method, "benchmark": "gsm8k", "prompt_id": prompt, "turn": 1, "new_tokens": tokens,
            "wall_s": wall, "rounds": tokens, "mean_accepted": 1.0, "middle_calls": 0, "verdict": "exact",
            "lossless": True}


def test_a_method_on_fewer_prompts_is_compared_with_ar_on_those_prompts(tmp_path):
    # ar: 10 tok/s on prompt 1, 5 on prompt 2; all-mid ran prompt 1 only, at 20 tok/s: 2x, not 20 / 7.5.
    rows = [_row("ar", "1", 10, 1.0), _row("ar", "2", 10, 2.0), _row("all-mid", "1", 10, 0.5),
            _row("hf-pld", "1", 10, 0.5), _row("hf-pld", "2", 10, 1.0)]
    s = summarize(pa.Table.from_pylist(rows), ["ar", "all-mid", "hf-pld"])
    speed = {r["method"]: r["speedup"] for r in s.rows if r["benchmark"] == "gsm8k"}
    assert speed == {"ar": pytest.approx(1.0), "all-mid": pytest.approx(2.0), "hf-pld": pytest.approx(2.0)}
    assert s.notes == ["all-mid ran on 1 of the 2 prompts: its speedups are over those prompts"]
    assert s.table().endswith("\n\n- all-mid ran on 1 of the 2 prompts: its speedups are over those prompts")
    # The folder's summary keeps every prompt ar ran (before, a prompt some method lacked was dropped).
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "results.parquet")
    again = summarize_folder(tmp_path)
    assert {r["method"]: r["prompts"] for r in again.rows if r["benchmark"] == "(mean)"} == {
        "ar": 2, "all-mid": 1, "hf-pld": 2}
    assert "all-mid ran on 1 of the 2 prompts" in (tmp_path / "summary.md").read_text()


class SteppedClock:
    """A clock that moves `step` seconds at every reading: every timed run takes exactly `step`."""

    def __init__(self, step: float):
        self.ticks = itertools.count()
        self.step = step

    def __call__(self) -> float:
        return next(self.ticks) * self.step


def test_a_run_over_its_limit_leaves_methods_out_then_stops_at_a_round_end_and_says_so(tmp_path, capsys):
    tok = char_tokenizer()
    model = tiny_model("qwen3", init=0.4)
    target = LoadedModel(CausalLM(model), tok, "tiny-target")
    middle = LoadedModel(CausalLM(perturbed_copy(model, 0.2, 1)), tok, "tiny-middle")
    clock = SteppedClock(10.0)
    # gsm8k's first three questions, one a round. Round 1: four runs of 10 s (the clock reads 0 to 70). Before
    # prompt 2 the clock reads 80: 65 s are left (the limit less RESERVE_S and 80) for 2 x 4 runs: all-mid is left
    # out (prompt 2 with it and prompt 3 without would need 70). Before prompt 3 (clock 150) nothing is left even
    # for ar and hf-pld on it: the run stops there.
    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["ar", "all-small", "all-mid", "hf-pld"], prompts_per_benchmark=3,
                     max_new_tokens=6, budget=4, out=tmp_path / "out", time_limit=65 + 80 + RESERVE_S,
                     started=0.0)
    summary = Evaluation(target, middle, cfg, clock=clock).run()
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    ran = [(r["prompt_id"], r["method"]) for r in rows]
    first, second = sorted({r["prompt_id"] for r in rows}, key=[r["prompt_id"] for r in rows].index)
    assert sorted(ran) == sorted([(first, m) for m in cfg.methods] + [(second, m) for m in ("ar", "all-small",
                                                                                             "hf-pld")])
    assert all(r["verdict"] == "exact" for r in rows if r["method"] != "hf-pld")
    err = capsys.readouterr().err.replace(f"--time-limit {cfg.time_limit:.0f} s:", "--time-limit {limit}:")
    assert "--time-limit {limit}: all-mid left out from prompt 2 of 3" in err
    assert "run them with --methods ar,all-mid to cover every prompt" in err
    assert ("--time-limit {limit}: stopped before prompt 3 of 3 (gsm8k/" in err
            and "prompts run per benchmark: gsm8k 2" in err)
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "all-mid left out from prompt 2 of 3" in table and "stopped before prompt 3 of 3" in table
    assert "all-mid ran on 1 of the 2 prompts: its speedups are over those prompts" in table
    assert len(summary.notes) == 3 and summary.notes[2].startswith("all-mid ran on 1 of the 2 prompts")
