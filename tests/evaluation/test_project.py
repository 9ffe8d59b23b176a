"""`treegraft project`: the shipped trajectories priced with a cost profile, per benchmark and method, every
figure labelled as projected; projections follow the costs; bad input is one line."""

import dataclasses
import json

import pytest

from jobs.cli import main
from treegraft_dist.decoding.costs import CostModel
from treegraft_dist.evaluation.projection import LABEL, MEAN, METHODS, Profile, project, read_profiles, run
from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
from treegraft_dist.scheduling.collect import read_trajectories
from treegraft_dist.scheduling.device import fit_for_device, shipped_trajectories

FAST = {"value_fit": {"epochs": 3}, "scheduler_fit": {"epochs": 3}}
HELD_IN = ["gsm8k", "humaneval", "alpaca", "qa", "sum"]
# GPU-like: a tree of any size costs about one pass; the middle drafter a fraction of it.
GPU = CostModel("gpu-like", 0.9, 0.3, {1: 6.0, 16: 6.5, 128: 8.0}, {1: 20.0, 8: 20.5, 16: 21.0, 32: 22.0, 64: 24.0})


@pytest.fixture(scope="module")
def traj():
    return read_trajectories(shipped_trajectories((DEFAULT_TARGET, DEFAULT_MIDDLE)))


@pytest.fixture(scope="module")
def scheduler(traj, tmp_path_factory):
    return fit_for_device(traj, GPU, "gpu-like", tmp_path_factory.mktemp("fit") / "s.npz", log=str, **FAST)[0]


def by(rows, method, benchmark=MEAN):
    return next(r for r in rows if r["method"] == method and r["benchmark"] == benchmark)


def test_every_method_and_held_in_benchmark_projected_and_labelled(traj, tmp_path):
    profile = tmp_path / "gpu--costs.json"
    profile.write_text(json.dumps(GPU.to_dict()))
    result = run(traj, read_profiles(profile), tmp_path / "out", "shipped", log=str, **FAST)
    rows = result.rows
    assert {r["method"] for r in rows} == set(METHODS)
    assert [r["benchmark"] for r in rows if r["method"] == "ar"] == HELD_IN + [MEAN]  # mt_bench is never collected
    assert all(r["basis"] == LABEL and r["profile"] == "gpu" for r in rows)
    assert all(by(rows, "ar", b)["speedup"] == 1.0 for b in HELD_IN)
    assert by(rows, "ar")["tokens_per_s"] == pytest.approx(1e3 / 20.0)
    assert by(rows, "all-mid")["middle_calls_per_round"] == 5 and by(rows, "all-small")["middle_calls_per_round"] == 0
    # No scheduler does better than the oracle at its budget and call cap.
    for b in HELD_IN:
        assert by(rows, "oracle", b)["tokens_per_s"] >= by(rows, "treegraft", b)["tokens_per_s"] - 1e-9
    md = (tmp_path / "out" / "projection.md").read_text()
    assert md.startswith(f"# Speedups {LABEL}") and f"| method ({LABEL}) |" in md and "mt_bench" in md
    assert "| all-mid |" in md and "gsm8k speedup" in md
    csv = (tmp_path / "out" / "projection.csv").read_text().splitlines()
    assert csv[0].startswith("profile,method,benchmark") and len(csv) == 1 + len(rows)
    assert "projected_tokens_per_s" in csv[0] and "projected_speedup" in csv[0] and csv[1].endswith(LABEL)
    assert (tmp_path / "out" / "projection--gpu.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "scheduler--gpu.npz").is_file()


def test_projections_follow_the_costs(traj, scheduler):
    base = project(traj, GPU, scheduler)
    cheap_middle = dataclasses.replace(GPU, middle_ms={k: v / 4 for k, v in GPU.middle_ms.items()})
    cheaper = project(traj, cheap_middle, scheduler)
    for b in HELD_IN + [MEAN]:
        assert by(cheaper, "all-mid", b)["tokens_per_s"] > by(base, "all-mid", b)["tokens_per_s"]
        assert by(cheaper, "all-small", b)["tokens_per_s"] == by(base, "all-small", b)["tokens_per_s"]
    # On a CPU-like profile a big tree costs several passes: all-small's budget follows the device down.
    cpu_like = dataclasses.replace(GPU, verify_ms={1: 20.0, 8: 45.0, 16: 80.0, 32: 150.0, 64: 300.0})
    assert by(project(traj, cpu_like, scheduler), "all-small")["budget"] < by(base, "all-small")["budget"]


def test_a_gpu_check_profile_gives_its_pair_and_each_proxy(tmp_path):
    path = tmp_path / "profile.json"
    proxy = {**dataclasses.replace(GPU, device="gpu (70B proxy)").to_dict(), "note": "scaled to 80 layers"}
    path.write_text(json.dumps({"name": "pair on gpu", **GPU.to_dict(), "profile_key": "k", "check": {},
                                "proxies": {"llama-3-70b proxy": proxy}}))
    assert read_profiles(path) == [Profile("pair on gpu", GPU, "", "k"),
                                   Profile("llama-3-70b proxy", CostModel.from_dict(proxy), "scaled to 80 layers")]


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"device": "x"}', "no cost model"),
    ('{"device": "x", "verify_ms": {"1": 2}}', "not a cost model"),
    (json.dumps({**GPU.to_dict(), "verify_ms": {"8": 3.0}}), "tree size 1"),
    (json.dumps({"proxies": [1]}), "'proxies' must map"),
])
def test_bad_profiles_are_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert main(["project", "--profile", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("treegraft: error:") and needle in err[0]


def test_bad_trajectories_are_one_line(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(GPU.to_dict()))
    assert main(["project", "--profile", str(path), "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a `treegraft collect` output folder" in err[0]
