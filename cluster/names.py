"""The Ray names of a cluster's actors: how a restarted front door, a replica and the
controller find one another."""

from __future__ import annotations

import contextlib

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, get_placement_group

CONTROLLER_NAME = "slos-serve-controller"
NAMESPACE = "slos-serve"
"""The Ray namespace of a detached cluster's controller and replicas: a fixed one, so a front
door that Ray Serve restarts finds it by name."""


def replica_name(index: int) -> str:
    return f"slos-serve-replica-{index}"


def slot_occupants(
    index: int, namespace: str | None, grouped: bool
) -> tuple[ActorHandle | None, PlacementGroup | None]:
    """The replica running under slot `index`'s name, and with `grouped` (GPU replicas) its
    placement group: what to adopt or stop when no handle says."""
    actor = group = None
    with contextlib.suppress(ValueError):
        actor = ray.get_actor(replica_name(index), namespace=namespace)
    if grouped:
        with contextlib.suppress(ValueError):
            group = get_placement_group(replica_name(index))
    return actor, group
