"""deploy/cluster-gpu.yaml is a valid Ray cluster launcher config that serves from the checkout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.autoscaler._private.util import validate_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "cluster-gpu.yaml").read_text())
    return config


def test_passes_the_launchers_own_validation(launcher: dict[str, Any]) -> None:
    validate_config(launcher)


def test_runs_the_tested_ray_in_the_cuda_image(launcher: dict[str, Any]) -> None:
    image = launcher["docker"]["image"]
    version = image.removeprefix("rayproject/ray:").removesuffix("-py311-gpu")
    assert image == f"rayproject/ray:{version}-py311-gpu"
    assert version.split(".")[:2] == ray.__version__.split(".")[:2]


def test_has_a_head_and_gpu_workers(launcher: dict[str, Any]) -> None:
    types = launcher["available_node_types"]
    workers = [t for name, t in types.items() if name != launcher["head_node_type"]]
    assert workers
    assert all(w["min_workers"] >= 1 for w in workers)
    assert all(w["node_config"]["InstanceType"].startswith(("p4d.", "p5.")) for w in workers)


def test_ray_starts_inside_the_synced_checkout(launcher: dict[str, Any]) -> None:
    """The serve configs' relative profile paths resolve against the directory Ray starts in."""
    (checkout,) = [remote for remote, local in launcher["file_mounts"].items() if local == "."]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in launcher[key] if "ray start" in c]
        assert start.startswith(f"cd {checkout} &&")
    assert any(checkout.replace("~", "$HOME") in c for c in launcher["setup_commands"])
