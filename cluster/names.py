"""The Ray names of a cluster's actors: how a restarted front door, a replica and the
controller find one another."""

from __future__ import annotations

CONTROLLER_NAME = "slos-serve-controller"
NAMESPACE = "slos-serve"
"""The Ray namespace of a detached cluster's controller and replicas: a fixed one, so a front
door that Ray Serve restarts finds it by name."""


def replica_name(index: int) -> str:
    return f"slos-serve-replica-{index}"
