"""`python -m jobs.bench.step` on CPU, tiny sizes: one verification step broken down by operator, beside
transformers' generate."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_the_step_breakdown_runs_and_compares_with_generate():
    done = subprocess.run([sys.executable, "-m", "jobs.bench.step", "--device", "cpu", "--tiny", "--tokens", "6",
                           "--repeats", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TargetVerifier.step" in done.stdout and "transformers generate" in done.stdout
    assert "10 ar steps by operator" in done.stdout
