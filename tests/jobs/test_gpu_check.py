"""jobs/gpu_check.py on CPU, tiny sizes: it writes a profile `treegraft project` reads and a report with the
lossless verdicts; out of time it stops early and keeps what it measured."""

import json
import subprocess
import sys
from pathlib import Path

from treegraft_dist.decoding.costs import CostModel
from treegraft_dist.evaluation.projection import read_profiles

SCRIPT = Path(__file__).parents[2] / "jobs" / "gpu_check.py"
QUICK_SIZES = [1, 2, 4, 8]
QUICK_METHODS = {"ar", "all-small", "all-mid", "01001"}


def check(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


def test_quick_check_writes_a_profile_and_a_report(tmp_path):
    done = check(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "profile.json").read_text())
    cost = CostModel.from_dict(data)
    assert sorted(cost.verify_ms) == QUICK_SIZES and sorted(cost.middle_ms) == QUICK_SIZES
    assert cost.ngram_ms > 0 and cost.scheduler_ms > 0
    assert data["check"]["dtype"] == "bfloat16" and data["check"]["torch"] and data["check"]["skipped"] == []
    assert set(data["rounds"]) == QUICK_METHODS
    assert all(r["ms_per_round"] > 0 and set(r["phases_ms_per_round"]) == {"ngram", "middle", "scheduler", "verify",
                                                                          "other"} for r in data["rounds"].values())
    verdicts = data["lossless"]
    assert {r["method"] for r in verdicts["runs"]} == QUICK_METHODS
    assert verdicts["exact"] + verdicts["near-tie"] + verdicts["mismatch"] == len(verdicts["runs"])
    assert verdicts["mismatch"] == 0 and data["sampled"]["repeats"]
    proxy = data["proxies"]["llama-3-70b proxy"]
    assert proxy["layers_measured"] == [2, 6] and proxy["layers"] == 80 and "extrapolated linearly" in proxy["note"]
    report = (tmp_path / "report.md").read_text()
    assert "exact" in report and "near-tie" in report and "mismatch" in report
    assert "## Cost profile: embedded pair" in report and "scaled to 80 layers" in report
    # `treegraft project --profile` reads it as it is: the pair (with its device profile key) and the proxy.
    pair, proxy_profile = read_profiles(tmp_path / "profile.json")
    assert pair.cost == cost and pair.key == data["profile_key"] and proxy_profile.name == "llama-3-70b proxy"


def test_out_of_time_it_stops_and_says_what_was_not_measured(tmp_path):
    done = check(tmp_path, "--time-budget", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "profile.json").read_text())
    assert "verify_ms" not in data and data["lossless"]["runs"] == [] and data["check"]["skipped"]
    assert "Not measured:" in (tmp_path / "report.md").read_text()


def test_a_large_model_is_not_built_without_time_to_measure_it(tmp_path):
    # A 70B-shaped proxy's random initialisation cannot be interrupted by the time budget's alarm: the full
    # check must not start one it has no time left to measure (it overran its budget by 97 s on a CPU).
    import argparse

    import torch

    from jobs import gpu_check

    sizes = gpu_check.Sizes((1,), (1,), 1, 1, ("ar",), 8, 1)
    full = argparse.Namespace(time_budget=gpu_check.BUILD_RESERVE_S - 1, out=str(tmp_path), quick=False)
    check = gpu_check.Check(full, torch.device("cpu"), torch.bfloat16, sizes)
    assert not check.room_to_build("70B proxy, 2 layers")
    assert check.skipped == [f"70B proxy, 2 layers: not built (under {gpu_check.BUILD_RESERVE_S:.0f} s of the "
                             "time budget left)"]
    roomy = gpu_check.Check(argparse.Namespace(**{**vars(full), "time_budget": 600.0}), torch.device("cpu"),
                            torch.bfloat16, sizes)
    assert roomy.room_to_build("70B proxy, 2 layers") and not roomy.skipped

