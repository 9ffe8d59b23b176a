"""Every benchmark script under jobs/bench/ runs as `python -m jobs.bench.NAME` against the package as it is
now and says what it measures: a module moved or renamed in treegraft_dist breaks a script at once, not when
someone next runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
SCRIPTS = sorted(p.stem for p in (ROOT / "jobs" / "bench").glob("*.py") if p.stem not in ("__init__", "common"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_shows_its_help(name):
    done = subprocess.run([sys.executable, "-m", f"jobs.bench.{name}", "--help"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:") and "--" in done.stdout, done.stdout[:500]
