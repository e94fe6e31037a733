"""Fixtures for the deployment artifacts: the Helm chart rendered by the real Helm engine, and
the KubeRay RayService schema to check it against.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "slos-serve"
RAYSERVICE_CRD = ROOT.parent / "shared" / "data" / "kuberay" / "ray.io_rayservices.yaml"
RELEASE = "slos"
NAMESPACE = "serving"

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]


@pytest.fixture(scope="session")
def render() -> Render:
    """Render the chart offline, as `helm install` would, into its Kubernetes objects."""

    def _render(values: dict[str, Any] | None = None) -> list[Manifest]:
        with helm.Chart.load(CHART) as chart:
            files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        objects: list[Manifest] = []
        for path, text in sorted(files.items()):
            if path.endswith("NOTES.txt"):
                continue
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return objects

    return _render


def _forbid_unknown_fields(schema: Any) -> Any:
    """Close every object schema that lists its properties.

    The API server prunes unknown fields silently, so a misspelled field in the chart would be
    dropped without an error; a closed schema turns that into a test failure (like kubectl's
    strict field validation).
    """
    if isinstance(schema, dict):
        closed = {key: _forbid_unknown_fields(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields", False)
        ):
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [_forbid_unknown_fields(item) for item in schema]
    return schema


@pytest.fixture(scope="session")
def rayservice_validator() -> jsonschema.Draft4Validator:
    """Validator for the v1 RayService schema of the KubeRay CRD in ../shared (not in the repo)."""
    if not RAYSERVICE_CRD.exists():
        pytest.skip(f"KubeRay RayService CRD not found at {RAYSERVICE_CRD}")
    crd = yaml.safe_load(RAYSERVICE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _forbid_unknown_fields(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft4Validator(schema)
