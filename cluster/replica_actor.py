"""The replica as a Ray async actor: a `ReplicaCore` over an `Engine` of the configured pair.

Ray restarts it when it dies (max_restarts); a restarted replica is a new incarnation that
holds nothing, and the controller rebuilds its mirror from its (empty) snapshot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray
import torch

from cluster.config import ClusterConfig
from cluster.messages import ReplicaSnapshot, StepReport, StreamItem
from cluster.replica_core import ReplicaCore
from replica.batch import BatchPlan
from replica.engine import Engine, ProposerKind
from replica.request import Request

CONTROLLER_NAME = "slos-serve-controller"


def replica_name(index: int) -> str:
    return f"slos-serve-replica-{index}"


def engine_device(config: ClusterConfig) -> tuple[torch.device, torch.dtype]:
    """Where the replica computes: the GPU Ray gave it (CUDA_VISIBLE_DEVICES) when it asked for
    one, else the CPU; `auto` precision is bfloat16 on a GPU and float32 on CPU."""
    device = torch.device("cpu")
    if config.num_gpus_per_replica > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"num_gpus_per_replica={config.num_gpus_per_replica:g}, but torch in this "
                f"replica sees no CUDA device (torch {torch.__version__}: a CPU wheel, or a node "
                "without a GPU driver)"
            )
        device = torch.device("cuda")
    name = config.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, name)


def build_engine(config: ClusterConfig) -> Engine:
    """The engine `config.spec_policy` asks for (a draft model only when it drafts), on the
    replica's device."""
    device, dtype = engine_device(config)
    draft: str | None = None
    proposer: ProposerKind | None = None
    if config.spec_policy == "ngram":
        proposer = "ngram"
    elif config.spec_policy != "none":
        draft, proposer = config.draft, "draft"
    return Engine.from_dirs(
        config.model,
        draft,
        num_blocks=config.num_kv_blocks,
        dtype=dtype,
        device=device,
        proposer=proposer,
    )


class ReplicaActor:
    """Methods are the controller's and the clients' view of one replica."""

    def __init__(self, index: int, config: ClusterConfig) -> None:
        torch.set_num_threads(max(1, round(config.num_cpus_per_replica)))
        self.index = index
        self.engine = build_engine(config)
        self.core = ReplicaCore(self.engine, index, self._report)
        self._controller: ray.actor.ActorHandle | None = None

    def _report(self, report: StepReport) -> None:
        """Fire-and-forget: a lost report shows up as a sequence gap at the controller."""
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER_NAME)
            except ValueError:
                return
        self._controller.report.remote(report)

    async def add_request(self, request: Request, admitted: bool) -> None:
        self.core.start()
        self.core.add_request(request, admitted)

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def set_plan(self, plan: BatchPlan) -> None:
        self.core.start()
        self.core.set_plan(plan)

    async def snapshot(self) -> ReplicaSnapshot:
        return self.core.snapshot()

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
