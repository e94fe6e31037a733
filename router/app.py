"""The Ray Serve application: `serve run` imports `router.app:build_app`.

One ingress deployment replica hosts everything at the door: it launches the cluster, then
serves HTTP through Ray Serve's proxy (FastAPI) and gRPC with its own grpc.aio server on the
same event loop, both over one FrontDoor. One replica, because the door's metrics are counted
where requests pass (a second replica would split the counters between two /metrics views)
and the cluster controller, not the door, is the throughput limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve import Application
from ray.serve.schema import ApplicationStatus
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import cluster
from cluster.handle import SHUTDOWN_TIMEOUT_S, check_launch
from cluster.logs import configure_logging
from replica.request import SLO
from router.auth import ApiKeys
from router.config import FrontDoorConfig
from router.frontdoor import FrontDoor
from router.grpc_server import GrpcServer, start_grpc_server
from router.http import create_app
from router.metrics import FrontDoorMetrics
from router.openai_schema import SchemaContext
from router.tokenizer import TextCodec

logger = logging.getLogger(__name__)

DRAIN_S = 120.0
"""Serve's `graceful_shutdown_timeout_s` for the door: how long a door Serve stops (an update,
a delete) may finish its streams before Serve kills it. An LLM stream at a few tokens a second
runs for minutes, and Serve's default of 20 s cut them off mid-stream without an error. The
Serve config's `deployments:` entry for FrontDoorDeployment overrides it (deploy/README.md)."""
WAIT_LOOP_S = 2.0
"""Serve's default `graceful_shutdown_wait_loop_s`."""
STATUS_TIMEOUT_S = 5.0
"""How long a stopping door waits for Serve's controller to say whether its app stays."""
LEAVE_S = 2 * SHUTDOWN_TIMEOUT_S
"""Kept from the gRPC drain for leaving the cluster after it: the release and stopping the
cluster (`ClusterHandle.shutdown`'s two timeouts)."""


@dataclass(frozen=True)
class DoorFiles:
    """What the door reads from disk itself, checked."""

    codec: TextCodec
    tiers: dict[str, SLO]
    default_slo: SLO
    keys: ApiKeys


def read_door_files(config: FrontDoorConfig) -> DoorFiles:
    """The model's tokenizer and chat template, the tiers (their stages need the tokenizer)
    and the API keys."""
    codec = TextCodec.from_dir(config.cluster.model)
    tiers, default_slo = config.slos(codec)
    return DoorFiles(codec, tiers, default_slo, ApiKeys.load(config.api_keys_file))


def check_files(config: FrontDoorConfig) -> None:
    """Read and check everything the door and the cluster's launch read from disk, starting
    nothing: in a Serve update this runs before Serve stops the running door, so a bad path
    fails the update instead of leaving the app with no door and no cluster."""
    read_door_files(config)
    config.grpc_tls()
    check_launch(config.cluster)


async def build_front_door(
    config: FrontDoorConfig, *, detached: bool = False, drain_s: float = 0.0
) -> tuple[FrontDoor, Any]:
    """Launch (or, `detached`, attach to) the cluster and wrap it; returns the door and the
    cluster handle. What the door reads itself comes first (the launch checks its own files
    first): a bad one stops the start before the cluster, not after every replica loaded its
    model. `drain_s`: how long a running cluster of another config is left to its doors."""
    files = read_door_files(config)
    codec, keys = files.codec, files.keys
    # Built now, off the loop (about a second at a 128k vocabulary): structured output and
    # log-probabilities' bytes need it, and the first such request built it on the loop.
    await asyncio.to_thread(lambda: codec.byte_vocab)
    handle = await cluster.launch(config.cluster, detached=detached, drain_s=drain_s)
    schema = SchemaContext(
        model_name=handle.model_name,
        max_model_len=handle.max_model_len,
        vocab_size=handle.vocab_size,
        default_slo=files.default_slo,
        tiers=files.tiers,
        default_chat_max_tokens=config.default_chat_max_tokens,
        max_request_bytes=int(config.max_request_mb * 2**20),
        tool_parser=config.tool_parser,
        reasoning_parser=config.reasoning_parser,
    )
    metrics = FrontDoorMetrics(handle.model_name, keys.tenant_names)
    door = FrontDoor(handle, codec, schema, keys, metrics)
    return door, handle


class DisconnectOnCancelledReceive:
    """ASGI middleware: a client that leaves is an `http.disconnect`, as Starlette expects.

    When a client disconnects, Ray Serve's proxy cancels the request: the replica's pending
    `receive`, which Serve raises as TaskCancelledError (ray/serve/_private/http_util.py), and
    the Ray tasks the request awaits (the cluster handle makes theirs a CancelledError).
    Starlette's streaming response logged a 60-line "exception was never retrieved" traceback
    for each."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


# The door only parses, tokenizes and relays; the CPUs a config declares go to the model
# replicas (serve-cpu.yaml gives each replica one of a 2-core machine's cores). It runs on the
# head node, whose resource Ray names itself, so its own gRPC server is at a known address
# (the head's port forward, the chart's gRPC Service); HTTP goes through every node's proxy.
HEAD_NODE = {"node:__internal_head__": 0.001}


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    graceful_shutdown_timeout_s=DRAIN_S,
    graceful_shutdown_wait_loop_s=WAIT_LOOP_S,
    ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
)
@serve.ingress()
class FrontDoorDeployment:
    def __init__(self, args: dict[str, Any]) -> None:
        configure_logging()
        self.config = FrontDoorConfig.from_args(args)
        self.tls = self.config.grpc_tls()  # read before the cluster launches
        self.grpc: GrpcServer | None = None
        self.handle: Any = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # Detached: if this door crashes, the cluster keeps its loaded models and the door
        # Serve starts next attaches to it; the crashed door's requests end with its lease.
        drain_s, _ = drain_times()
        door, self.handle = await build_front_door(self.config, detached=True, drain_s=drain_s)
        door.keys.bind_host(self.config.http_host, "HTTP (Ray Serve http_options)")
        if self.config.grpc_port:
            host = door.keys.bind_host(self.config.grpc_host, "gRPC")
            port = self.config.grpc_port
            self.grpc = await start_grpc_server(door, host, port, tls=self.tls)
        app = create_app(door)
        app.add_middleware(DisconnectOnCancelledReceive)
        return app

    async def check_health(self) -> None:
        """Serve restarts a door whose cluster is being stopped under it, or whose controller
        is gone for good (the next door launches a new one)."""
        if self.handle is not None and self.handle.lease_refused:
            raise RuntimeError("the cluster this door served is stopped or gone")

    async def __del__(self) -> None:
        """Serve stops the door (delete, update, health-check restart, shutdown) once its HTTP
        requests drained: its gRPC generations get what is left of the drain, then it leaves
        the cluster, whatever failed before. Unless its app is being deleted it hands the
        cluster over to the next door, which attaches without a reload (same config) or
        replaces it; otherwise it stops the cluster, unless another door holds it. A door
        that crashes never gets here."""
        began, handover = time.monotonic(), False
        try:
            handover = await app_staying()
            if self.grpc is not None:
                drain_s, wait_loop_s = drain_times()
                spent = time.monotonic() - began
                await self.grpc.stop(max(0.0, drain_s - wait_loop_s - spent - LEAVE_S))
        finally:
            if self.handle is not None:
                await self.handle.shutdown(handover=handover)


def drain_times() -> tuple[float, float]:
    """This door's (graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s): Serve kills
    the door the first after it began stopping it, and calls `__del__` once the HTTP requests
    drained, at least the second after. Serve does not say when it began, so HTTP streams that
    drained for longer leave the gRPC ones less, and one still running at the kill is cut.
    Read from the replica's deployment config, which only a private field holds (an
    operator's override included); the decorator's values if it ever moves."""
    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    return (
        getattr(config, "graceful_shutdown_timeout_s", DRAIN_S),
        getattr(config, "graceful_shutdown_wait_loop_s", WAIT_LOOP_S),
    )


async def app_staying() -> bool:
    """Whether this door's app stays once Serve stopped the door (an update, DEPLOYING, or a
    health-check restart): not when it is deleted or Serve shuts down (DELETING, or gone),
    nor when Serve's controller does not answer."""
    app = serve.get_replica_context().app_name
    try:
        status = await asyncio.wait_for(asyncio.to_thread(serve.status), STATUS_TIMEOUT_S)
    except Exception as exc:  # the cluster must still be stopped or handed over after it
        logger.warning("Serve's controller did not say why the door stops (%s): stopping", exc)
        return False
    state = status.applications.get(app)
    return state is not None and state.status != ApplicationStatus.DELETING


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: checks the args and every file they name before
    anything starts (`check_files`)."""
    check_files(FrontDoorConfig.from_args(args))
    return FrontDoorDeployment.bind(args)  # type: ignore[attr-defined]
