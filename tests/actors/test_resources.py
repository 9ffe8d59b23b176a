"""for_device("cpu"): the model actors run torch on the threads a plain process gets here, whatever share of a
CPU they reserve (Ray sets OMP_NUM_THREADS from it); the coordinator keeps Ray's one thread."""

import os
import subprocess
import sys

import pytest
import ray
import torch
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from actors.engine import DistributedEngine
from actors.resources import for_device


def plain_process_threads() -> int:
    """torch's intra-op threads in a fresh process with no thread settings in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def threads(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: torch.get_num_threads()))


def test_cpu_resources_give_model_actors_the_threads_of_a_plain_process():
    res = for_device("cpu")
    assert res.torch_threads == plain_process_threads()
    assert res.target_cpus < 1 and res.middle_cpus < 1  # placement stays fractional
    assert res.coordinator_cpus <= 0.1 and res.ngram_cpus <= 0.1
    assert for_device("cpu", torch_threads=1).torch_threads == 1  # an explicit setting wins
    assert for_device("cuda").torch_threads is None


@pytest.fixture(scope="module")
def engine(ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    model, tok = tiny_model("llama"), char_tokenizer()
    target = save_tiny(folder / "target", model, tok)
    middle = save_tiny(folder / "middle", perturbed_copy(model, 0.3, 1), tok)
    eng = DistributedEngine(target, middle, resources=for_device("cpu"), dtype="float32")
    yield eng
    eng.shutdown()


def test_a_cpu_engine_runs_its_models_on_a_plain_process_threads_and_its_coordinator_on_one(engine):
    expected = plain_process_threads()
    actors = engine.actors()
    assert threads(actors["target"][0]) == expected
    assert threads(actors["middle"]) == expected
    assert threads(engine.coordinator) == 1
    assert len(engine.generate([5, 6, 7, 8, 5, 6, 7], 6, "all-mid").tokens) == 6


def test_warm_measures_what_first_requests_would_wait_for_once(engine):
    """warm() takes the forward times and the load-sizing pass costs before any request; requests then use
    those measurements (the target's pass count grows by their own passes only)."""
    warm = engine.warm()
    assert warm["t_tgt_ms"] > 0 and warm["t_mid_ms"] > 0
    assert engine.load_state()["pass_ms"] == warm["pass_ms"] and 1 in warm["pass_ms"]
    before = engine.target_passes()[0]
    engine.generate([5, 6, 7, 8], 3, "ar")
    assert engine.target_passes()[0] - before <= 3  # prefill and two steps: nothing measured again
    assert engine.warm() == warm
