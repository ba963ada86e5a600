"""cluster.yaml: valid for Ray's cluster launcher (its JSON schema, and Ray's own config checks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
GPU_TYPES = ("g5.", "p4d.", "p5.", "g6.", "p3.")


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_cluster_yaml_validates_against_rays_schema(config, schema):
    jsonschema.validate(config, schema)


def test_rays_own_validation_accepts_it(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    full = prepare_config(copy.deepcopy(config))  # merged with the AWS defaults, as `ray up` does
    validate_config(full)
    assert full["docker"]["image"] == config["docker"]["image"]


def test_schema_check_catches_a_broken_config(config, schema):
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu.g5"]["min_wrokers"] = 1  # a typo the schema must refuse
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    del bad["available_node_types"]["gpu.g5"]["min_wrokers"]
    del bad["provider"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_gpu_workers_install_the_project_with_its_gpu_extra(config):
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu = [t for t in types.values() if t["node_config"]["InstanceType"].startswith(GPU_TYPES)]
    assert gpu and sum(t.get("min_workers", 0) for t in gpu) >= 2, "no multi-node GPU workers"
    setup = config["setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if c.strip().startswith("pip install torch"))
    project_at = next(i for i, c in enumerate(setup) if "disco-ray[gpu]" in c)
    assert torch_at < project_at
    assert "." in config["file_mounts"].values()
    assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])
    assert ".venv" in config["rsync_exclude"]


def test_image_is_pinned_to_the_ray_version_and_nothing_listens_on_every_interface(config):
    """Issue 15: no `latest` image (cluster and driver must agree on Ray), token auth on every
    node, the dashboard only on the head's loopback (reached by port forwarding)."""
    import re

    pin = re.search(r'"ray\[default\]>=([0-9.]+),<', (ROOT / "pyproject.toml").read_text()).group(1)
    assert config["docker"]["image"].startswith(f"rayproject/ray:{pin}.0-"), config["docker"]["image"]
    text = (ROOT / "cluster.yaml").read_text()
    assert "0.0.0.0" not in text and "latest-" not in config["docker"]["image"]
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert "~/.ray/auth_token" in config["file_mounts"]


def test_ami_and_torch_are_pinned(config):
    """Issue 30: every node type boots one concrete AMI id (no `latest_dlami`), and torch is pinned
    to the version scripts/setup.sh's GPU path installs, so `ray up` builds the same nodes each time."""
    import re

    amis = {t["node_config"]["ImageId"] for t in config["available_node_types"].values()}
    assert len(amis) == 1 and re.fullmatch(r"ami-[0-9a-f]{8,17}", amis.pop()), amis
    assert config["provider"]["region"] == "us-west-2"  # the region the AMI id belongs to
    torch = [c.split() for c in config["setup_commands"] if c.strip().startswith("pip install torch")]
    assert len(torch) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", torch[0][2]), torch
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    gpu_path = setup[setup.index("nvidia-smi >/dev/null") : setup.index("else")]
    assert f'"{torch[0][2]}"' in gpu_path, "cluster.yaml and setup.sh's GPU path pin different torch"
