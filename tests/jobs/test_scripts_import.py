"""Every entry point under jobs/ imports against the package as it is now: a module moved or renamed in
treegraft_dist breaks it at once, not when someone next runs it. (The benchmark scripts: tests/jobs/bench.)"""

import importlib
from pathlib import Path

import pytest

JOBS = Path(__file__).parents[2] / "jobs"
SCRIPTS = sorted(p.stem for p in JOBS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_entry_point_imports(name):
    module = importlib.import_module(f"jobs.{name}")  # its imports run; its work does not (under __main__ only)
    assert module.__doc__, f"jobs/{name}.py says nothing of what it measures or does"
