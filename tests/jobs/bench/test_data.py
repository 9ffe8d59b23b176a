"""`python -m jobs.bench.data` on the shipped trajectories: a learning curve on fixed held-out prompts, and a clear
refusal where the prompts cannot be split as asked."""

import csv
import subprocess
import sys
from pathlib import Path

from treegraft_dist.scheduling.device import SHIPPED_TRAJECTORIES

ROOT = Path(__file__).parents[3]
DATA = next(iter(SHIPPED_TRAJECTORIES.values()))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.bench.data", "--data", str(DATA), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_curve_fits_on_more_prompts_and_never_beats_the_oracle(tmp_path):
    out = tmp_path / "curve.csv"
    done = run("--budget", "4", "--heldout", "8", "--train", "3,12", "--seeds", "0,1", "--history", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| signals | 3 |" in done.stdout and "| signals | 12 |" in done.stdout
    assert "| signals + history | 12 |" in done.stdout and "one per prompt" in done.stdout
    rows = [r for r in csv.DictReader(out.open()) if r["inputs"] == "signals"]
    assert len(rows) == 4
    for r in rows:
        assert 0 < float(r["planner_tok_s"]) <= float(r["oracle_tok_s"]) * (1 + 1e-9)
        assert 0 < float(r["fixed_of_oracle"]) <= 1 + 1e-9
    for seed in "01":  # same held-out rounds for both sizes, more train rounds for more prompts
        small, big = (r for r in rows if r["seed"] == seed)
        assert small["heldout_rounds"] == big["heldout_rounds"] and small["oracle_tok_s"] == big["oracle_tok_s"]
        assert int(big["train_rounds"]) > int(small["train_rounds"])


def test_asking_for_more_prompts_than_were_collected_says_so():
    done = run("--heldout", "30", "--train", "30")
    assert done.returncode != 0 and "prompts collected" in done.stderr
    done = run("--budget", "5")
    assert done.returncode != 0 and "was not recorded" in done.stderr
    done = run("--costs", "/nonexistent/costs.json")
    assert done.returncode != 0 and "no such file" in done.stderr and "Traceback" not in done.stderr

