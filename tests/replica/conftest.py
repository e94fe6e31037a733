"""Fixtures the replica tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runners(target_dir: Path, draft_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    """The demo pair's target and draft, 64 KV blocks each, built once per test module (a
    module that needs other runners defines its own)."""
    return ModelRunner(target_dir, num_blocks=64), ModelRunner(draft_dir, num_blocks=64)
