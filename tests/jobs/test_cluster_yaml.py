"""cluster.yaml is a valid Ray cluster-launcher config and is sized for the engine it is meant to run."""

import copy
import json
import os
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from actors.resources import Resources

CLUSTER_YAML = Path(__file__).parents[2] / "cluster.yaml"
SCHEMA = Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json"


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_matches_rays_schema(config):
    jsonschema.validate(config, json.loads(SCHEMA.read_text()))
    # What `ray up` does: fill in the provider's defaults, then Ray's own validation.
    validate_config(prepare_config(copy.deepcopy(config)))


def test_schema_rejects_a_broken_config(config):
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(SCHEMA.read_text()))


def test_a_gpu_node_holds_a_tp4_target_and_the_middle_drafter(config):
    res = Resources(tp=4)
    gpu_nodes = [t["resources"] for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    need_gpus = res.tp * res.target_gpus + res.middle_gpus
    need_cpus = res.tp * res.target_cpus + res.middle_cpus + res.ngram_cpus + res.coordinator_cpus
    assert any(n["GPU"] >= need_gpus and n["CPU"] >= need_cpus for n in gpu_nodes)
    assert any("pip install" in c and "treegraft-dist" in c for c in config["setup_commands"])
