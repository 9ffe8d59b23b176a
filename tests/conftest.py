import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """The local Ray cluster of a test module: 2 CPUs, 4 fake GPUs for placement, a small object store. It is
    shut down after the module, so that tests starting their own cluster (`ray start`, test_sweep.py) do not
    compete with an idle one."""
    import ray

    ray.init(num_cpus=2, num_gpus=4, object_store_memory=200 * 1024**2, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def fresh_choice(monkeypatch):
    """The CPU kernel choices (compact, packed) made afresh in the test and forgotten after it; the test may set
    their environment through the monkeypatch it gets."""
    from treegraft_dist.models import compact, kernels

    compact.choice.cache_clear()
    kernels.choice.cache_clear()
    yield monkeypatch
    compact.choice.cache_clear()
    kernels.choice.cache_clear()
