"""`treegraft collect` on a real local Ray cluster with tiny models: Parquet out, resumable, readable."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from jobs.cli import main
from treegraft_dist.decoding.schedule import NUM_SCHEDULES
from treegraft_dist.scheduling.collect import MANIFEST, ROUNDS_DIR, read_trajectories
from treegraft_dist.scheduling.value import NUM_STATES


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The session's cluster (conftest.py)."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("collect-models")
    target = tiny_model("llama", seed=7)
    middle = perturbed_copy(target, 0.3, 8)
    tok = char_tokenizer()
    return save_tiny(folder / "target", target, tok), save_tiny(folder / "middle", middle, tok)


def run(pair, out, *extra):
    return main(["collect", "--target", pair[0], "--middle", pair[1], "--device", "cpu", "--out", str(out),
                 "--benchmarks", "gsm8k,humaneval", "--prompts-per-benchmark", "2", "--max-new-tokens", "10",
                 "--budget", "16", "--cpus-per-actor", "0.5", "--cache-dir", str(out.parent / "cache"),
                 "--dtype", "float32", *extra])


@pytest.mark.integration
def test_collect_writes_one_part_per_prompt_and_resumes_without_duplicates(cluster, pair, tmp_path, capsys):
    out = tmp_path / "traj"
    assert run(pair, out) == 0
    parts = sorted((out / ROUNDS_DIR).glob("*.parquet"))
    assert len(parts) == 4
    traj = read_trajectories(out)
    t = traj.table
    assert set(t.column("benchmark").to_pylist()) == {"gsm8k", "humaneval"}
    assert max(traj.budgets) <= 16 and traj.manifest["pair"] == list(pair)
    for part in parts:  # rounds numbered 0.. per prompt, positions strictly increasing
        p = pq.read_table(part)
        assert p.column("round").to_pylist() == list(range(p.num_rows))
        pos = p.column("position").to_pylist()
        assert pos[0] == 1 and all(a < b for a, b in zip(pos, pos[1:]))
    rounds = traj.rounds(max(traj.budgets))
    assert rounds.signals.shape == (t.num_rows, NUM_STATES, 17) and rounds.accepted.shape == (t.num_rows, NUM_SCHEDULES)
    assert (rounds.accepted >= 1).all() and (rounds.latency_ms > 0).all()

    # An interrupted run: one prompt's file is gone, a stray temporary file is left. The rerun redoes
    # exactly that prompt and the data equal the first run's.
    before = t.sort_by([("benchmark", "ascending"), ("prompt_id", "ascending"), ("round", "ascending")])
    parts[1].unlink()
    (out / ROUNDS_DIR / ".part-x.tmp").write_bytes(b"half")
    capsys.readouterr()
    assert run(pair, out) == 0
    printed = capsys.readouterr().out
    assert "1 prompts collected" in printed and "3 already there" in printed
    after = read_trajectories(out).table.sort_by([("benchmark", "ascending"), ("prompt_id", "ascending"),
                                                  ("round", "ascending")])
    assert after.num_rows == before.num_rows
    for name in ("prompt_id", "round", "accepted", "tree_size", "forwards"):
        assert after.column(name).to_pylist() == before.column(name).to_pylist()
    np.testing.assert_allclose(np.array(after.column("signals").to_pylist()),
                               np.array(before.column("signals").to_pylist()), rtol=1e-5, atol=1e-5)


def test_collect_refuses_mt_bench_and_other_settings_on_resume(cluster, pair, tmp_path, capsys):
    assert main(["collect", "--target", pair[0], "--middle", pair[1], "--benchmarks", "mt_bench",
                 "--out", str(tmp_path / "x")]) == 2
    assert "held out" in capsys.readouterr().err
    out = tmp_path / "traj"
    out.mkdir()
    (out / MANIFEST).write_text('{"schema_version": 1, "pair": ["a", "b"], "tree": {}, "max_new_tokens": 10}')
    assert run(pair, out) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.integration
def test_collect_fit_generate_from_the_command_line(cluster, pair, tmp_path, capsys):
    import json

    out = tmp_path / "traj"
    assert run(pair, out) == 0
    art = tmp_path / "sched.npz"
    assert main(["fit", "--data", str(out), "--out", str(art), "--heldout-fraction", "0.5"]) == 0
    report = capsys.readouterr().out
    assert "| oracle |" in report and "chosen" in report and art.is_file()
    common = ["generate", "--target", pair[0], "--middle", pair[1], "--device", "cpu", "--prompt", "def f(x):",
              "--max-new-tokens", "12", "--json", "--budget", "16"]
    assert main(common + ["--method", "ar", "--dtype", "float32"]) == 0
    ar = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(common + ["--method", "treegraft", "--scheduler", str(art), "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ar
    # Fitted on float32 costs: never applied silently in another precision (another cost profile).
    assert main(common + ["--method", "treegraft", "--scheduler", str(art), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "fitted for the cost profile" in err and "float32" in err and "bfloat16" in err
    # The artifact belongs to this pair: with the roles swapped it is refused.
    swapped = ["generate", "--target", pair[1], "--middle", pair[0], "--prompt", "x", "--method", "treegraft",
               "--scheduler", str(art)]
    assert main(swapped) == 2
    assert "fitted for target/middle pair" in capsys.readouterr().err
    assert main(["fit", "--data", str(tmp_path / "nothing"), "--out", str(art)]) == 2
    assert "not a `treegraft collect` output folder" in capsys.readouterr().err
