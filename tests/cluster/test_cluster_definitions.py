"""The cluster definitions and the job runtime env are what they claim: the AWS cluster-launcher
YAML passes Ray's own schema, the KubeRay manifests parse, every file they name exists, their
GPUs match the raylm config they launch, versions are the tested ones, and token auth is on."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from raylm.config import load_config
from raylm.parallel.planner.plan import run_plan
from raylm.launch.submit import check_job_config

REPO = Path(__file__).resolve().parents[2]
AWS = REPO / "cluster" / "aws-a100.yaml"
KUBERAY = REPO / "cluster" / "kuberay"
A100X16 = "configs/opt-1.3b-a100x16.yaml"
PYTHON_TAG = f"py{sys.version_info.major}{sys.version_info.minor}"
TORCH = torch.__version__.split("+")[0]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def gpu_bounds(node_groups: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(fewest, most) GPUs of a cluster from its worker groups' (min nodes, max nodes, GPUs per node)."""
    return sum(lo * g for lo, _, g in node_groups), sum(hi * g for _, hi, g in node_groups)


def assert_fits(config_path: str, fewest: int, most: int) -> None:
    """The run fills the cluster at its largest; an elastic run's smallest size fits its smallest."""
    p = load_config(REPO / config_path).parallel
    assert p.use_gpu, f"{config_path}: a GPU cluster launches a config with parallel.use_gpu"
    assert most == p.num_workers, f"{config_path}: {p.num_workers} workers, the cluster has up to {most} GPUs"
    assert fewest <= (p.min_workers or p.num_workers), f"{config_path}: the cluster keeps {fewest} GPUs"


def test_aws_cluster_validates_against_rays_schema_and_fits_its_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load(AWS)
    prepared = prepare_config(raw)
    validate_config(prepared)  # Ray's JSON schema, shipped in the wheel; raises on any error
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0
    workers = [t for name, t in prepared["available_node_types"].items() if name != prepared["head_node_type"]]
    assert all(t["node_config"]["InstanceType"] == "p4de.24xlarge" for t in workers)
    assert all(ni["InterfaceType"] == "efa" for t in workers for ni in t["node_config"]["NetworkInterfaces"])
    assert_fits(A100X16, *gpu_bounds([(t["min_workers"], t["max_workers"], t["resources"]["GPU"]) for t in workers]))
    assert prepared["max_workers"] == sum(t["max_workers"] for t in workers)
    assert raw["provider"]["use_internal_ips"] is True


def test_aws_cluster_pins_the_tested_versions_and_keeps_auth_on_and_the_dashboard_private():
    raw = load(AWS)
    assert raw["docker"]["image"] == f"rayproject/ray:{ray.__version__}-{PYTHON_TAG}-gpu"
    assert f'"torch=={TORCH}"' in " ".join(raw["setup_commands"])
    assert (REPO / raw["file_mounts"]["/home/ray/raylm"]).resolve() == REPO  # `ray up` from the repo root
    assert raw["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    starts = raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert "--dashboard-host=127.0.0.1" in " ".join(raw["head_start_ray_commands"])
    assert "0.0.0.0" not in AWS.read_text()


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob-pretrain.yaml"])
def test_kuberay_manifests_parse_and_fit_their_config(manifest):
    doc = load(KUBERAY / manifest)
    assert doc["apiVersion"] == "ray.io/v1"
    if doc["kind"] == "RayJob":
        spec = doc["spec"]["rayClusterSpec"]
        assert doc["spec"]["shutdownAfterJobFinishes"] is True
        command = doc["spec"]["entrypoint"].split("&&")[-1]
        python, script, config, *overrides = shlex.split(command)
        assert (python, script, config) == ("python", "jobs/pretrain.py", A100X16)
        assert (REPO / script).is_file() and (REPO / config).is_file()
    else:
        assert doc["kind"] == "RayCluster"
        spec = doc["spec"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["authOptions"] == {"mode": "token"}
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = []
    for group in spec["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == 8
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        groups.append((group["minReplicas"], group["maxReplicas"], gpus))
    assert_fits(A100X16, *gpu_bounds(groups))
    images = {c["image"] for pod in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
              for c in pod["template"]["spec"]["containers"]}
    assert images == {f"REGISTRY/raylm:{ray.__version__}-torch{TORCH}"}  # what the Dockerfile builds


def test_kuberay_image_recipe_pins_the_tested_versions():
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray.__version__}-{PYTHON_TAG}-gpu" in dockerfile
    assert f'"torch=={TORCH}"' in dockerfile
    assert "raylm:" + f"{ray.__version__}-torch{TORCH}" in dockerfile


def test_a100x16_config_is_the_plans_recommendation_with_job_ready_paths(tmp_path):
    cfg = load_config(REPO / A100X16)
    check_job_config(cfg)  # s3:// data and storage: usable from a job
    # The command its header names, run again: the parallel block is unchanged.
    run_plan(model="1.3b", gpus=16, gpus_per_node=8, gpu_memory="80GB", seq_len=2048,
             global_batch_tokens=1048576, micro_batch_size=4, output=str(tmp_path / "parallel.yaml"))
    planned = load(tmp_path / "parallel.yaml")["parallel"]
    assert load(REPO / A100X16)["parallel"] == planned
    assert cfg.model.size == "1.3b" and cfg.train.global_batch_tokens == 1048576 and cfg.train.micro_batch_size == 4


def test_job_runtime_env_uploads_the_checkout_without_bulk_or_secrets():
    env = load(REPO / "jobs" / "runtime_env.yaml")
    assert env["working_dir"] == "."
    assert {"/.git/", "/.venv/", "/runs/", "/data/"} <= set(env["excludes"])
    # Anchored: an unanchored "data/" would also drop the raylm/data package.
    assert not [p for p in env["excludes"] if re.fullmatch(r"(data|runs)/?", p)]
    assert not [n for n in env["env_vars"] if re.search("SECRET|TOKEN|PASSWORD|ACCESS_KEY", n)]
    for entry in ("pretrain.py", "prepare.py"):
        assert (REPO / "jobs" / entry).is_file()
