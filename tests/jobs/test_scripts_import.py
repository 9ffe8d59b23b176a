"""Every script under jobs/ imports against the package as it is now: a module moved or renamed in
treegraft_dist breaks a benchmark script at once, not when someone next runs it."""

import importlib.util
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parents[2] / "jobs"
SCRIPTS = sorted(p for p in JOBS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(JOBS))  # as when run as a script: its siblings import by name
    name = f"jobs_import_check_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)  # its imports run; its work does not (scripts run it under __main__)
    assert module.__doc__, f"{script.name} says nothing of what it measures or does"
