"""cluster.yaml: valid against the launcher's JSON schema shipped inside the ray package, accepted
by the local provider's own config preparation, starting a head with the GPU, the cores and a
loopback-only dashboard, and GPU workers that join it with the cluster's token."""
from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def _ray_start_flags(cfg: dict, key: str = "head_start_ray_commands") -> dict[str, str]:
    cmd = next(c for c in cfg[key] if "ray start" in c)
    words = shlex.split(cmd.split(";")[-1])
    assert ("--head" in words) == (key == "head_start_ray_commands"), cmd
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def test_cluster_yaml_matches_the_launcher_schema(cfg, schema):
    jsonschema.validate(cfg, schema)


def test_the_schema_check_has_teeth(cfg, schema):
    bad = copy.deepcopy(cfg)
    bad["head_start_ray_command"] = bad.pop("head_start_ray_commands")  # a typo'd key
    with pytest.raises(jsonschema.ValidationError, match="head_start_ray_command"):
        jsonschema.validate(bad, schema)


def test_local_provider_prepares_the_head_and_its_workers(cfg):
    from ray.autoscaler._private.local.config import prepare_local

    prepared, _ = prepare_local(cfg)
    (node_type,) = prepared["available_node_types"].values()
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["head_ip"]
    assert node_type["max_workers"] == len(cfg["provider"]["worker_ips"]) >= 1


def test_workers_join_the_head_with_their_gpus_and_the_clusters_token(cfg):
    flags = _ray_start_flags(cfg, "worker_start_ray_commands")
    head = _ray_start_flags(cfg)
    assert flags["address"] == f"$RAY_HEAD_IP:{head['port']}"
    assert int(flags["num-gpus"]) >= 1 and int(flags["num-cpus"]) >= 3
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_head_declares_the_gpu_and_cores_and_binds_the_dashboard_to_loopback(cfg):
    flags = _ray_start_flags(cfg)
    assert int(flags["num-gpus"]) >= 1
    assert int(flags["num-cpus"]) >= 3  # GPU executor + CPU executor threads + coordinator/driver
    assert flags["dashboard-host"] == "127.0.0.1"
    assert int(flags["metrics-export-port"]) > 0


def test_setup_installs_this_project(cfg):
    assert "." in cfg["file_mounts"].values()
    assert any("pip install -e" in c and "powerinfer-ray" in c for c in cfg["setup_commands"])
