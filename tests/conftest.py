import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs seconds): 2 CPUs, 4 fake GPUs for
    placement, a small object store."""
    import ray

    ray.init(num_cpus=2, num_gpus=4, object_store_memory=200 * 1024**2, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()
