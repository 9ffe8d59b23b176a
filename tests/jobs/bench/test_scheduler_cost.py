"""`python -m jobs.bench.scheduler`: the scheduler's cost before a drafting layer, measured on a short run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]
ROWS = ("(a) compute_signals", "(b) LearnedScheduler.decide", "(c) one scheduler call, (a) + (b)",
        "(d) ValuePlanner.decide")


def test_scheduler_benchmark_runs_and_reports_positive_times():
    done = subprocess.run([sys.executable, "-m", "jobs.bench.scheduler", "--calls", "20", "--seed", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for label in ROWS:
        median, p90 = (float(x) for x in next(line for line in lines if line.startswith(label)).split()[-2:])
        assert 0 < median <= p90 < 1e3
    assert "ms target" in done.stdout
