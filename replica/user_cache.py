"""Where builds made on this machine (C kernels, the compiled planner) are kept."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """Per user, so replicas, Ray workers and test runs of one user share a build."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slos-serve"
