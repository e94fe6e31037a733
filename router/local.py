"""Both doors on this machine without Ray Serve: the cluster, uvicorn and grpc.aio on one event
loop in a background thread (a cluster handle lives on the loop that launched it).

For end-to-end tests and the front-door benchmark, where Ray Serve's proxy would only add a
process hop that is not ours to measure.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from router.app import build_front_door
from router.config import FrontDoorConfig
from router.frontdoor import FrontDoor
from router.grpc_server import GrpcServer, start_grpc_server
from router.http import create_app

T = TypeVar("T")
HOST = "127.0.0.1"


class LocalFrontDoor:
    """Starts on construction; `close()` (or leaving the `with` block) stops everything."""

    def __init__(self, config: FrontDoorConfig, start_timeout_s: float = 300.0) -> None:
        tls = config.grpc_tls()  # read before the cluster launches
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.door: FrontDoor
        self.handle: Any
        self.door, self.handle = self.run(build_front_door(config), start_timeout_s)
        grpc = start_grpc_server(self.door, HOST, config.grpc_port, tls=tls)
        self.grpc: GrpcServer = self.run(grpc)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it every response waits ~40 ms for a delayed ACK (Nagle).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, config.http_port))
        app_config = uvicorn.Config(create_app(self.door), log_level="warning", lifespan="off")
        self.http = uvicorn.Server(app_config)
        self.http_task = asyncio.run_coroutine_threadsafe(
            self.http.serve(sockets=[self.sock]), self.loop
        )
        self.run(self._wait_started(), start_timeout_s)

    async def _wait_started(self) -> None:
        while not self.http.started:
            await asyncio.sleep(0.02)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        """Run a coroutine on the door's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.sock.getsockname()[1]}"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.grpc.port}"

    def close(self) -> None:
        self.http.should_exit = True
        self.http_task.result(30)
        self.run(self.grpc.stop())
        self.run(self.handle.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def __enter__(self) -> LocalFrontDoor:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
