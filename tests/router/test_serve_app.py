"""`router.app:build_app` under Ray Serve: the deployment entry point serves both doors; the
cluster outlives a crashed door (the next door attaches to it) and stops with the app."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import openai
import pytest
import ray
from openai.types import Completion
from ray.exceptions import RayTaskError, TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.names import NAMESPACE
from router.app import DisconnectOnCancelledReceive, build_app
from router.client import Chunk, Client
from router.tokenizer import TextCodec
from tests.router.conftest import check_chat_thinking_apart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_build_app_serves_http_and_grpc(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path: Path, codec: TextCodec
) -> None:
    from ray import serve

    from tests.cluster.conftest import write_profile

    http_port, grpc_port = free_port(), free_port()
    args = {
        "cluster": {
            "model": str(target_dir),
            "draft": str(draft_dir),
            "profile": str(write_profile(tmp_path / "profile.json")),
            "replicas": 1,
            "num_kv_blocks": 128,
        },
        "http": {"host": "127.0.0.1", "port": http_port},
        "grpc": {"port": grpc_port},
        "api_keys_file": None,
        # The demo model does not think: a line break stands for its </think>.
        "reasoning_parser": {"end": "\n", "starts_open": True},
    }
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        serve.run(build_app(args), name="slos-serve", route_prefix="/")
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0)
        out = oai.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage is not None and 1 <= out.usage.completion_tokens <= 4
        with Client(f"127.0.0.1:{grpc_port}") as client:
            done = client.complete("Hello", max_tokens=4, temperature=0.0)
        assert done.text == out.choices[0].text
        assert done.result.verdict == "admitted"
        check_thinking_apart(oai, grpc_port, codec)

        replica = ray.get_actor("slos-serve-replica-0", namespace=NAMESPACE)
        loaded = ray.get(replica.health.remote())
        (door,) = [a for a in named_actors() if "FrontDoorDeployment" in a["name"]]
        ray.kill(ray.get_actor(door["name"], namespace=door["namespace"]), no_restart=True)
        again = complete_within(oai, 120.0)
        assert again.choices[0].text == out.choices[0].text
        assert again.model_extra["slos_serve"]["verdict"] == "admitted"
        assert ray.get(replica.health.remote()) == loaded  # the same replica: nothing reloaded
    finally:
        serve.shutdown()
    assert not [a for a in named_actors() if a["namespace"] == NAMESPACE]


def check_thinking_apart(oai: openai.OpenAI, grpc_port: int, codec: TextCodec) -> None:
    """Chat through a reasoning parser: the thinking (up to the first line break, here) comes
    apart from the answer over gRPC (streamed and whole) and as reasoning_content over HTTP
    (whole and streamed); a thinking stage of the SLO ends on the token the model outputs
    for it."""
    with Client(f"127.0.0.1:{grpc_port}") as client:
        chunks = [
            c
            for c in client.generate(
                messages=[("user", "def fib(n):")], max_tokens=24, temperature=0.0
            )
            if isinstance(c, Chunk)
        ]
        whole_grpc = client.complete(
            messages=[("user", "def fib(n):")], max_tokens=24, temperature=0.0
        )
    tokens = [t for c in chunks for t in c.token_ids]
    text = codec.decode(tokens)
    assert "\n" in text, text
    thought, answer = text.split("\n", 1)
    assert "".join(c.reasoning for c in chunks) == thought == whole_grpc.reasoning
    assert "".join(c.text for c in chunks) == answer == whole_grpc.text
    end = tokens[3]  # stands for the model's end-of-thinking token
    stages = [
        {"name": "thinking", "tpot_ms": 500, "end_token_ids": [end]},
        {"name": "answer", "tpot_ms": 1000},
    ]
    thinking = tokens.index(end) + 1
    slo = {"ttft_ms": 60_000, "stages": stages}
    counts = [("thinking", thinking), ("answer", len(tokens) - thinking)]
    check_chat_thinking_apart(oai, "demo", "def fib(n):", 24, slo, thought, answer, counts)


def test_a_cancelled_receive_is_a_disconnect() -> None:
    """What Serve raises from `receive` when a client leaves reaches the app as the
    `http.disconnect` Starlette expects; other messages and errors pass through."""
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())

    async def cancelled() -> Message:
        raise TaskCancelledError()

    async def body() -> Message:
        return {"type": "http.request", "body": b"{}"}

    async def broken() -> Message:
        raise ValueError("not a disconnect")

    async def send(message: Message) -> None:
        del message

    door = DisconnectOnCancelledReceive(app)
    asyncio.run(door({"type": "http"}, cancelled, send))
    asyncio.run(door({"type": "http"}, body, send))
    assert seen == [{"type": "http.disconnect"}, {"type": "http.request", "body": b"{}"}]
    with pytest.raises(ValueError, match="not a disconnect"):
        asyncio.run(door({"type": "http"}, broken, send))


def test_a_request_serve_cancelled_ends_quietly() -> None:
    """The replica actor's stream Serve cancelled with the request raises out of the app as
    RayTaskError(TaskCancelledError); the client is gone, so the door ends the request without
    a traceback. Other errors still propagate."""

    def app_raising(error: Exception) -> ASGIApp:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            raise error

        return app

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: Message) -> None:
        del message

    cancelled = RayTaskError("stream", "traceback", TaskCancelledError()).as_instanceof_cause()
    assert isinstance(cancelled, TaskCancelledError)
    asyncio.run(
        DisconnectOnCancelledReceive(app_raising(cancelled))({"type": "http"}, receive, send)
    )
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(
            DisconnectOnCancelledReceive(app_raising(RuntimeError("boom")))(
                {"type": "http"}, receive, send
            )
        )


def named_actors() -> list[dict[str, str]]:
    named: list[dict[str, str]] = ray.util.list_named_actors(all_namespaces=True)
    return named


def complete_within(oai: openai.OpenAI, timeout_s: float) -> Completion:
    """The first completion the app serves again, once Serve has replaced its door."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return oai.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0)
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
