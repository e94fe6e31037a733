"""The HTTP door's own answers (and the limit both doors share), over a scripted cluster (no
Ray)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request
from starlette.types import Message

from cluster.api import ClusterUnavailable
from router.auth import ApiKeys
from router.client import AsyncClient, ClientError, RetryPolicy
from router.errors import ClientGone, TooLarge
from router.frontdoor import FrontDoor
from router.grpc_server import start_grpc_server
from router.http import _body, create_app
from router.metrics import FrontDoorMetrics
from router.tokenizer import TextCodec
from tests.router.test_frontdoor import (
    CTX,
    ScriptedCluster,
    cancelled,
    counted,
    door_over,
    first_token,
)


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(codec: TextCodec) -> None:
    client = TestClient(create_app(door_over(ScriptedCluster(), codec)))
    missing = client.post("/v1/embeddings", json={"input": "hi"})
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Not Found: POST /v1/embeddings",
            "type": "invalid_request_error",
            "param": None,
            "code": 404,
        }
    }
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "Method Not Allowed: GET /v1/completions"
    assert wrong.json()["error"]["code"] == 405
    named = client.get("/v1/models/other")  # an ApiError, as before
    assert named.status_code == 404 and named.json()["error"]["param"] == "model"


def small_door(codec: TextCodec, limit: int) -> FrontDoor:
    return FrontDoor(
        ScriptedCluster(),
        codec,
        replace(CTX, max_request_bytes=limit),
        ApiKeys(),
        FrontDoorMetrics("demo"),
    )


def test_a_body_over_the_limit_is_refused_unread(codec: TextCodec) -> None:
    """Declared or streamed (chunked, no length), a body over `max_request_mb` is a 413 in the
    OpenAI error shape: 50 MB bodies parsed on the door's loop held every other client's
    stream for seconds."""
    client = TestClient(create_app(small_door(codec, 1000)))
    body = json.dumps({"model": "demo", "prompt": "x" * 2000}).encode()
    chunked = (body[i : i + 100] for i in range(0, len(body), 100))
    for content in (body, chunked):
        r = client.post("/v1/completions", content=content)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "1000" in r.json()["error"]["message"]
    small = client.post("/tokenize", json={"model": "demo", "prompt": "def f(x):"})
    assert small.status_code == 200


def test_a_streamed_body_is_read_no_further_than_the_limit() -> None:
    pulled = 0

    async def receive() -> Message:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    scope = {"type": "http", "method": "POST", "headers": [], "path": "/v1/completions"}
    with pytest.raises(TooLarge, match="more than 1000 bytes"):
        asyncio.run(_body(Request(scope, receive), 1000))
    assert pulled == 11


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (
            b'{"prompt": "x",',
            "Expecting property name enclosed in double quotes at line 1 column 16",
        ),
        (b"[" * 100_000, "it nests too deeply"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "a number has more than 4300 digits"),
        (b'{"prompt": "x", "temperature": NaN}', "NaN is not JSON"),
        (b'{"prompt": "\xff\xfe"}', "it is not UTF-8 text"),
    ],
)
def test_a_body_that_is_not_json_is_refused_saying_why(
    codec: TextCodec, content: bytes, reason: str
) -> None:
    client = TestClient(create_app(door_over(ScriptedCluster(), codec)))
    r = client.post("/v1/completions", content=content)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"the request body is not valid JSON: {reason}"


def test_a_client_that_leaves_mid_body_ends_as_gone() -> None:
    """Starlette raises ClientDisconnect out of the body's stream; under Ray Serve that escaped
    the app as a 70-line "exception never retrieved" traceback for each client."""
    messages = [
        {"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Message:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "headers": [], "path": "/v1/completions"}
    with pytest.raises(ClientGone) as info:
        asyncio.run(_body(Request(scope, receive), 1000))
    assert info.value.status == 499


def test_a_grpc_message_over_the_limit_is_refused(codec: TextCodec) -> None:
    """The same `max_request_mb` bounds gRPC's messages (grpc's own default is 4 MiB)."""

    async def send() -> None:
        server = await start_grpc_server(small_door(codec, 1000), "127.0.0.1", 0)
        try:
            async with AsyncClient(f"127.0.0.1:{server.port}") as client:
                with pytest.raises(ClientError) as info:
                    await client.complete("x" * 2000, timeout_s=10)
                assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop()

    asyncio.run(send())


def test_a_fault_mid_stream_ends_every_door_saying_so_and_counts_lost(codec: TextCodec) -> None:
    """A fault of the server's own after the first token: SSE ends with an error event and
    [DONE] (it was cut silently), a whole response is the error JSON (it was plain text) and
    gRPC says INTERNAL (it was UNKNOWN with Python's message); the request counts as lost,
    not as one its client left."""
    cluster = ScriptedCluster(every=lambda rid: [first_token(rid), RuntimeError("a bug")])
    door = door_over(cluster, codec)
    client = TestClient(create_app(door))
    expected = "the server failed this request (RuntimeError); its log says why"
    streamed = client.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert streamed.status_code == 200
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["message"] == expected
    assert events[-1] == "data: [DONE]"
    whole = client.post("/v1/completions", json={"prompt": "Hi"})
    assert whole.status_code == 500
    assert whole.json()["error"] == {
        "message": expected,
        "type": "server_error",
        "param": None,
        "code": 500,
    }

    async def over_grpc() -> None:
        server = await start_grpc_server(door, "127.0.0.1", 0)
        try:
            async with AsyncClient(f"127.0.0.1:{server.port}") as rpc:
                with pytest.raises(ClientError) as info:
                    await rpc.complete("Hi", timeout_s=10)
        finally:
            await server.stop()
        assert info.value.code is grpc.StatusCode.INTERNAL and info.value.details == expected

    asyncio.run(over_grpc())
    assert counted(door, "requests_lost_total", "verdict") == {"admitted": 3}
    assert cancelled(door) == {}


def test_a_fault_outside_a_stream_answers_the_error_json(codec: TextCodec) -> None:
    door = door_over(ScriptedCluster(), codec)

    async def broken() -> None:
        raise KeyError("oops")

    door.status = broken  # type: ignore[method-assign]
    answer = TestClient(create_app(door), raise_server_exceptions=False).get("/v1/cluster/status")
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == (
        "the server failed this request (KeyError); its log says why"
    )


def test_no_replica_up_answers_503_with_the_clusters_retry_after(codec: TextCodec) -> None:
    cluster = ScriptedCluster(every=lambda rid: [ClusterUnavailable("no replica is up", 2.5)])
    door = door_over(cluster, codec)
    answer = TestClient(create_app(door)).post("/v1/completions", json={"prompt": "Hi"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "3"
    assert answer.json()["error"]["message"] == "no replica is up"

    async def over_grpc() -> None:
        server = await start_grpc_server(door, "127.0.0.1", 0)
        try:
            async with AsyncClient(f"127.0.0.1:{server.port}", retry=RetryPolicy(1)) as rpc:
                with pytest.raises(ClientError) as info:
                    await rpc.complete("Hi", timeout_s=10)
        finally:
            await server.stop()
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert info.value.retry_after_s == 2.5

    asyncio.run(over_grpc())
