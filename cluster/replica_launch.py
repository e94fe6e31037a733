"""Starting a replica actor, by the launcher at the start and by the autoscaling controller.

Each replica is named for its slot (`replica_name`), so whoever needs it finds it by name;
a GPU replica gets its own placement group, named the same.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorAlreadyExistsError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from cluster.names import replica_name
from cluster.replica_actor import ReplicaActor, rank_resources

NAME_WAIT_S = 10.0
"""How long a start waits for its slot's name: Ray frees the name of an actor just stopped (a
replica the autoscaler stopped, a cluster just shut down) a moment after it dies."""


async def start_replica(
    config: ClusterConfig, index: int, namespace: str | None, detached: bool
) -> tuple[ActorHandle, PlacementGroup | None]:
    """Replica `index` and its placement group, once the group is placed (the actor then
    loads its model: await its `info` to know it is up). Ray restarts it when it dies. A
    group waits for its GPUs as long as it takes: on a cluster that adds nodes on demand
    (KubeRay's autoscaler) they come."""
    lifetime: dict[str, Any] = {"lifetime": "detached"} if detached else {}
    group = placement_group_for(config, index, lifetime)
    try:
        if group is not None:
            await group.ready()
        cpus, gpus = rank_resources(config)
        deadline = time.monotonic() + NAME_WAIT_S
        while True:
            try:
                actor = start_actor(
                    ReplicaActor,
                    index,
                    config,
                    namespace,
                    name=replica_name(index),
                    namespace=namespace,
                    max_restarts=-1,
                    num_cpus=cpus,
                    num_gpus=gpus,
                    **lifetime,
                    **_in_group(group),
                )
                break
            except ActorAlreadyExistsError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    except BaseException:  # cancelled, or the name is still held: the group is ours to free
        if group is not None:
            remove_placement_group(group)
        raise
    return actor, group


def placement_group_for(
    config: ClusterConfig, index: int, lifetime: dict[str, Any]
) -> PlacementGroup | None:
    """A GPU replica gets its own placement group, one bundle per tensor-parallel rank on one
    node, so its devices are reserved together (and stay reserved across restarts); the
    replica actor is rank 0, in the first bundle. CPU replicas need none. The group is named
    for its replica and lives as long as the replica may: a detached replica in a group its
    launcher owned would die with the launcher."""
    if config.num_gpus_per_replica <= 0:
        return None
    cpus, gpus = rank_resources(config)
    return placement_group(
        [{"CPU": cpus, "GPU": gpus}] * config.tensor_parallel_size,
        strategy="STRICT_PACK",
        name=replica_name(index),
        **lifetime,
    )


def _in_group(group: PlacementGroup | None) -> dict[str, Any]:
    if group is None:
        return {}
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return {"scheduling_strategy": strategy}


def start_actor(cls: type, *args: object, **options: Any) -> Any:
    """`cls` as a Ray actor with `options` (typed Any: Ray's stubs do not know the methods)."""
    return ray.remote(cls).options(**options).remote(*args)
