"""Shared fixtures: the shipped demo model pair, and the `gpu` marker's skip rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"

# No model hub is reachable: every load must come from a local folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def demo_dir() -> Path:
    """The demo pair's folder; SLOS_DEMO_DIR overrides it (e.g. a retrained pair)."""
    override = os.environ.get("SLOS_DEMO_DIR")
    return Path(override) if override else ROOT / "deploy" / "models"


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return demo_dir() / "demo-target"


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    return demo_dir() / "demo-draft"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
