"""The projection checked on tiny models: this machine's own profile projected, eval run on the same prompts,
and the error reported per method."""

import csv

import pyarrow.parquet as pq
import pytest
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model, write_trajectories

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import CostModel
from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
from treegraft_dist.evaluation.projection_check import check, checked_methods, checked_trajectories
from treegraft_dist.models.loading import load_model

FAST = {"value_fit": {"epochs": 3}, "scheduler_fit": {"epochs": 3}}
ELSEWHERE = CostModel("elsewhere", 0.2, 0.1, {1: 3.0, 64: 8.0}, {1: 5.0, 2: 5.2, 4: 5.5, 8: 6.0, 16: 7.0})


@pytest.mark.integration
def test_projection_checked_against_eval_on_the_same_prompts(tmp_path):
    tok = char_tokenizer()
    model = tiny_model("llama", seed=3, init=0.4)
    t = save_tiny(tmp_path / "t", model, tok)
    m = save_tiny(tmp_path / "m", perturbed_copy(model, 0.2, 4), tok)
    target, middle = (load_model(f, "cpu", "float32").lm for f in (t, m))
    # Short questions: the tiny models hold 512 positions. Two per benchmark collected, the first one checked.
    prompts = [(b, q.question_id, chat_prompt(tok, [q.turns[0]], [])) for b in ("alpaca", "qa") for q in builtin(b)[20:22]]
    data = write_trajectories(tmp_path / "traj", target, middle, (t, m), prompts, TreeConfig(budget=16), ELSEWHERE,
                              (1, 2, 4, 8, 16), 12)
    out = tmp_path / "check"
    traj = checked_trajectories((t, m), data, 1)
    pair = load_model(t, "cpu", "float32"), load_model(m, "cpu", "float32", drafter=True)
    done = check(traj, *pair, (t, m), checked_methods("ar,all-small,all-mid,treegraft"), 1, out,
                 str(tmp_path / "cache"), log=lambda _: None, **FAST)
    assert done.mismatches == 0
    rows = list(csv.DictReader((out / "check.csv").open()))
    assert {r["method"] for r in rows} == {"ar", "all-small", "all-mid", "treegraft"}
    assert {r["benchmark"] for r in rows} == {"alpaca", "qa", "(mean)"}
    for r in rows:
        assert float(r["projected_tokens_per_s"]) > 0 and float(r["measured_decode_tokens_per_s"]) > 0
        assert float(r["tokens_per_s_error"]) == float(r["projected_tokens_per_s"]) / float(
            r["measured_decode_tokens_per_s"]) - 1
    assert all(float(r["speedup_error"]) == 0.0 for r in rows if r["method"] == "ar")
    # eval ran on exactly the checked prompts, all-small and all-mid at the projection's budgets, losslessly.
    results = pq.read_table(out / "eval" / "results.parquet").to_pylist()
    assert {(r["benchmark"], r["prompt_id"]) for r in results} == {("alpaca", "20"), ("qa", prompts[2][1])}
    budget = {r["method"]: r["budget"] for r in rows}
    assert all(str(r["budget"]) == budget[r["method"]] for r in results if r["method"] in ("all-small", "all-mid"))
    assert all(r["verdict"] == "exact" for r in results)
    assert "| method | budget | projected tok/s | measured decode tok/s | error |" in done.text
    assert (out / "check.md").read_text() == done.text


def test_what_cannot_be_checked_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="takes ar and any of"):
        checked_methods("all-small,all-mid")
    with pytest.raises(ValueError, match="takes ar and any of"):
        checked_methods("ar,sometimes")
    assert checked_methods("ar,,treegraft") == ["ar", "treegraft"]
    with pytest.raises(ValueError, match="at least 1"):
        checked_trajectories(("t", "m"), None, 0)
    with pytest.raises(ValueError, match="no trajectories ship"):
        checked_trajectories(("t", "m"), None, 1)
