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
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import cluster
from cluster.logs import configure_logging
from router.auth import ApiKeys
from router.config import FrontDoorConfig
from router.frontdoor import FrontDoor
from router.grpc_server import GrpcServer, start_grpc_server
from router.http import create_app
from router.metrics import FrontDoorMetrics
from router.openai_schema import SchemaContext
from router.tokenizer import TextCodec

logger = logging.getLogger(__name__)


async def build_front_door(
    config: FrontDoorConfig, *, detached: bool = False
) -> tuple[FrontDoor, Any]:
    """Launch (or, `detached`, attach to) the cluster and wrap it; returns the door and the
    cluster handle. What the door reads itself comes first, the model's tokenizer, the tiers,
    and the API keys (the launch checks the profile and the draft first): a bad one stops the
    start before the cluster, not after every replica loaded its model."""
    codec = TextCodec.from_dir(config.cluster.model)
    # Built now, off the loop (about a second at a 128k vocabulary): structured output and
    # log-probabilities' bytes need it, and the first such request built it on the loop.
    await asyncio.to_thread(lambda: codec.byte_vocab)
    tiers, default_slo = config.slos(codec)
    keys = ApiKeys.load(config.api_keys_file)
    handle = await cluster.launch(config.cluster, detached=detached)
    schema = SchemaContext(
        model_name=handle.model_name,
        max_model_len=handle.max_model_len,
        vocab_size=handle.vocab_size,
        default_slo=default_slo,
        tiers=tiers,
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
    the Ray tasks the request awaits, such as the replica actor's token stream, whose result
    then raises it too. Either way the client is gone and nothing can reach it. Starlette's
    streaming response logged a 60-line "exception was never retrieved" traceback for each
    (the second, about 1 in 300 streams a load generator closed, seen live 2026-11-27)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        try:
            await self.app(scope, receive_or_disconnect, send)
        except TaskCancelledError:
            logger.debug("request cancelled by Serve (client gone) while awaiting the cluster")


# The door only parses, tokenizes and relays; the CPUs a config declares go to the model
# replicas (serve-cpu.yaml gives each replica one of a 2-core machine's cores). It runs on the
# head node, whose resource Ray names itself, so its own gRPC server is at a known address
# (the head's port forward, the chart's gRPC Service); HTTP goes through every node's proxy.
HEAD_NODE = {"node:__internal_head__": 0.001}


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
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
        door, self.handle = await build_front_door(self.config, detached=True)
        door.keys.bind_host(self.config.http_host, "HTTP (Ray Serve http_options)")
        if self.config.grpc_port:
            host = door.keys.bind_host(self.config.grpc_host, "gRPC")
            port = self.config.grpc_port
            self.grpc = await start_grpc_server(door, host, port, tls=self.tls)
        app = create_app(door)
        app.add_middleware(DisconnectOnCancelledReceive)
        return app

    async def check_health(self) -> None:
        """Serve restarts a door whose cluster is being stopped under it (the next door
        launches a new one)."""
        if self.handle is not None and self.handle.lease_refused:
            raise RuntimeError("the cluster this door served is being stopped")

    async def __del__(self) -> None:
        """Serve stops the door (delete, redeploy, shutdown): stop the cluster with it, unless
        another door holds it. A door that crashes never gets here."""
        if self.grpc is not None:
            await self.grpc.stop()
        if self.handle is not None:
            await self.handle.shutdown()


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder (validates the args before anything starts)."""
    FrontDoorConfig.from_args(args)
    return FrontDoorDeployment.bind(args)  # type: ignore[attr-defined]
