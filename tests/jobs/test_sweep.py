"""`python -m jobs.sweep` submitted with the real `ray job submit` CLI to a local cluster (`ray start --head`
in a temporary folder) on tiny models: a row for every cell with its verdict, the summaries and charts, a
second submission that recomputes nothing, one that recomputes exactly a deleted cell; bad grid files."""

import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from localcluster import BIN, head_node
from tiny import char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model

from jobs.sweep import CELLS_DIR, load_grid, main
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from treegraft_dist.models.hf import CausalLM

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = 2  # per benchmark
NEW_TOKENS = 10
OURS = ["all-small", "all-mid", "treegraft"]
BUDGETS = [4, 16]


@pytest.fixture(scope="module")
def cluster():
    """(environment, dashboard address) of a head node on free ports; its job server takes submissions."""
    with head_node(dashboard=True) as (env, _, dashboard, *_):
        yield env, dashboard


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two tiny pairs in model folders: {name: (target folder, middle folder)}."""
    root = tmp_path_factory.mktemp("sweep-models")
    tok = char_tokenizer()
    out = {}
    for name, arch in (("tiny-llama", "llama"), ("tiny-qwen3", "qwen3")):
        model = tiny_model(arch, init=0.4)
        out[name] = (save_tiny(root / name / "target", model, tok),
                     save_tiny(root / name / "middle", perturbed_copy(model, 0.2, 1), tok))
    return out


def _grid(models: dict, **change) -> dict:
    raw = {"pairs": [{"name": n, "target": t, "middle": m} for n, (t, m) in models.items()],
           "methods": OURS + ["hf-pld"], "budgets": BUDGETS, "benchmarks": ["qa", "alpaca"], "dtypes": ["float32"],
           "prompts_per_benchmark": QUESTIONS, "max_new_tokens": NEW_TOKENS}
    return {**raw, **change}


def _write(folder: Path, raw) -> Path:
    path = folder / "grid.yaml"
    path.write_text(yaml.safe_dump(raw) if isinstance(raw, dict) else raw)
    return path


def _submit(cluster, grid: Path, out: Path) -> str:
    env, address = cluster
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
           "python", "-m", "jobs.sweep", "--grid", str(grid), "--out", str(out), "--workers", "2",
           "--cpus-per-worker", "0.5", "--device", "cpu", "--cache-dir", str(out.parent / "cache")]
    for _ in range(30):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        log = proc.stdout + proc.stderr
        if "No available agent to submit job" not in log:  # the head's job agent is still starting
            break
        time.sleep(2)
    assert proc.returncode == 0 and "succeeded" in log, log[-6000:]
    return log


def _mtimes(out: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in (out / CELLS_DIR).rglob("*.parquet")}


@pytest.mark.integration
def test_sweep_runs_every_cell_under_ray_job_submit_and_resumes(cluster, pairs, tmp_path, capsys):
    grid, out = _write(tmp_path, _grid(pairs)), tmp_path / "sweep"
    keys = [(m, None) for m in ("ar", "hf-pld")] + [(m, b) for m in OURS for b in BUDGETS]
    cells = len(pairs) * 2 * QUESTIONS * len(keys)
    log = _submit(cluster, grid, out)
    assert f"0 already done (skipped), {cells} to run" in log

    rows = pq.read_table(out / "results.parquet").to_pylist()
    questions = [(b, q.question_id) for b in ("qa", "alpaca") for q in builtin(b)[:QUESTIONS]]
    assert sorted((r["pair"], r["benchmark"], r["prompt_id"], r["method"], r["budget"]) for r in rows) == sorted(
        (p, b, q, m, k) for p in pairs for b, q in questions for m, k in keys)
    assert all(r["dtype"] == r["torch_dtype"] == "float32" and r["new_tokens"] == NEW_TOKENS for r in rows)
    ar = {(r["pair"], r["benchmark"], r["prompt_id"]): r["output_ids"] for r in rows if r["method"] == "ar"}
    for r in rows:  # fp32: our methods equal ar token for token; the peer's verdict is only reported
        if r["method"] != "hf-pld":
            assert (r["verdict"], r["lossless"]) == ("exact", True), r
            assert r["output_ids"] == ar[r["pair"], r["benchmark"], r["prompt_id"]]
        assert r["verdict"] in ("exact", "near-tie", "mismatch")
    # The reference itself is the target's own greedy decoding of the chat-formatted first turn.
    tok = char_tokenizer()
    target = CausalLM(tiny_model("qwen3", init=0.4))
    q = builtin("alpaca")[1]
    assert ar["tiny-qwen3", "alpaca", q.question_id] == hf_greedy(target, chat_prompt(tok, [q.turns[0]], []),
                                                                   NEW_TOKENS)

    summary = (out / "summary.md").read_text()
    for name in pairs:
        group = out / f"{name}--float32"
        assert f"## {name}--float32" in summary
        assert (group / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        table = (group / "summary.md").read_text()
        assert table in summary and "| all-mid b16 |" in table and "| hf-pld |" in table
        assert "| 4/0/0 |" in table.split("| treegraft b4 |")[1].splitlines()[0]
        assert (group / "summary.csv").read_text().startswith("method,benchmark,prompts,speedup")

    # Submitted again: every cell is skipped, none is rewritten, the dataset is the same.
    before = _mtimes(out)
    assert len(before) == cells
    log = _submit(cluster, grid, out)
    assert f"{cells} already done (skipped), 0 to run" in log
    assert _mtimes(out) == before
    again = pq.read_table(out / "results.parquet").to_pylist()
    assert [(r["wall_s"], r["output_ids"]) for r in again] == [(r["wall_s"], r["output_ids"]) for r in rows]

    # One cell lost (and a stray temporary file): exactly that cell runs again, against the stored ar tokens.
    lost = next(p for p in before if "all-mid--16" in p.name)
    lost.unlink()
    (lost.parent / f".{lost.name}.x.tmp").write_bytes(b"half")
    log = _submit(cluster, grid, out)
    assert f"{cells - 1} already done (skipped), 1 to run" in log
    after = _mtimes(out)
    assert {p: t for p, t in after.items() if p != lost} == {p: t for p, t in before.items() if p != lost}
    row = pq.read_table(lost).to_pylist()[0]
    assert row["verdict"] == "exact" and row["output_ids"] == ar[row["pair"], row["benchmark"], row["prompt_id"]]

    # Resuming with other settings is refused before anything runs.
    (tmp_path / "other").mkdir()
    changed = _write(tmp_path / "other", _grid(pairs, max_new_tokens=NEW_TOKENS + 1))
    assert main(["--grid", str(changed), "--out", str(out)]) == 2
    assert f"max_new_tokens {NEW_TOKENS}, the grid asks for {NEW_TOKENS + 1}" in capsys.readouterr().err
    assert _mtimes(out) == after


@pytest.mark.parametrize("change,needle", [
    ({"methods": ["all-small", "fast"]}, "unknown method 'fast'"),
    ({"benchmarks": ["qa", "nope"]}, "unknown benchmark 'nope'"),
    ({"budgets": [4, 0]}, "bad budget(s) 0"),
    ({"budgets": "auto"}, "bad budget(s) 'auto'"),
    ({"budget": [4]}, "unknown key 'budget' (did you mean 'budgets'?)"),
    ({"dtypes": ["fp8"]}, "unknown dtype 'fp8'"),
    ({"prompts_per_benchmark": 0}, "'prompts_per_benchmark' must be an integer >= 1"),
    ({"methods": []}, "'methods' must be a non-empty list"),
    ({"pairs": [{"target": "/no/such/model", "middle": "/no/such/middle"}]}, "does not exist"),
    ({"pairs": [{"target": "/no/such/model"}]}, "needs 'middle'"),
    ({"pairs": [{"target": "a", "middle": "b", "tp": 2}]}, "unknown key(s) 'tp'"),
])
def test_bad_grids_are_refused_before_any_model_loads(pairs, tmp_path, capsys, change, needle):
    raw = _grid(pairs, **change)
    raw = {k: v for k, v in raw.items() if k != "budgets"} if "budget" in change else raw
    out = tmp_path / "out"
    assert main(["--grid", str(_write(tmp_path, raw)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("text,needle", [
    ("pairs: [", "not valid YAML"),
    ("- just a list", "must be a mapping"),
    ("methods: [ar]\n", "missing key(s) pairs, budgets, benchmarks, dtypes"),
])
def test_unreadable_grids(tmp_path, capsys, text, needle):
    assert main(["--grid", str(_write(tmp_path, text)), "--out", str(tmp_path / "out")]) == 2
    assert needle in capsys.readouterr().err
    assert main(["--grid", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_example_grid_is_valid():
    grid = load_grid(REPO / "jobs" / "grids" / "embedded.yaml")
    assert grid.methods[0] == "ar" and set(grid.benchmarks) == set(BENCHMARKS)
    assert grid.label("all-mid", 16) == "all-mid b16" and grid.label("ar", None) == "ar"
    assert [p.target for p in grid.pairs] == ["embedded:qwen2.5-coder-1.5b-instruct"]
