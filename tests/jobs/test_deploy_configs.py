"""serve.yaml and the KubeRay RayService sample deploy the Serve application: both match their schemas (Ray
Serve's own config schema; for the RayService custom resource, the KubeRay v1 fields the sample uses), name
arguments the application takes, and ask for the GPUs its engine places; cluster.yaml deploys serve.yaml."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from actors.resources import Resources
from jobs.serve import SERVER_ARGS, app_builder

REPO = Path(__file__).resolve().parents[2]
ARGS = set(SERVER_ARGS)

_CONTAINERS = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["name", "image"],
    "properties": {"name": {"type": "string"}, "image": {"type": "string"}, "env": {"type": "array"},
                   "resources": {"type": "object", "properties": {
                       "limits": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
                       "requests": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}}},
                   "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"]}}}}}
_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"], "properties": {"containers": _CONTAINERS}}}}
_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
# The KubeRay v1 RayService fields the sample uses, as the operator's CRD declares them (ray.io/v1).
RAYSERVICE_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["serveConfigV2", "rayClusterConfig"], "properties": {
            "serveConfigV2": {"type": "string"},
            "serviceUnhealthySecondThreshold": {"type": "integer"},
            "deploymentUnhealthySecondThreshold": {"type": "integer"},
            "rayClusterConfig": {"type": "object", "required": ["headGroupSpec"], "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"], "properties": {
                    "rayStartParams": _START_PARAMS, "template": _TEMPLATE}},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "rayStartParams", "template"], "properties": {
                        "groupName": {"type": "string"}, "replicas": {"type": "integer"},
                        "minReplicas": {"type": "integer"}, "maxReplicas": {"type": "integer"},
                        "rayStartParams": _START_PARAMS, "template": _TEMPLATE}}}}}}},
    },
}


def _app(config: dict) -> dict:
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "jobs.serve:app_builder" and app["route_prefix"] == "/"
    assert set(app["args"]) <= ARGS, set(app["args"]) - ARGS
    app_builder(app["args"])  # the builder takes them
    return app


def test_serve_yaml_matches_serves_schema_and_the_application():
    config = yaml.safe_load((REPO / "serve.yaml").read_text())
    app = _app(config)
    assert app["args"]["target"].startswith("embedded:")  # runs anywhere, CPU included
    broken = copy.deepcopy(config)
    broken["applications"][0]["route_prefix"] = 5
    with pytest.raises(Exception, match="route_prefix"):
        ServeDeploySchema.model_validate(broken)
    with pytest.raises(ValueError, match=r"unknown serve args \['targte'\]"):
        app_builder({"targte": "x"})


def test_rayservice_sample_matches_its_schema_and_holds_the_engine():
    sample = yaml.safe_load((REPO / "jobs" / "k8s" / "rayservice.yaml").read_text())
    jsonschema.validate(sample, RAYSERVICE_SCHEMA)
    app = _app(yaml.safe_load(sample["spec"]["serveConfigV2"]))
    res = Resources(tp=app["args"]["tp"])
    need = res.tp * res.target_gpus + res.middle_gpus  # the target group and the middle drafter, one node
    workers = sample["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = [int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for w in workers
            for c in w["template"]["spec"]["containers"]]
    assert max(gpus) >= need
    broken = copy.deepcopy(sample)
    del broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYSERVICE_SCHEMA)


def test_cluster_yaml_deploys_serve_yaml():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    assert any("serve deploy serve.yaml" in c for c in config["head_start_ray_commands"])
