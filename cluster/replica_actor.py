"""The replica as a Ray async actor: a `ReplicaCore` over an `Engine` of the configured pair.

Ray restarts it when it dies (max_restarts); a restarted replica is a new incarnation that
holds nothing, and the controller rebuilds its mirror from its (empty) snapshot.

With `tensor_parallel_size` > 1 the replica actor is rank 0 of a tensor-parallel group
(replica.tensor_parallel) and starts the other ranks as `TensorParallelWorker` actors it owns,
in the bundles of its placement group. A worker that dies takes its replica down with it
(the replica's process exits, Ray restarts it with a new group), so a broken group never
hangs a replica's requests: they are resumed as after any replica restart.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from typing import Any

import ray
import torch

from cluster.config import ClusterConfig
from cluster.logs import configure_logging
from cluster.messages import ReplicaSnapshot, StepReport, StreamItem
from cluster.names import CONTROLLER_NAME
from cluster.profile import cluster_profile
from cluster.replica_core import ReplicaCore
from replica.batch import BatchPlan
from replica.device import compute_device
from replica.engine import Engine, ProposerKind
from replica.model_runner import ModelRunner
from replica.model_source import model_dir
from replica.planner.adaserve import AdaServeTrees
from replica.planner.specserve import SpecServeLengths
from replica.request import Request
from replica.tensor_parallel import TensorParallel, join

TP_JOIN_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the rest of its group to be scheduled and start."""

log = logging.getLogger(__name__)


def engine_device(config: ClusterConfig) -> tuple[torch.device, torch.dtype]:
    """Where the replica computes: the GPU Ray gave it (CUDA_VISIBLE_DEVICES) when it asked for
    one, else the CPU."""
    gpus = config.num_gpus_per_replica
    return compute_device(gpus > 0, config.dtype, f"num_gpus_per_replica={gpus:g}")


def rank_resources(config: ClusterConfig) -> tuple[float, float]:
    """(CPUs, GPUs) of each process of a replica: the replica's share split over its ranks."""
    size = config.tensor_parallel_size
    return config.num_cpus_per_replica / size, config.num_gpus_per_replica / size


def worker_name(replica: int, rank: int, owner: int) -> str:
    """Named for its replica, rank and owning process: a restarted replica's new ranks must not
    collide with the old ones Ray is still tearing down."""
    return f"slos-serve-replica-{replica}-rank-{rank}-pid-{owner}"


class TensorParallelWorker:
    """Rank > 0 of a replica's tensor-parallel group: its share of the target model's heads,
    MLP columns, vocabulary and KV cache, computing every batch rank 0 sends."""

    def __init__(self, config: ClusterConfig, rank: int, address: str) -> None:
        configure_logging()
        torch.set_num_threads(max(1, round(rank_resources(config)[0])))
        device, dtype = engine_device(config)
        group = join(rank, config.tensor_parallel_size, address, device, TP_JOIN_TIMEOUT)
        self.runner = ModelRunner(
            model_dir(config.model),
            num_blocks=config.num_kv_blocks,
            dtype=dtype,
            device=device,
            tp=group,
        )

    def serve(self) -> None:
        """Returns only if the group breaks (rank 0 never sends the stop)."""
        self.runner.serve_batches()


def start_group(index: int, config: ClusterConfig) -> tuple[TensorParallel, list[Any]]:
    """Rank 0's side of a replica's tensor-parallel group: the other ranks started beside it
    (in its placement group, one bundle each, on GPUs; on its node otherwise), and the group
    joined once they have, at this node's Ray address."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    device, _ = engine_device(config)
    node = ray.get_runtime_context().get_node_id()
    host = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
    with socket.socket() as probe:
        probe.bind((host, 0))
        address = f"tcp://{host}:{probe.getsockname()[1]}"
    cpus, gpus = rank_resources(config)
    group = get_current_placement_group()
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        placement: Any = NodeAffinitySchedulingStrategy(node, soft=False)
        if group is not None:
            placement = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        actor = ray.remote(TensorParallelWorker).options(
            name=worker_name(index, rank, os.getpid()),
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=placement,
        )
        workers.append(actor.remote(config, rank, address))
    return join(0, config.tensor_parallel_size, address, device, TP_JOIN_TIMEOUT), workers


def build_engine(config: ClusterConfig, tp: TensorParallel | None = None) -> Engine:
    """The engine `config.spec_policy` asks for (a draft model only when it drafts; SpecServe's
    lengths and AdaServe's step times priced by the profile the controller plans with), on the
    replica's device; with `tp`, rank 0's share of the target."""
    device, dtype = engine_device(config)
    draft: str | None = None
    proposer: ProposerKind | None = None
    if config.spec_policy == "ngram":
        proposer = "ngram"
    elif config.loads_draft:
        draft, proposer = config.draft, "draft"
    return Engine.from_dirs(
        config.model,
        draft,
        num_blocks=config.num_kv_blocks,
        dtype=dtype,
        device=device,
        proposer=proposer,
        tp=tp,
        specserve=SpecServeLengths(cluster_profile(config))
        if config.spec_policy == "specserve"
        else None,
        adaserve=AdaServeTrees(cluster_profile(config), config.adaserve)
        if config.spec_policy == "adaserve"
        else None,
        prefix_caching=config.prefix_caching,
    )


def _exit_when_one_ends(serving: list[Any]) -> None:
    """A worker's `serve` ended: its rank is gone and the group with it. Exiting lets Ray
    restart this replica (and, as their owner, drop the other workers)."""
    ready, _ = ray.wait(serving, num_returns=1)
    log.error("replica lost a tensor-parallel rank (%s); restarting", ready)
    os._exit(1)


class ReplicaActor:
    """Methods are the controller's and the clients' view of one replica."""

    def __init__(self, index: int, config: ClusterConfig, namespace: str | None = None) -> None:
        """`namespace`: the controller's Ray namespace (None: this job's)."""
        configure_logging()
        torch.set_num_threads(max(1, round(rank_resources(config)[0])))
        self.index = index
        self.namespace = namespace
        tp, workers = start_group(index, config) if config.tensor_parallel_size > 1 else (None, [])
        self.engine = build_engine(config, tp)
        if workers:
            serving = [w.serve.remote() for w in workers]
            threading.Thread(target=_exit_when_one_ends, args=(serving,), daemon=True).start()
        self.core = ReplicaCore(self.engine, index, self._report)
        self._controller: ray.actor.ActorHandle | None = None

    def _report(self, report: StepReport) -> None:
        """Fire-and-forget: a lost report shows up as a sequence gap at the controller."""
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER_NAME, namespace=self.namespace)
            except ValueError:
                return
        self._controller.report.remote(report)

    async def add_request(self, request: Request, admitted: bool) -> None:
        self.core.start()
        self.core.add_request(request, admitted)

    async def abort(self, request_id: str, reason: str = "") -> None:
        self.core.abort(request_id, reason=reason)

    async def release(self, request_id: str) -> None:
        """The controller binds the request elsewhere (ReplicaCore.abort's `release`)."""
        self.core.abort(request_id, release=True)

    async def set_plan(self, plan: BatchPlan, regraded: Mapping[str, bool] | None = None) -> None:
        self.core.start()
        self.core.set_plan(plan, regraded)

    async def snapshot(self) -> ReplicaSnapshot:
        return self.core.snapshot()

    async def open_work(self) -> tuple[int, int]:
        """What a draining replica still owes its clients (ReplicaCore.open_work)."""
        return self.core.open_work()

    async def health(self) -> str:
        """The incarnation id: a different one means the replica restarted."""
        return self.core.incarnation

    async def info(self) -> tuple[int, int]:
        """(max_model_len, vocab_size) of the served model."""
        return self.engine.max_model_len, self.engine.target.vocab_size

    async def stream(self, request_id: str) -> AsyncIterator[StreamItem]:
        self.core.start()
        async for item in self.core.stream(request_id):
            yield item
