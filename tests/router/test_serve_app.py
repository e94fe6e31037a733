"""`router.app:build_app` under Ray Serve: the deployment entry point serves both doors; the
cluster outlives a crashed door (the next door attaches to it) and an update (a bad one fails
before Serve stops the running door), and stops with the app once both doors drained."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from openai.types import Completion
from ray.exceptions import TaskCancelledError
from starlette.types import Message, Receive, Scope, Send

from cluster.names import NAMESPACE
from router.app import (
    DRAIN_S,
    DisconnectOnCancelledReceive,
    FrontDoorDeployment,
    build_app,
)
from router.client import Chunk, Client, Result
from router.tokenizer import TextCodec
from tests.cluster.conftest import write_profile
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

    http_port, grpc_port = free_port(), free_port()
    args = {
        **demo_args(target_dir, draft_dir, tmp_path, http_port, grpc_port),
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
    # The tokens before the one that holds the line break, and that one if it holds thinking too.
    pieces = [codec.decode(tokens[: i + 1]) for i in range(len(tokens))]
    breaking = next(i for i, p in enumerate(pieces) if "\n" in p)
    held = breaking + (len(pieces[breaking - 1] if breaking else "") < len(thought))
    assert whole_grpc.result.reasoning_tokens == held
    check_chat_thinking_apart(oai, "demo", "def fib(n):", 24, slo, thought, answer, counts, held)


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


def demo_args(
    target_dir: Path, draft_dir: Path, tmp_path: Path, http_port: int, grpc_port: int
) -> dict[str, Any]:
    return {
        "cluster": {
            "model": str(target_dir),
            "draft": str(draft_dir),
            "profile": str(write_profile(tmp_path / "profile.json")),
            "replicas": 1,
            "num_kv_blocks": 256,
        },
        "http": {"host": "127.0.0.1", "port": http_port},
        "grpc": {"port": grpc_port},
        "api_keys_file": None,
    }


@pytest.mark.parametrize(
    ("section", "field", "error"),
    [
        ("cluster", "model", "no-such-model"),
        ("cluster", "draft", "no-such-model"),
        ("cluster", "profile", "does not exist"),
        (None, "api_keys_file", "No such file"),
        ("grpc", "tls_cert_file", "No such file"),
    ],
)
def test_build_app_reads_every_file_before_serve_stops_the_running_door(
    target_dir: Path, draft_dir: Path, tmp_path: Path, section: str | None, field: str, error: str
) -> None:
    """An update naming a bad file fails in the builder, where the running door keeps
    serving, not in the next door's constructor after Serve stopped the running one."""
    args = demo_args(target_dir, draft_dir, tmp_path, 8000, 50051)
    build_app(args)
    missing = str(tmp_path / "no-such-model")
    if section is None:
        args[field] = missing
    else:
        args[section] = {**args[section], field: missing}
        if field == "tls_cert_file":
            args[section]["tls_key_file"] = missing
    with pytest.raises(ValueError, match=error):
        build_app(args)


def test_build_app_refuses_gpus_the_ray_cluster_lacks_before_serve_stops_the_running_door(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    """An update asking for GPUs the Ray cluster lacks passed the builder: Serve stopped the
    running door, and the next door refused in its constructor, every request a 503. Unless
    the launch is to wait for GPU nodes (resource_wait_s), the builder refuses it."""
    args = demo_args(target_dir, draft_dir, tmp_path, 8000, 50051)
    build_app(args)
    args["cluster"] = {**args["cluster"], "num_gpus_per_replica": 1}
    with pytest.raises(ValueError, match=r"num_gpus_per_replica=1 but the Ray cluster has 0 GPU"):
        build_app(args)
    args["cluster"]["resource_wait_s"] = 600
    build_app(args)


def test_a_stopped_door_has_time_to_drain_llm_streams() -> None:
    """Serve's default of 20 s cut longer streams off at an update or a delete."""
    assert FrontDoorDeployment._deployment_config.graceful_shutdown_timeout_s == DRAIN_S >= 120


def test_an_update_keeps_the_cluster_and_a_delete_drains_both_doors(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    """A door-only update hands the cluster to the next door (no model reloaded); a delete
    lets an HTTP and a longer gRPC stream finish, then stops the cluster."""
    from ray import serve

    http_port, grpc_port = free_port(), free_port()
    args = demo_args(target_dir, draft_dir, tmp_path, http_port, grpc_port)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        serve.run(build_app(args), name="slos-serve", route_prefix="/")
        loaded = ray.get(ray.get_actor("slos-serve-replica-0", namespace=NAMESPACE).health.remote())
        serve.run(
            build_app({**args, "default_chat_max_tokens": 128}), name="slos-serve", route_prefix="/"
        )
        replica = ray.get_actor("slos-serve-replica-0", namespace=NAMESPACE)
        assert ray.get(replica.health.remote()) == loaded  # attached: nothing reloaded

        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0)
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:
            http = pool.submit(http_stream, oai, 100, started[0])
            grpc = pool.submit(grpc_stream, grpc_port, 1800, started[1])
            assert all(event.wait(60) for event in started)
            serve.delete("slos-serve")
            assert http.result(120) == (100, "length")
            assert grpc.result(120) == (1800, "length")
    finally:
        serve.shutdown()
    assert not [a for a in named_actors() if a["namespace"] == NAMESPACE]


def http_stream(oai: openai.OpenAI, max_tokens: int, started: threading.Event) -> tuple[int, str]:
    """(tokens, finish reason) of an HTTP completion stream; `started` at its first chunk."""
    stream = oai.completions.create(
        model="demo",
        prompt="Hello",
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reason, tokens = "", 0
    for chunk in stream:
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, reason


def grpc_stream(grpc_port: int, max_tokens: int, started: threading.Event) -> tuple[int, str]:
    """(tokens, finish reason) of a gRPC stream; `started` at its first chunk."""
    with Client(f"127.0.0.1:{grpc_port}") as client:
        for item in client.generate("Hello", max_tokens=max_tokens, ignore_eos=True):
            started.set()
            if isinstance(item, Result):
                return item.completion_tokens, item.finish_reason
    raise AssertionError("the stream ended without a result")
