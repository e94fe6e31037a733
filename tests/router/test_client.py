"""The SDK against a minimal in-test gRPC servicer on 127.0.0.1.

The servicer stands in for no real component's logic: it only scripts the status codes a
client must handle (UNAVAILABLE, RESOURCE_EXHAUSTED with retry-after, slow streams, a stream
broken midway), so retries, deadlines and typed results of the client can be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from cluster.api import Verdict
from replica.request import SLO, Stage
from router.client import AsyncClient, Chunk, Client, ClientError, Result, RetryPolicy
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)


@dataclass
class ScriptedServicer(pb_grpc.ServingServicer):
    """Fails the first `unavailable` calls, then behaves as `mode` says."""

    mode: str = "ok"
    unavailable: int = 0
    status_unavailable: int = 0
    calls: int = 0
    status_calls: int = 0
    seen: list[tuple[pb.GenerateRequest, dict[str, str]]] = field(default_factory=list)

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.calls += 1
        self.seen.append((request, dict(context.invocation_metadata())))
        if self.calls <= self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is up")
        if self.mode in ("reject", "reject_vaguely"):
            hint = "1500" if self.mode == "reject" else "soon"
            context.set_trailing_metadata((("retry-after-ms", hint),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no replica could guarantee the SLO")
        if self.mode == "bad_metadata":
            placed = (("x-slos-serve-verdict", "admitted"), ("x-slos-serve-hops", "many"))
            context.send_initial_metadata(placed)
        yield pb.GenerateResponse(chunk=pb.TextChunk(text="Hel", token_ids=[1, 2]))
        if self.mode == "no_final":
            return
        if self.mode == "slow":
            time.sleep(2.0)
        if self.mode == "break":
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica lost")
        yield pb.GenerateResponse(chunk=pb.TextChunk(text="lo", token_ids=[3]))
        final = pb.Final(
            request_id="r1", verdict="admitted", replica=1, hops=2, finish_reason="length"
        )
        final.prompt_tokens, final.completion_tokens, final.slo_attained = 4, 3, True
        final.stages.add(name="default", attained=True)
        yield pb.GenerateResponse(final=final)

    def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClusterStatus:
        self.status_calls += 1
        if self.status_calls <= self.status_unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the cluster does not answer")
        status = pb.ClusterStatus(model="demo", counters={"admitted": 3})
        status.replicas.add(replica=0, alive=True, running=2, kv_usage=0.25)
        return status


def serve(servicer: ScriptedServicer, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ServingServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.fixture
def served() -> Iterator[tuple[ScriptedServicer, str]]:
    servicer = ScriptedServicer()
    server, port = serve(servicer)
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_stream_is_typed_and_request_carries_options(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    slo = SLO(300, 40, (Stage(20, 8, name="think"), Stage(60)))
    with Client(target, api_key="sk-1", retry=FAST_RETRY) as client:
        items = list(client.generate("Hi", max_tokens=3, slo=slo, priority=-1, seed=5))
        status = client.cluster_status()
    assert items[:2] == [Chunk("Hel", (1, 2)), Chunk("lo", (3,))]
    result = items[2]
    assert isinstance(result, Result)
    assert (result.verdict, result.replica, result.hops, result.slo_attained) == (
        Verdict.ADMITTED,
        1,
        2,
        True,
    )
    assert result.ttft_s is None and result.completion_tokens == 3
    request, metadata = servicer.seen[0]
    assert metadata["authorization"] == "Bearer sk-1"
    assert request.prompt == "Hi" and request.max_tokens == 3 and request.seed == 5
    assert request.priority == -1 and not request.HasField("temperature")
    assert request.slo.ttft_ms == 300 and [s.name for s in request.slo.stages] == ["think", ""]
    assert request.slo.stages[0].num_tokens == 8 and not request.slo.stages[1].HasField(
        "num_tokens"
    )
    assert (
        status.model == "demo"
        and status.replicas[0].running == 2
        and status.counters == {"admitted": 3}
    )


def test_unavailable_is_retried_then_succeeds(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.unavailable = 2
    with Client(target, retry=FAST_RETRY) as client:
        completion = client.complete([5, 6], service_tier="flex", slo="chat")
    assert completion.text == "Hello" and servicer.calls == 3
    request = servicer.seen[-1][0]
    assert list(request.prompt_token_ids) == [5, 6]
    assert request.service_tier == pb.SERVICE_TIER_FLEX and request.slo.tier == "chat"


def test_retries_stop_at_max_attempts(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.unavailable = 10
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(ClientError) as info:
        client.complete("x")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and servicer.calls == 4


def test_rejection_is_not_retried_and_carries_retry_after(
    served: tuple[ScriptedServicer, str],
) -> None:
    servicer, target = served
    servicer.mode = "reject"
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(ClientError) as info:
        client.complete("x")
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_after_s == 1.5 and servicer.calls == 1


def test_broken_stream_is_never_replayed(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.mode = "break"
    received: list[object] = []
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(ClientError) as info:
        for item in client.generate("x"):
            received.append(item)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert received == [Chunk("Hel", (1, 2))] and servicer.calls == 1


def test_deadline_is_enforced(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.mode = "slow"
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(ClientError) as info:
        client.complete("x", timeout_s=0.3)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and servicer.calls == 1


def test_async_client_retries_and_streams(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.unavailable = 1

    async def run() -> tuple[list[object], int]:
        async with AsyncClient(target, api_key="sk-2", retry=FAST_RETRY) as client:
            items = [item async for item in client.generate("Hi")]
            status = await client.cluster_status()
        return items, len(status.replicas)

    items, replicas = asyncio.run(run())
    assert [i.text for i in items if isinstance(i, Chunk)] == ["Hel", "lo"]
    assert isinstance(items[-1], Result) and replicas == 1 and servicer.calls == 2
    assert servicer.seen[-1][1]["authorization"] == "Bearer sk-2"


def test_async_client_rejection(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.mode = "reject"

    async def run() -> None:
        async with AsyncClient(target, retry=FAST_RETRY) as client:
            await client.complete("x")

    with pytest.raises(ClientError) as info:
        asyncio.run(run())
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s == 1.5


def test_bad_service_tier_fails_before_sending() -> None:
    with (
        Client("127.0.0.1:9", retry=FAST_RETRY) as client,
        pytest.raises(ValueError, match="service_tier"),
    ):
        client.complete("x", service_tier="gold")


def test_a_stream_the_server_ends_without_a_result_fails(
    served: tuple[ScriptedServicer, str],
) -> None:
    """Every choice ends with its Result: a stream cut short without one is an error, in
    generate as in complete, not a silent end."""
    servicer, target = served
    servicer.mode = "no_final"
    with Client(target, retry=FAST_RETRY) as client:
        for call in (lambda: list(client.generate("x")), lambda: client.complete("x")):
            with pytest.raises(ClientError, match="after 0 of 1 results") as info:
                call()
            assert info.value.code is grpc.StatusCode.INTERNAL

    async def run() -> None:
        async with AsyncClient(target, retry=FAST_RETRY) as client:
            await client.complete("x")

    with pytest.raises(ClientError, match="after 0 of 1 results"):
        asyncio.run(run())


def test_cluster_status_is_retried_while_unavailable(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.status_unavailable = 2
    with Client(target, retry=FAST_RETRY) as client:
        assert client.cluster_status().model == "demo"
    assert servicer.status_calls == 3
    servicer.status_unavailable = 10

    async def run() -> None:
        async with AsyncClient(target, retry=FAST_RETRY) as client:
            await client.cluster_status()

    with pytest.raises(ClientError) as info:
        asyncio.run(run())
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and servicer.status_calls == 3 + 4


def test_what_a_server_sends_malformed_is_a_client_error(
    served: tuple[ScriptedServicer, str],
) -> None:
    """Placement metadata that does not parse fails the call as INTERNAL, naming what came; a
    retry-after hint that is no number is dropped, the rejection kept."""
    servicer, target = served
    servicer.mode = "bad_metadata"
    with Client(target, retry=FAST_RETRY) as client:
        with pytest.raises(ClientError, match="placement metadata is malformed") as info:
            client.complete("x")
        assert info.value.code is grpc.StatusCode.INTERNAL and "'many'" in str(info.value)
        servicer.mode = "reject_vaguely"
        with pytest.raises(ClientError) as rejected:
            client.complete("x")
    assert rejected.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rejected.value.retry_after_s is None


def test_an_async_client_made_outside_a_running_loop_works_in_the_loop_that_uses_it(
    served: tuple[ScriptedServicer, str],
) -> None:
    _, target = served
    client = AsyncClient(target, retry=FAST_RETRY)

    async def run() -> str:
        async with client:
            return (await client.complete("x")).text

    assert asyncio.run(run()) == "Hello"


def test_arguments_are_checked_when_generate_is_called_not_when_it_is_read() -> None:
    with (
        Client("127.0.0.1:9", retry=FAST_RETRY) as client,
        pytest.raises(ValueError, match="service_tier"),
    ):
        client.generate("x", service_tier="gold")
    with pytest.raises(ValueError, match="service_tier"):
        AsyncClient("127.0.0.1:9").generate("x", service_tier="gold")
    with pytest.raises(ValueError, match="pass tls=True"):
        Client("127.0.0.1:9", root_certificates=b"-----BEGIN CERTIFICATE-----")


def test_an_slo_dict_is_taken_as_http_takes_it(served: tuple[ScriptedServicer, str]) -> None:
    """`until` as a string or a list; a number sent as text, or a field named otherwise than
    HTTP names it, is refused before sending, naming the field."""
    servicer, target = served
    slo = {
        "ttft_ms": 2000,
        "stages": [
            {"name": "thinking", "tpot_ms": 50, "until": "</think>"},
            {"name": "answer", "tpot_ms": 100, "until": ["\n\n", "END"], "num_tokens": 64},
        ],
    }
    with Client(target, retry=FAST_RETRY) as client:
        client.complete("x", slo=slo)
        (request, _) = servicer.seen[-1]
        assert request.slo.ttft_ms == 2000 and not request.slo.HasField("tpot_ms")
        thinking, answer = request.slo.stages
        assert (thinking.name, list(thinking.until), thinking.tpot_ms) == (
            "thinking",
            ["</think>"],
            50,
        )
        assert list(answer.until) == ["\n\n", "END"] and answer.num_tokens == 64
        refusals = {
            "slo.ttft_ms must be a number, got '3000'": {"ttft_ms": "3000"},
            "slo has unknown field.s. ttft; known: ttft_ms, tpot_ms, stages": {"ttft": 100},
            r"slo.stages\[0\].tpot_ms must be a number": {"stages": [{"tpot_ms": True}]},
            r"slo.stages\[0\] has unknown field.s. until_text": {
                "stages": [{"tpot_ms": 5, "until_text": "x"}]
            },
        }
        for message, wrong in refusals.items():
            with pytest.raises(ValueError, match=message):
                client.generate("x", slo=wrong)
    assert servicer.calls == 1


def test_a_client_error_pickles_as_it_was_raised() -> None:
    """A worker process's error reaches its parent (multiprocessing pickles it)."""
    error = ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 1.5)
    back = pickle.loads(pickle.dumps(error))
    assert (back.code, back.details, back.retry_after_s) == (error.code, "busy", 1.5)
    assert str(back) == str(error) == "RESOURCE_EXHAUSTED: busy"


def test_a_stream_cancelled_from_another_thread_ends_at_once(
    served: tuple[ScriptedServicer, str],
) -> None:
    """A UI's stop button: the reading thread gets CANCELLED, not the rest of the output."""
    servicer, target = served
    servicer.mode = "slow"
    with Client(target, retry=FAST_RETRY) as client:
        stream = client.generate("x")
        assert isinstance(next(stream), Chunk)
        threading.Timer(0.2, stream.cancel).start()
        started = time.monotonic()
        with pytest.raises(ClientError, match="the stream was cancelled") as info:
            next(stream)
        assert info.value.code is grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 1.5  # the server would answer after 2 s
        stream.cancel()  # once more: nothing left to cancel
        assert client.complete("x", timeout_s=10).text == "Hello"


def test_an_async_client_closed_during_a_stream_fails_it_with_cancelled(
    served: tuple[ScriptedServicer, str],
) -> None:
    """Not a bare CancelledError, which a TaskGroup would take for its own cancellation."""
    servicer, target = served
    servicer.mode = "slow"

    async def run() -> None:
        client = AsyncClient(target, retry=FAST_RETRY)
        stream = client.generate("x")
        assert isinstance(await anext(stream), Chunk)
        reading = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.2)
        await client.close()
        with pytest.raises(ClientError, match="closed during the stream") as info:
            await reading
        assert info.value.code is grpc.StatusCode.CANCELLED and not reading.cancelled()

    asyncio.run(run())


def test_a_task_cancelled_while_reading_is_cancelled() -> None:
    async def run() -> None:
        async with AsyncClient("127.0.0.1:9", wait_for_ready=True) as client:
            reading = asyncio.create_task(client.complete("x"))
            await asyncio.sleep(0.2)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading

    asyncio.run(run())


def test_timeouts_are_checked_and_an_infinite_one_sets_no_deadline(
    served: tuple[ScriptedServicer, str],
) -> None:
    servicer, target = served
    servicer.mode = "slow"
    with Client(target, retry=FAST_RETRY, timeout_s=0.3) as client:
        for none in (math.inf, 1e10):
            assert client.complete("x", timeout_s=none).text == "Hello"
        with pytest.raises(ValueError, match="timeout_s must be > 0"):
            client.generate("x", timeout_s=-1)
        with pytest.raises(TypeError, match="timeout_s must be a number"):
            client.generate("x", timeout_s="5")  # type: ignore[arg-type]
    assert servicer.calls == 2
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        Client(target, timeout_s="5")
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        Client(target, retry="x")


def test_a_closed_client_says_so() -> None:
    client = Client("127.0.0.1:9")
    client.close()
    with pytest.raises(ValueError, match="the client is closed"):
        client.complete("x")

    async def run() -> None:
        async with AsyncClient("127.0.0.1:9") as closing:
            pass
        await closing.cluster_status()

    with pytest.raises(ValueError, match="the client is closed"):
        asyncio.run(run())


def test_wrong_field_types_are_refused_naming_the_field() -> None:
    with Client("127.0.0.1:9") as client:
        with pytest.raises(ValueError, match=r"stop=\[1\]"):
            client.generate("x", stop=[1])
        with pytest.raises(ValueError, match="prompt must be text or a list of token ids, got 123"):
            client.generate(123)  # type: ignore[arg-type]


def test_an_async_client_serves_one_event_loop_after_another(
    served: tuple[ScriptedServicer, str],
) -> None:
    """asyncio.run twice (a script's, then a test's): the closed loop's channel is replaced;
    a loop still running elsewhere is named as the reason a call is refused."""
    _, target = served
    client = AsyncClient(target, retry=FAST_RETRY)

    async def text() -> str:
        return (await client.complete("x")).text

    assert asyncio.run(text()) == "Hello"
    assert asyncio.run(text()) == "Hello"
    other = asyncio.new_event_loop()
    held = threading.Thread(target=other.run_forever)
    held.start()
    try:
        asyncio.run_coroutine_threadsafe(text(), other).result(10)
        with pytest.raises(RuntimeError, match="make an AsyncClient for each event loop"):
            asyncio.run(text())
    finally:
        other.call_soon_threadsafe(other.stop)
        held.join()
        other.close()


def test_retries_use_the_deadline_they_have(served: tuple[ScriptedServicer, str]) -> None:
    """The last backoff is cut to what the deadline leaves: a 1 s backoff and a 3 s deadline
    make four attempts (0, 1, 2 and 2.9 s), not three."""
    servicer, target = served
    servicer.unavailable = 100
    policy = RetryPolicy(max_attempts=100, initial_backoff_s=1.0, max_backoff_s=1.0)
    with Client(target, retry=policy) as client, pytest.raises(ClientError) as info:
        client.complete("x", timeout_s=3.0)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and servicer.calls >= 4


@contextlib.contextmanager
def serving_after(delay_s: float) -> Iterator[tuple[ScriptedServicer, str]]:
    """A server whose port opens `delay_s` from now, and its target."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servicer = ScriptedServicer()
    servers: list[grpc.Server] = []
    starting = threading.Timer(delay_s, lambda: servers.append(serve(servicer, port)[0]))
    starting.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        starting.join()
        for server in servers:
            server.stop(None)


def test_the_default_retries_ride_out_a_door_being_replaced() -> None:
    """A Serve update stops the front door before the new one listens: its gRPC port stayed
    closed 13-37 s (upgrade QA, 5 of 5 updates), and the SDK gave up after four attempts in
    0.7 s. Here the port opens after 1.5 s."""
    with serving_after(1.5) as (servicer, target), Client(target) as client:
        assert client.complete("x", timeout_s=30).text == "Hello"
        assert servicer.calls == 1


def test_retries_stop_after_max_retry_s(served: tuple[ScriptedServicer, str]) -> None:
    servicer, target = served
    servicer.unavailable = 1000
    policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.05, max_retry_s=0.5)
    began = time.monotonic()
    with Client(target, retry=policy) as client, pytest.raises(ClientError) as info:
        client.complete("x")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert 0.4 <= time.monotonic() - began < 5.0 and 2 < servicer.calls < 20
    with pytest.raises(ValueError, match="max_retry_s"):
        RetryPolicy(max_retry_s=math.inf)


def test_wait_for_ready_waits_for_a_server_that_comes_up() -> None:
    """A client started before its server (or during a restart) rides it out."""
    with serving_after(0.5) as (servicer, target):
        with Client(target, wait_for_ready=True) as client:
            assert client.complete("x", timeout_s=20).text == "Hello"
        assert servicer.calls == 1


def test_the_sdk_loads_none_of_the_servers_modules() -> None:
    """A client imports the message shapes the doors check (router.wire), not the doors:
    `import router.client` took 1-1.6 s on a loaded machine, with the tokenizer, the chat
    template engine, the grammar engine and the metrics."""
    heavy = ("llguidance", "jinja2", "tokenizers", "prometheus_client", "torch", "ray")
    probe = f"import sys, router.client; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
