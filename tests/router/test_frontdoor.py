"""The front door over a scripted cluster: what it counts and reports, whatever the wire."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api import (
    ClusterStatus,
    ClusterUnavailable,
    FinalRecord,
    Placement,
    StageVerdict,
    TokenChunk,
    Verdict,
)
from replica.batch import TokenLogprob
from replica.request import SLO, Request
from router.auth import ApiKeys
from router.client import AsyncClient, ClientError, Tool
from router.errors import Rejected, Unavailable
from router.frontdoor import FrontDoor
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc
from router.grpc_server import start_grpc_server
from router.metrics import PREFIX, FrontDoorMetrics
from router.openai_schema import Endpoint, ParsedRequest, SchemaContext, parse_body
from router.tokenizer import TextCodec
from tests.router.test_metrics import samples

CTX = SchemaContext("demo", 2048, 4096, SLO(2000, 200))
TENANT = "team-a"


@dataclass
class ScriptedCluster:
    """Answers a request with its script's items; one without a script is never answered
    (its first token is not due yet) until the client leaves."""

    scripts: dict[str, list[TokenChunk | FinalRecord | Exception]] = field(default_factory=dict)
    """Items to stream; an exception is raised where it stands (the cluster gave up)."""
    every: Callable[[str], list[TokenChunk | FinalRecord | Exception]] | None = None
    """The script of a request without one of its own, by its id (ids the door makes)."""
    submitted: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    model_name: str = "demo"
    max_model_len: int = CTX.max_model_len
    vocab_size: int = CTX.vocab_size

    async def submit(self, request: Request) -> AsyncIterator[TokenChunk | FinalRecord]:
        rid = request.request_id
        self.submitted.append(rid)
        if rid not in self.scripts and self.every is not None:
            self.scripts[rid] = self.every(rid)
        if rid not in self.scripts:
            await asyncio.Event().wait()
        for item in self.scripts[rid]:
            if isinstance(item, Exception):
                raise item
            yield item

    async def status(self) -> ClusterStatus:
        return ClusterStatus("demo", ())

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def metrics_snapshot(self) -> dict[str, object]:
        return {}


def door_over(cluster: ScriptedCluster, codec: TextCodec) -> FrontDoor:
    return FrontDoor(cluster, codec, CTX, ApiKeys(), FrontDoorMetrics("demo"))


def parsed(codec: TextCodec, **body: object) -> ParsedRequest:
    """Choice i of the request is cluster request r-i (r alone for one choice)."""
    return parse_body(Endpoint.COMPLETIONS, body, {}, CTX, codec, request_id="r", arrival_time=1.0)


def counted(door: FrontDoor, metric: str, label: str) -> dict[str, float]:
    """`metric`'s counts by `label`, the series still at 0 left out."""
    return {
        dict(labels)[label]: value
        for (name, labels), value in samples(door.metrics).items()
        if name == PREFIX + metric and value
    }


def cancelled(door: FrontDoor) -> dict[str, float]:
    return counted(door, "requests_cancelled_total", "verdict")


def admitted(door: FrontDoor) -> float:
    return sum(
        value
        for (name, _), value in samples(door.metrics).items()
        if name == PREFIX + "requests_admitted_total"
    )


def first_token(request_id: str) -> TokenChunk:
    return TokenChunk(request_id, (5,), (1.5,), Placement(Verdict.ADMITTED, 0, 1))


def test_a_client_gone_before_the_first_answer_is_counted_cancelled_once(
    codec: TextCodec,
) -> None:
    """Counted whether its request was waiting for the cluster's first answer or not yet
    sent, and a choice that had answered is counted by its verdict, never twice."""

    async def leave_while_waiting() -> None:
        cluster = ScriptedCluster()
        door = door_over(cluster, codec)
        start = asyncio.create_task(door.start(parsed(codec, prompt="Hi"), TENANT))
        while not cluster.submitted:
            await asyncio.sleep(0)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert cluster.aborted == ["r"]
        assert cancelled(door) == {"unknown": 1} and admitted(door) == 0

    async def leave_with_one_choice_answered() -> None:
        cluster = ScriptedCluster({"r-0": [first_token("r-0")]})
        door = door_over(cluster, codec)
        start = asyncio.create_task(door.start(parsed(codec, prompt="Hi", n=3), TENANT))
        while len(cluster.submitted) < 3:
            await asyncio.sleep(0)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert sorted(cluster.aborted) == ["r-0", "r-1", "r-2"]
        assert cancelled(door) == {"admitted": 1, "unknown": 2} and admitted(door) == 1
        # The answered choice gave its client nothing: no first token, no stage judged.
        for judged in ("slo_attained_total", "slo_violated_total"):
            assert counted(door, judged, "stage") == {}
        assert counted(door, "time_to_first_token_seconds_count", "tier") == {}

    async def leave_before_the_choices_ran() -> None:
        cluster = ScriptedCluster()
        door = door_over(cluster, codec)
        start = asyncio.create_task(door.start(parsed(codec, prompt="Hi", n=2), TENANT))
        asyncio.get_running_loop().call_soon(start.cancel)  # once it made the choices' tasks
        with pytest.raises(asyncio.CancelledError):
            await start
        assert cluster.submitted == [] and cancelled(door) == {"unknown": 2}

    asyncio.run(leave_while_waiting())
    asyncio.run(leave_with_one_choice_answered())
    asyncio.run(leave_before_the_choices_ran())


def test_a_request_the_cluster_cuts_off_mid_stream_is_counted_lost_once(codec: TextCodec) -> None:
    """Its client gets an error after its first tokens; the door counts it lost by the
    verdict it had answered with (and admitted, as a finished one would be), not cancelled."""
    lost_after_a_token = [first_token("r"), ClusterUnavailable("no replica is up")]
    door = door_over(ScriptedCluster({"r": lost_after_a_token}), codec)

    async def collect() -> None:
        (generation,) = await door.start(parsed(codec, prompt="Hi"), TENANT)
        with pytest.raises(Unavailable, match="no replica is up"):
            await generation.collect()

    asyncio.run(collect())
    lost = counted(door, "requests_lost_total", "verdict")
    assert lost == {"admitted": 1} and admitted(door) == 1 and cancelled(door) == {}


@pytest.mark.parametrize("left_at", [2.05, 2.2], ids=["before-its-next-deadline", "after"])
def test_a_client_that_leaves_mid_stream_counts_what_it_got_and_waited_for(
    codec: TextCodec, left_at: float
) -> None:
    """Its route, prompt, first token and output count as a finished request's do; its
    stage is met if it left before its second token was due (1.0 + 1.0 + 0.1 s), and missed
    if it was still waiting past that: a client giving up on a late stream is a miss."""
    cluster = ScriptedCluster({"r": [first_token("r")]})
    metrics = FrontDoorMetrics("demo")
    door = FrontDoor(cluster, codec, CTX, ApiKeys(), metrics, clock=lambda: left_at)
    body = parsed(codec, prompt="Hi", max_tokens=4, slo={"ttft_ms": 1000, "tpot_ms": 100})

    async def leave_after_the_first_token() -> None:
        (generation,) = await door.start(body, TENANT)
        events = generation.events()
        await anext(events)
        await events.aclose()
        generation.close()

    asyncio.run(leave_after_the_first_token())
    assert cancelled(door) == {"admitted": 1} and admitted(door) == 1
    attained = counted(door, "slo_attained_total", "stage")
    violated = counted(door, "slo_violated_total", "stage")
    assert (attained, violated) == (({"default": 1}, {}) if left_at < 2.1 else ({}, {"default": 1}))
    assert counted(door, "time_to_first_token_seconds_sum", "tier") == {"custom": 0.5}
    assert counted(door, "e2e_request_latency_seconds_count", "tier") == {}
    assert counted(door, "route_hops_count", "model") == {"demo": 1}
    assert counted(door, "generation_tokens_total", "tenant") == {TENANT: 1}
    prompt = counted(door, "prompt_tokens_total", "tenant")
    assert prompt == {TENANT: len(codec.encode("Hi"))}


def test_a_prompt_only_choice_reports_no_output_token_in_its_usage_or_stages(
    codec: TextCodec,
) -> None:
    """Echo with max_tokens 0: the token drawn to score the prompt is dropped from the
    output, so from the stages' token counts too (the SLO still judged its time)."""
    request = parsed(codec, prompt="Hi", echo=True, max_tokens=0, logprobs=0)
    assert request.echo[0].prompt_only
    score = TokenLogprob(-1.0, ())
    token = TokenChunk("r", (5,), (1.5,), Placement(Verdict.ADMITTED, 0, 1), (score,), (score,))
    final = FinalRecord(
        "r",
        Verdict.ADMITTED,
        0,
        1,
        "length",
        arrival_time=1.0,
        first_token_time=1.5,
        finish_time=1.5,
        num_prompt_tokens=2,
        num_output_tokens=1,
        stages=(StageVerdict("default", False, 1, 1),),
    )
    door = door_over(ScriptedCluster({"r": [token, final]}), codec)

    async def collect() -> FinalRecord:
        (generation,) = await door.start(request, TENANT)
        return (await generation.collect()).record

    record = asyncio.run(collect())
    assert record.num_output_tokens == 0
    assert record.stages == (StageVerdict("default", False, 0, 0),)
    assert counted(door, "generation_tokens_total", "tenant") == {}  # as its usage says
    assert counted(door, "slo_violated_total", "stage") == {"default": 1}


def test_a_grpc_request_the_door_cannot_map_is_counted_as_a_bad_request(codec: TextCodec) -> None:
    """As an HTTP body the door cannot parse is: tools with a prompt are refused before the
    door parses anything (router.grpc_server.request_to_body)."""

    async def send() -> None:
        door = door_over(ScriptedCluster(), codec)
        server = await start_grpc_server(door, "127.0.0.1", 0)
        try:
            async with AsyncClient(f"127.0.0.1:{server.port}") as client:
                with pytest.raises(ClientError, match="tools is chat-only") as info:
                    await client.complete("Hi", tools=[Tool("lookup")], timeout_s=10)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop()
        assert counted(door, "requests_rejected_total", "reason") == {"bad_request": 1}

    asyncio.run(send())


def test_a_stopping_grpc_door_refuses_new_generations_and_waits_for_running_ones_only(
    codec: TextCodec,
) -> None:
    """A stopping door's generations in flight get the grace, a new one is refused at once
    (UNAVAILABLE, which clients retry on the next door), and a health Watch stream, which
    never ends by itself, does not hold the stop for the whole grace (grpc's own grace did)."""

    async def run() -> None:
        cluster = ScriptedCluster()
        server = await start_grpc_server(door_over(cluster, codec), "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            await anext(aiter(watch))
            serving = pb_grpc.ServingStub(channel)
            running = serving.Generate(pb.GenerateRequest(prompt="Hi"))  # never answered
            while not cluster.submitted:
                await asyncio.sleep(0.01)
            began = time.monotonic()
            stopping = asyncio.ensure_future(server.stop(grace_s=2.0))
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anext(aiter(serving.Generate(pb.GenerateRequest(prompt="Hi"))))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "stopping" in (refused.value.details() or "")
            await stopping
            assert 1.9 <= time.monotonic() - began < 5  # the running one had its grace
            with pytest.raises(grpc.aio.AioRpcError):
                await anext(aiter(running))
        idle = await start_grpc_server(door_over(ScriptedCluster(), codec), "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{idle.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            await anext(aiter(watch))
            began = time.monotonic()
            await idle.stop(grace_s=30.0)
            assert time.monotonic() - began < 5

    asyncio.run(run())


def test_choices_given_up_for_a_rejected_sibling_count_lost_not_cancelled(
    codec: TextCodec,
) -> None:
    """n > 1 is all or nothing: the admitted choices of a request another choice of which was
    rejected are ended by the door, not by their client."""
    rejected = FinalRecord("r-1", Verdict.REJECTED, None, 2, reason="no replica could")
    cluster = ScriptedCluster({"r-0": [first_token("r-0")], "r-1": [rejected]})
    door = door_over(cluster, codec)

    async def start() -> None:
        with pytest.raises(Rejected, match="no replica could"):
            await door.start(parsed(codec, prompt="Hi", n=2), TENANT)

    asyncio.run(start())
    assert cluster.aborted == ["r-0"]
    assert counted(door, "requests_lost_total", "verdict") == {"admitted": 1}
    assert cancelled(door) == {}
