"""The perf profile a cluster's replicas plan with, checked against their configuration."""

from __future__ import annotations

from pathlib import Path

from cluster.config import ClusterConfig
from replica.perf_model import PerfModel
from replica.profiles import CPU_PROFILE, PROFILES

DEFAULT_PROFILE = PROFILES / f"{CPU_PROFILE}.json"


def cluster_profile(config: ClusterConfig) -> PerfModel:
    """The profile the replicas plan with; one made for another tensor-parallel degree would
    price every step wrong (the all-reduces, each rank's share of the work), so it is refused."""
    path = Path(config.profile) if config.profile is not None else DEFAULT_PROFILE
    if not path.is_file():
        raise ValueError(f"perf profile {str(path)!r} does not exist (set `profile`)")
    perf = PerfModel.load(path)
    size = config.tensor_parallel_size
    if perf.tp != size:
        raise ValueError(
            f"perf profile {str(path)!r} is for tensor parallelism {perf.tp}, but the replicas "
            f"run tensor_parallel_size {size}: set `profile` to one made for {size} (`slos-serve "
            f"profile --tensor-parallel {size}`; deploy/profiles/cpu-demo-tp2.json is the CPU "
            f"demo pair's at 2)"
        )
    return perf
