"""`treegraft eval` on tiny models: rows, lossless checks, summary, chart, auto budget, bad input."""

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from treegraft_dist.decoding.config import TreeConfig
from jobs.cli import main
from treegraft_dist.evaluation.benchmarks import BenchmarkError, builtin, load_questions
from treegraft_dist.evaluation.evaluate import EvalConfig, Evaluation
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import LoadedModel

METHODS = ["ar", "all-small", "all-mid", "treegraft", "01001", "hf-pld", "hf-assisted"]


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    model = tiny_model("qwen3", init=0.4)
    target = LoadedModel(CausalLM(model), tok, "tiny-target")
    middle = LoadedModel(CausalLM(perturbed_copy(model, 0.2, 1)), tok, "tiny-middle")
    return target, middle


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "mine.jsonl"
    rows = [{"question_id": i, "category": "x", "turns": [q, "and again?"]}
            for i, q in enumerate(["abab abab abab", "the cat sat on the mat, the cat", "hello there"])]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_eval_writes_rows_summary_and_chart(pair, bench_file, tmp_path):
    target, middle = pair
    cfg = EvalConfig(benchmarks=["humaneval"], benchmark_files=[bench_file], methods=METHODS[1:],
                     prompts_per_benchmark=2, max_new_tokens=16, out=tmp_path / "out", budget="auto",
                     cache_dir=tmp_path / "cache", multi_turn=True)
    summary = Evaluation(target, middle, cfg).run()
    assert summary.mismatches == []
    t = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    # humaneval has one turn, our file two: 2 + 2 * 2 prompts, each under every method (ar added first).
    assert len(t) == 6 * len(METHODS)
    assert {r["method"] for r in t} == set(METHODS)
    for col in ("method", "benchmark", "prompt_id", "new_tokens", "wall_s", "rounds", "mean_accepted",
                "middle_calls", "lossless", "verdict", "diverge_at", "logit_gap", "tolerance"):
        assert col in t[0]
    # fp32: our methods are identical to ar, token for token.
    assert all(r["verdict"] == "exact" and r["lossless"] for r in t if not r["method"].startswith("hf-"))
    assert all(r["new_tokens"] == 16 for r in t)
    assert all(1 <= r["budget"] <= 128 for r in t if r["method"] not in ("ar", "hf-pld", "hf-assisted"))
    assert (tmp_path / "out" / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "| all-mid |" in table and "mean speedup" in table and "exact/near-tie/mismatch" in table
    means = [r for r in summary.rows if r["benchmark"] == "(mean)"]
    assert {r["method"] for r in means} == set(cfg.methods)
    assert all(r["speedup"] > 0 for r in means)
    ar = next(r for r in means if r["method"] == "ar")
    assert ar["speedup"] == pytest.approx(1.0)
    # The latency profile is cached per (model, device).
    assert list((tmp_path / "cache" / "profiles").glob("tiny-target-*.json"))


def test_a_wrong_method_is_reported_and_fails(pair, tmp_path):
    target, middle = pair
    impostor = LoadedModel(CausalLM(perturbed_copy(target.lm.model, 0.5, 7)), target.tokenizer, "impostor")

    class Broken(Evaluation):
        def runner(self, method, budget, probes=()):
            if method != "all-small":
                return super().runner(method, budget, probes)
            wrong = Evaluation(impostor, middle, self.cfg)
            return wrong.runner(method, budget, probes)

    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["ar", "all-small", "all-mid"], prompts_per_benchmark=1,
                     max_new_tokens=12, out=tmp_path / "o", budget=32)
    summary = Broken(target, middle, cfg).run()
    assert [m for m, _, _ in summary.mismatches] == ["all-small"]
    rows = pq.read_table(tmp_path / "o" / "results.parquet").to_pylist()
    row = next(r for r in rows if r["method"] == "all-small")
    # fp32: any difference is a mismatch, whatever the gap.
    assert (row["lossless"], row["verdict"], row["tolerance"]) == (False, "mismatch", 0.0)
    assert row["diverge_at"] is not None and row["logit_gap"] is not None
    assert "| 0/0/1 |" in summary.table().split("| all-small |")[1].splitlines()[0]


def test_eval_cli_end_to_end(tmp_path, bench_file, capsys):
    tok = char_tokenizer()
    model = tiny_model("llama", init=0.4)
    t = save_tiny(tmp_path / "t", model, tok)
    m = save_tiny(tmp_path / "m", perturbed_copy(model, 0.2, 2), tok)
    code = main(["eval", "--target", t, "--middle", m, "--benchmarks", "", "--benchmark-file", bench_file,
                 "--methods", "ar,all-small,10000", "--prompts-per-benchmark", "2", "--max-new-tokens", "12",
                 "--budget", "24", "--out", str(tmp_path / "out"), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| 10000 |" in out and "speedup.png" in out
    assert len(pq.read_table(tmp_path / "out" / "results.parquet")) == 2 * 3


def test_summary_rebuilds_the_table_of_a_folder_and_refuses_bad_ones(tmp_path, bench_file, capsys):
    tok = char_tokenizer()
    model = tiny_model("llama", init=0.4)
    t = save_tiny(tmp_path / "t", model, tok)
    out = tmp_path / "out"
    assert main(["eval", "--target", t, "--middle", "none", "--benchmarks", "", "--benchmark-file", bench_file,
                 "--methods", "ar,all-small", "--prompts-per-benchmark", "3", "--max-new-tokens", "8",
                 "--budget", "all-small=5", "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "budgets: all-small: 5" in printed
    table = printed[printed.index("| method |"):].split("\n\nresults:")[0]
    assert {r["budget"] for r in pq.read_table(out / "results.parquet").to_pylist() if r["method"] == "all-small"} == {5}
    (out / "summary.md").unlink()
    (out / "speedup.png").unlink()
    assert main(["summary", str(out)]) == 0
    assert capsys.readouterr().out.split("\n\nresults:")[0] == table
    assert (out / "summary.md").read_text().strip() == table and (out / "speedup.png").stat().st_size > 0

    # An interrupted run: the last prompt has only its ar row; the summary covers the two complete prompts.
    rows = pq.read_table(out / "results.parquet").to_pylist()
    last = rows[-1]["prompt_id"]
    cut = [r for r in rows if r["prompt_id"] != last or r["method"] == "ar"]
    pq.write_table(pa.Table.from_pylist(cut), out / "results.parquet")
    assert main(["summary", str(out)]) == 0
    assert "| 2/0/0 |" in capsys.readouterr().out

    # An output that differs from ar fails the command, as in eval; a near-tie does not.
    first = next(r for r in cut if r["method"] == "all-small")
    first.update(lossless=False, verdict="near-tie")
    pq.write_table(pa.Table.from_pylist(cut), out / "results.parquet")
    assert main(["summary", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 1/1/0 |" in printed
    # Its speed on that prompt is on other text from the flip on: said under the table.
    assert f"all-small decoded other text than ar after a near-tie on {first['benchmark']}/{first['prompt_id']}" in printed
    first.update(verdict="mismatch")
    pq.write_table(pa.Table.from_pylist(cut), out / "results.parquet")
    assert main(["summary", str(out)]) == 1
    assert "differ from ar" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["summary", str(tmp_path / "empty")]) == 2
    assert "results.parquet does not exist" in capsys.readouterr().err
    (out / "results.parquet").write_text("not parquet")
    assert main(["summary", str(out)]) == 2
    assert "not a readable Parquet file" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--benchmarks", "nope"], "unknown benchmark"),
    (["--methods", "ar,fast"], "unknown method"),
    (["--methods", "ar,treegraft@k0"], "unknown method"),
    (["--methods", "ar,hf-pld@k4"], "unknown method"),
    (["--methods", "ar,hf-assisted@deep2"], "unknown method"),
    (["--methods", "ar,treegraft@deep2@deep3"], "unknown method"),
    (["--budget", "0"], "budget"),
    (["--budget", "lots"], "budget"),
    (["--budget", "all-small=0"], "integer >= 1"),
    (["--budget", "all-small=,all-mid=3"], "is not METHOD=N"),
    (["--budget", "hf-pld=4"], "not one of our tree methods"),
    (["--methods", "ar,all-small", "--budget", "all-mid=4"], "not one of our tree methods"),
    (["--prompts-per-benchmark", "0"], "prompts-per-benchmark"),
    (["--time-limit", "20 minutes"], "--time-limit must be a positive number of seconds or minutes (900, 900s, 15m"),
    (["--time-limit", "0"], "--time-limit must be a positive"),
])
def test_eval_bad_input(argv, needle, capsys):
    code = main(["eval", "--target", "/no/model"] + argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_benchmarks_ship_with_the_package_and_validate(tmp_path):
    for name in ("mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum"):
        qs = builtin(name)
        assert len(qs) >= 79 and all(q.turns for q in qs)
    assert len(builtin("mt_bench")[0].turns) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": "not a list"}\n')
    with pytest.raises(BenchmarkError, match="bad.jsonl:1"):
        load_questions(bad)


def test_prompts_go_round_robin_over_benchmarks(bench_file):
    from treegraft_dist.evaluation.evaluate import select_questions

    cfg = EvalConfig(benchmarks=["gsm8k", "qa"], benchmark_files=[bench_file], prompts_per_benchmark=2)
    got = [(q.question_id, q.turns[0]) for q in select_questions(cfg)]
    sets = [builtin("gsm8k")[:2], builtin("qa")[:2], load_questions(bench_file)[:2]]
    assert got == [(s[i].question_id, s[i].turns[0]) for i in range(2) for s in sets]


@pytest.fixture(scope="module")
def artifact(pair, tmp_path_factory):
    """A scheduler fitted on rounds collected from the tiny pair (pair names: tiny-target, tiny-middle)."""
    return fit_tiny(pair, tmp_path_factory.mktemp("sched") / "tiny.npz", top_k=10)


@pytest.fixture(scope="module")
def narrow_artifact(pair, tmp_path_factory):
    """The same, fitted on rounds of trees of width 3."""
    return fit_tiny(pair, tmp_path_factory.mktemp("sched3") / "tiny3.npz", top_k=3)


def fit_tiny(pair, path, top_k: int):
    import pyarrow as pa

    from treegraft_dist.decoding.config import TreeConfig
    from treegraft_dist.decoding.costs import CostModel, profile_key
    from treegraft_dist.evaluation.benchmarks import chat_prompt
    from treegraft_dist.scheduling.collect import Collector, Trajectories, records_table
    from treegraft_dist.scheduling.device import PROFILE_KEY
    from treegraft_dist.scheduling.fit import fit

    target, middle = pair
    cost = CostModel("test", 0.2, 0.1, {1: 3.0, 16: 4.0, 64: 8.0}, {1: 5.0, 4: 5.5, 16: 7.0})
    cfg = TreeConfig(budget=16, top_k=top_k)
    collector = Collector(target.lm, middle.lm, cfg, cost, (4, 16))
    tables = []
    for bench in ("gsm8k", "humaneval", "qa"):
        for q in builtin(bench)[20:22]:
            ids = chat_prompt(target.tokenizer, [q.turns[0]], [])[-60:]
            tables.append(records_table(collector.rounds(ids, 12), bench, q.question_id, len(ids), (4, 16), cost))
    manifest = {"pair": ["tiny-target", "tiny-middle"], "cost_model": cost.to_dict(), "budgets": [4, 16],
                "tree": cfg.to_dict(), "max_new_tokens": 12}
    # Fitted for this process's profile of the pair: the evaluation refuses an artifact of another one.
    key = profile_key(target.lm, target.source, middle.lm, middle.source)
    fit(Trajectories(manifest, pa.concat_tables(tables)), path, heldout_fraction=0.34, value_fit={"epochs": 5},
        scheduler_fit={"epochs": 5}, log=lambda *a: None, profile={PROFILE_KEY: key})
    return path


def test_artifact_methods_are_lossless_and_reported_held_in_and_out(pair, artifact, tmp_path):
    from treegraft_dist.scheduling.artifact import load_artifact

    target, middle = pair
    cfg = EvalConfig(benchmarks=["gsm8k", "mt_bench"], methods=["all-small", "treegraft", "value-planner", "oracle"],
                     prompts_per_benchmark=1, max_new_tokens=12, out=tmp_path / "out", budget="auto",
                     cache_dir=tmp_path / "cache", scheduler=artifact, pair=("tiny-target", "tiny-middle"))
    ev = Evaluation(target, middle, cfg)
    summary = ev.run()
    assert summary.mismatches == []
    budget = load_artifact(artifact)[0].info.cost_profile["budget"]
    assert all(ev.budgets[m] == budget for m in ("treegraft", "value-planner", "oracle"))
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert all(r["lossless"] for r in rows) and len(rows) == 2 * 5
    groups = {r["benchmark"] for r in summary.rows}
    assert {"(held-in)", "(held-out)", "(mean)"} <= groups
    assert "held-out mean" in summary.table()


def test_decoders_take_their_forward_times_from_the_fitted_profile_or_measure_them_once_a_budget(
        pair, artifact, tmp_path, monkeypatch):
    """The forward times the scheduler's signals read cost a prefill and several passes to measure. With a
    scheduler fitted for this device they are its cost profile's; without one, a method's warm-up decoder
    and its timed one (and other methods at that budget) share one measurement."""
    from treegraft_dist.decoding import engine
    from treegraft_dist.decoding.costs import CostModel

    target, middle = pair
    measured = []
    real = engine.forward_ms
    monkeypatch.setattr(engine, "forward_ms", lambda lm, block, **k: measured.append(block) or real(lm, block, **k))
    base = dict(benchmarks=["gsm8k"], prompts_per_benchmark=1, max_new_tokens=8, budget={"all-small": 8, "all-mid": 8},
                cache_dir=tmp_path / "cache", pair=("tiny-target", "tiny-middle"))
    ev = Evaluation(target, middle, EvalConfig(methods=["ar", "all-small", "all-mid"], out=tmp_path / "a", **base))
    assert ev.scheduler is None and ev.run().mismatches == []
    assert measured == [8, 8, engine.READ_BLOCK]  # target and middle at the budget, the middle's read: once
    first = ev._decoder("all-mid", 8)
    assert first.measured_timings is not None and ev._decoder("all-small", 8).measured_timings is first.measured_timings
    assert ev._decoder("all-mid", 16).measured_timings is None  # another budget measures its own

    measured.clear()
    ev = Evaluation(target, middle, EvalConfig(methods=["ar", "treegraft", "all-mid"], out=tmp_path / "b",
                                               scheduler=artifact, **{**base, "budget": {"treegraft": 8, "all-mid": 8}}))
    assert ev.run().mismatches == [] and measured == []
    profile = CostModel.from_dict(ev.scheduler.info.cost_profile)
    assert ev._decoder("treegraft", 8).measured_timings == profile.timings(8)
    assert ev._decoder("all-mid", 16).measured_timings == profile.timings(16)


def test_artifact_methods_run_the_tree_width_their_scheduler_was_fitted_for(pair, narrow_artifact, tmp_path):
    from treegraft_dist.scheduling.artifact import load_artifact

    target, middle = pair
    assert load_artifact(narrow_artifact)[0].width == 3
    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["ar", "treegraft", "treegraft@sized", "treegraft@published",
                                                     "oracle", "all-mid", "treegraft@k5", "all-mid@k2@sized",
                                                     "treegraft@deep2"],
                     prompts_per_benchmark=1, max_new_tokens=12, out=tmp_path / "out", budget="auto",
                     cache_dir=tmp_path / "cache", scheduler=narrow_artifact, pair=("tiny-target", "tiny-middle"))
    ev = Evaluation(target, middle, cfg)
    widths = {m: ev._decoder(m, 16).cfg.top_k for m in cfg.methods if m != "ar"}
    # Its own methods at its width; the published settings and the fixed schedules at the published K = 10.
    assert widths == {"treegraft": 3, "treegraft@sized": 3, "oracle": 3, "treegraft@published": 10, "all-mid": 10,
                      "treegraft@k5": 5, "all-mid@k2@sized": 2, "treegraft@deep2": 3}  # @kN: that width
    assert ev._decoder("all-mid@k2@sized", 16).sizer is not None
    # @deepN: up to N middle layers past the depth, the other settings kept; the default up to 4.
    deep = {m: ev._decoder(m, 16).cfg for m in ("treegraft", "treegraft@deep2", "all-mid@k2@deep4")}
    assert {m: c.deepen for m, c in deep.items()} == {"treegraft": 4, "treegraft@deep2": 2, "all-mid@k2@deep4": 4}
    assert deep["all-mid@k2@deep4"].top_k == 2 and deep["treegraft@deep2"].top_k == 3
    summary = ev.run()
    assert summary.mismatches == []
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert all(r["lossless"] for r in rows)


def test_artifact_methods_refuse_a_missing_or_foreign_artifact(pair, artifact, tmp_path):
    target, middle = pair
    base = dict(benchmarks=["gsm8k"], prompts_per_benchmark=1, max_new_tokens=4, out=tmp_path / "o")
    with pytest.raises(ValueError, match="need a scheduler and no trajectories ship"):
        Evaluation(target, middle, EvalConfig(methods=["oracle"], pair=("a", "b"), **base))
    with pytest.raises(ValueError, match="fitted for target/middle pair"):
        Evaluation(target, middle, EvalConfig(methods=["treegraft"], scheduler=artifact, pair=("a", "b"), **base))
    # Another device profile (here the same pair in bf16): refused, never applied silently.
    bf16 = [LoadedModel(CausalLM(copy.deepcopy(m.lm.model).to(torch.bfloat16)), m.tokenizer, m.source)
            for m in (target, middle)]
    with pytest.raises(ValueError, match="fitted for the cost profile .*float32.*bfloat16"):
        Evaluation(*bf16, EvalConfig(methods=["treegraft"], scheduler=artifact, pair=("tiny-target", "tiny-middle"),
                                     **base))
    # treegraft alone without an artifact for the pair falls back to the documented heuristic.
    said = []
    ev = Evaluation(target, middle, EvalConfig(methods=["treegraft"], pair=("a", "b"), **base), log=said.append)
    assert ev.scheduler is None and "heuristic" in said[0]


def test_the_oracle_is_refused_on_a_distributed_engine(pair, artifact, tmp_path):
    target, middle = pair
    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["oracle"], prompts_per_benchmark=1, max_new_tokens=4,
                     out=tmp_path / "o", budget=16, scheduler=artifact, pair=("tiny-target", "tiny-middle"))
    with pytest.raises(ValueError, match="without --distributed"):
        Evaluation(target, middle, cfg, engine=object())


def test_published_settings_run_side_by_side_with_the_long_chain_extension(pair, tmp_path):
    from treegraft_dist.evaluation.methods import fixed_base

    assert fixed_base("all-small@published") == "all-small" and fixed_base("01001@published") == "01001"
    assert fixed_base("treegraft@published") is None and fixed_base("hf-pld") is None
    target, middle = pair
    cfg = EvalConfig(benchmarks=["humaneval"], methods=["all-small", "all-small@published", "10000@published"],
                     prompts_per_benchmark=1, max_new_tokens=12, out=tmp_path / "o", budget=16)
    ev = Evaluation(target, middle, cfg)
    assert ev._decoder("all-small", 16).cfg.long_chain > 0
    published = ev._decoder("all-small@published", 16).cfg
    assert published.long_chain == 0 and published.deepen == 0 and published.middle_window == 0
    assert ev._decoder("all-small", 16).cfg.middle_window == TreeConfig().middle_window > 0
    shallow = ev._decoder("all-mid@shallow", 16).cfg
    assert shallow.long_chain > 0 and shallow.deepen == 0 and TreeConfig(deepen=10).deepen == 10
    assert ev._decoder("all-small", 16).cfg.pin_match == 2 and ev._decoder("all-small@unpinned", 16).cfg.pin_match == 0
    # A copy the budget cuts short is verified further (CopyReach, priced by this device's passes), except @capped.
    assert ev._decoder("all-small", 16).reach is not None and ev._decoder("all-small@capped", 16).reach is None
    assert ev._decoder("all-small@unpinned", 16).reach is None and ev._decoder("all-small@sized", 16).reach is None
    summary = ev.run()
    assert summary.mismatches == []
    assert {r["method"] for r in summary.rows} == {"ar", "all-small", "all-small@published", "10000@published"}
    EvalConfig(methods=["treegraft@published", "treegraft@shallow", "all-mid@shallow",
                        "treegraft@unpinned", "treegraft@capped", "all-mid@capped"])  # all known
    with pytest.raises(ValueError, match="unknown method"):
        EvalConfig(methods=["treegraft@shallow@published"])


def test_sized_methods_size_every_round_and_stay_lossless(pair, tmp_path):
    from treegraft_dist.evaluation.methods import fixed_base, is_sized

    assert fixed_base("all-small@published@sized") == "all-small" and is_sized("01001@sized")
    assert is_sized("treegraft@sized") and not is_sized("treegraft") and not is_sized("all-small")
    assert not is_sized("hf-pld@sized") and not is_sized("oracle@sized")
    target, middle = pair
    cfg = EvalConfig(benchmarks=["humaneval", "gsm8k"], methods=["all-small", "all-small@sized", "01000@sized"],
                     prompts_per_benchmark=1, max_new_tokens=16, out=tmp_path / "o", budget="auto",
                     cache_dir=tmp_path / "cache")
    ev = Evaluation(target, middle, cfg)
    # The device's verification profile, given: measured on a loaded box, it can stop at one node (every size
    # past it priced too dear), and there is nothing left to size. What the sizer does with a profile is tested.
    ev._verify_ms = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.5, 16: 15.0}
    summary = ev.run()
    assert summary.mismatches == []
    profile = ev.verify_ms()
    # A sized method runs up to the largest size this device measured, with one sizer that learned from
    # every request it served (warm-up included).
    assert ev.budgets["all-small@sized"] == max(profile) and set(ev.sizers) == {"all-small@sized", "01000@sized"}
    assert ev.sizers["all-small@sized"].trials.sum() > ev.sizers["all-small@sized"].trials.size * 4.0
    sized = [r["mean_tree_size"] for r in ev.rows if r["method"] == "all-small@sized"]
    assert len(sized) == 2 and all(1.0 <= m <= max(profile) for m in sized)


def test_treegraft_paced_drafts_while_it_pays_beside_treegraft(pair, tmp_path):
    """treegraft@paced drafts while drafting pays for the request (sizing.Payoff, with this device's profile);
    treegraft drafts every round at the same budget; both reproduce `ar`."""
    target, middle = pair
    cfg = EvalConfig(benchmarks=["humaneval"], methods=["treegraft", "treegraft@paced"], prompts_per_benchmark=1,
                     max_new_tokens=16, out=tmp_path / "o", budget=8, cache_dir=tmp_path / "cache")
    ev = Evaluation(target, middle, cfg)
    assert ev._decoder("treegraft@paced", 8).alone is not None and ev._decoder("treegraft", 8).alone is None
    summary = ev.run()
    assert summary.mismatches == []
    assert {r["method"] for r in summary.rows} == {"ar", "treegraft", "treegraft@paced"}
    with pytest.raises(ValueError, match="unknown method"):
        EvalConfig(methods=["all-small@paced"])
