"""The gRPC door: `slos_serve.v1.Serving`, grpc.health.v1 health checking, server reflection.

Why a grpc.aio server hosted inside the Ray Serve ingress replica, not Ray Serve's gRPC proxy:
the proxy serves only user methods routed by its own metadata (`application`), answers health
on its own RayServeAPIService instead of the standard grpc.health.v1 that load balancers and
Kubernetes probes speak, offers no server reflection, and would put a second hop between the
client and the FrontDoor. Hosting grpc.aio in the same replica (same event loop) as the HTTP
door shares one FrontDoor, one tokenizer, one metrics registry and one cluster handle.
SO_REUSEPORT (grpc's default on Linux) lets several ingress replicas on a node share the port.

Every request goes through the same `router.openai_schema` validation as HTTP: the protobuf
message is turned into the equivalent OpenAI body first. A started stream's initial metadata
carries the HTTP door's `x-slos-serve-verdict`, `-replica` and `-hops` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cluster.api import ClusterStatus, FinalRecord
from replica.batch import TokenLogprob
from router import json_text
from router.client import OPTIONAL_SCALARS
from router.errors import ApiError, BadRequest, Unavailable
from router.frontdoor import Finished, FrontDoor, interleaved
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc
from router.openai_format import ChoiceText, abort_reason, placement_headers
from router.openai_schema import Endpoint

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Serving"].full_name
HEALTH_PERIOD_S = 5.0

logger = logging.getLogger(__name__)


def request_to_body(
    request: pb.GenerateRequest, default_model: str
) -> tuple[Endpoint, dict[str, Any]]:
    """The OpenAI body equivalent to a GenerateRequest (only the fields it sets)."""
    inputs = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
    if not any(inputs):  # proto3 cannot tell an empty prompt from none
        raise BadRequest("prompt, prompt_token_ids and messages are all empty: set one", "prompt")
    if sum(inputs) > 1:
        raise BadRequest("set exactly one of prompt, prompt_token_ids, messages", "prompt")
    body: dict[str, Any] = {"model": request.model or default_model}
    endpoint = Endpoint.CHAT if request.messages else Endpoint.COMPLETIONS
    if request.messages:
        body["messages"] = [_message_to_body(m) for m in request.messages]
    else:
        body["prompt"] = request.prompt or list(request.prompt_token_ids)
        _refuse_chat_only(request)
    for name in OPTIONAL_SCALARS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in request.logit_bias.items()}
    if request.min_tokens:
        body["min_tokens"] = request.min_tokens
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.allowed_token_ids:
        body["allowed_token_ids"] = list(request.allowed_token_ids)
    if request.bad_words:
        body["bad_words"] = list(request.bad_words)
    if request.HasField("structured_outputs"):
        body["structured_outputs"] = _structured_to_body(request.structured_outputs)
    if request.tools:
        body["tools"] = [_tool_to_body(i, tool) for i, tool in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice")
    if choice == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif choice == "function":
        function = {"name": request.tool_choice.function}
        body["tool_choice"] = {"type": "function", "function": function}
    if "seed" in body and body["seed"] >= 2**63:
        body["seed"] -= 2**64  # uint64 read as int64, as HTTP takes seeds: every value is one
    if request.service_tier not in (pb.SERVICE_TIER_DEFAULT, pb.SERVICE_TIER_FLEX):
        raise BadRequest(f"unknown service_tier {request.service_tier}", "service_tier")
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if request.n:
        body["n"] = request.n
    if request.HasField("logprobs"):
        if endpoint is Endpoint.CHAT:
            body |= {"logprobs": True, "top_logprobs": request.logprobs}
        else:
            body["logprobs"] = request.logprobs
    if request.priority:
        body["priority"] = request.priority
    if request.service_tier == pb.SERVICE_TIER_FLEX:
        body["service_tier"] = "flex"
    if request.HasField("slo"):
        body["slo"] = _slo_to_body(request.slo)
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = _json(request.chat_template_kwargs, "chat_template_kwargs")
    return endpoint, body


def _refuse_chat_only(request: pb.GenerateRequest) -> None:
    """A 400 naming a chat-only field set with a prompt: HTTP's completions know no such
    field, but a gRPC caller picked no endpoint, only the input."""
    chat_only = {
        "tools": bool(request.tools),
        "tool_choice": request.tool_choice.WhichOneof("choice") is not None,
        "parallel_tool_calls": request.HasField("parallel_tool_calls"),
        "add_generation_prompt": request.HasField("add_generation_prompt"),
        "continue_final_message": request.HasField("continue_final_message"),
        "chat_template_kwargs": bool(request.chat_template_kwargs),
        "include_reasoning": request.HasField("include_reasoning"),
        "reasoning_effort": request.HasField("reasoning_effort"),
    }
    given = [name for name, is_set in chat_only.items() if is_set]
    if given:
        raise BadRequest(f"{given[0]} is chat-only: send messages, not a prompt", given[0])


def _message_to_body(message: pb.ChatMessage) -> dict[str, Any]:
    body: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        body["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id or message.role == "tool":
        body["tool_call_id"] = message.tool_call_id
    if message.name:
        body["name"] = message.name
    if message.reasoning_content:
        body["reasoning_content"] = message.reasoning_content
    return body


def _tool_to_body(index: int, tool: pb.Tool) -> dict[str, Any]:
    """OpenAI's function tool; its parameters schema parsed from the text the proto carries."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = _json(tool.parameters, f"tools[{index}].parameters")
    return {"type": "function", "function": function}


def _json(text: str, where: str) -> Any:
    """A field the proto carries as JSON text, parsed (the HTTP door checks what it holds)."""
    try:
        return json_text.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"{where} is not JSON: {exc}", where) from None


def _structured_to_body(wanted: pb.StructuredOutputs) -> dict[str, Any]:
    """The fields it sets, as the HTTP door's `structured_outputs` (which wants exactly one)."""
    fields = {
        "json": wanted.json,
        "regex": wanted.regex,
        "choice": list(wanted.choice),
        "grammar": wanted.grammar,
        "json_object": wanted.json_object,
    }
    return {name: value for name, value in fields.items() if value}


def _slo_to_body(slo: pb.SLO) -> str | dict[str, Any]:
    if slo.tier:
        if slo.HasField("ttft_ms") or slo.HasField("tpot_ms") or slo.stages:
            raise BadRequest("slo.tier excludes ttft_ms, tpot_ms and stages", "slo.tier")
        return slo.tier
    out: dict[str, Any] = {}
    for name in ("ttft_ms", "tpot_ms"):
        if slo.HasField(name):
            out[name] = getattr(slo, name)
    if slo.stages:
        out["stages"] = [_stage_to_body(s) for s in slo.stages]
    return out


def _stage_to_body(stage: pb.Stage) -> dict[str, Any]:
    out: dict[str, Any] = {"tpot_ms": stage.tpot_ms, "name": stage.name}
    for name in ("num_tokens", "ttft_ms"):
        if stage.HasField(name):
            out[name] = getattr(stage, name)
    for name in ("end_token_ids", "until"):
        if getattr(stage, name):
            out[name] = list(getattr(stage, name))
    return out


def final_to_proto(
    record: FinalRecord,
    stop_reason: str | int | None = None,
    index: int = 0,
    tool_calls: Sequence[dict[str, Any]] = (),
    finish_reason: str | None = None,
    reasoning_tokens: int | None = None,
) -> pb.Final:
    """`tool_calls` (OpenAI's form) and `finish_reason`: what tool calling made of the output
    (the record's finish reason otherwise)."""
    final = pb.Final(
        index=index,
        request_id=record.request_id,
        verdict=record.verdict.value,
        hops=record.hops,
        finish_reason=finish_reason or record.finish_reason or "",
        tool_calls=[_tool_call_to_proto(c) for c in tool_calls],
        prompt_tokens=record.num_prompt_tokens,
        cached_tokens=record.num_cached_tokens,
        completion_tokens=record.num_output_tokens,
        migrations=record.migrations,
        abort_reason=abort_reason(record),
        reasoning_tokens=reasoning_tokens,
        stages=[
            pb.StageVerdict(
                name=s.name, attained=s.attained, late_tokens=s.late_tokens, tokens=s.tokens
            )
            for s in record.stages
        ],
    )
    if record.replica is not None:
        final.replica = record.replica
    if record.slo_attained is not None:
        final.slo_attained = record.slo_attained
    if record.first_token_time is not None:
        final.ttft_s = record.first_token_time - record.arrival_time
    if record.finish_time is not None:
        final.e2e_s = record.finish_time - record.arrival_time
    if isinstance(stop_reason, str):
        final.stop_string = stop_reason
    elif stop_reason is not None:
        final.stop_token_id = stop_reason
    return final


def _tool_call_to_proto(call: dict[str, Any]) -> pb.ToolCall:
    function = call["function"]
    return pb.ToolCall(id=call["id"], name=function["name"], arguments=function["arguments"])


def _logprob_to_proto(logprob: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=token, logprob=value) for token, value in logprob.top]
    return pb.TokenLogprob(logprob=logprob.logprob, top=top)


def status_to_proto(status: ClusterStatus) -> pb.ClusterStatus:
    return pb.ClusterStatus(
        model=status.model,
        replicas=[
            pb.ReplicaStatus(
                replica=r.replica,
                alive=r.alive,
                running=r.running,
                waiting=r.waiting,
                admitted=r.admitted,
                best_effort=r.best_effort,
                kv_usage=r.kv_usage,
                calibration=dict(r.calibration),
                draining=r.draining,
            )
            for r in status.replicas
        ],
        counters=dict(status.counters),
        scheduler=status.scheduler,
        target_replicas=status.target_replicas,
        starting=status.starting,
        start_error=status.start_error,
    )


async def _abort(context: grpc.aio.ServicerContext, error: ApiError) -> None:
    if error.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(error.retry_after_s * 1000))),))
    named = not error.param or error.message.startswith(error.param)
    details = error.message if named else f"{error.param}: {error.message}"
    await context.abort(error.code, details)


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


class ServingServicer(pb_grpc.ServingServicer):
    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.stopping = False
        """The door is stopping: new generations are refused (UNAVAILABLE, which clients
        retry elsewhere) while those running finish."""
        self.generating = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.stopping:
            await _abort(context, Unavailable("this front door is stopping; try again"))
            return
        self.generating += 1
        self.idle.clear()
        try:
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.generating -= 1
            if not self.generating:
                self.idle.set()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse]:
        metadata = _metadata(context)
        try:
            tenant = self.door.authenticate(metadata.get("authorization"))
            try:
                endpoint, body = request_to_body(request, self.door.model_name)
            except BadRequest:  # counted as the door counts a body it cannot parse
                self.door.metrics.reject(tenant, "bad_request")
                raise
            parsed = self.door.parse(endpoint, body, metadata, tenant)
            generations = await self.door.start(parsed, tenant)
        except ApiError as exc:
            await _abort(context, exc)
            return
        failed = False
        try:
            choices = [ChoiceText(parsed.tools, parsed.reasoning) for _ in generations]
            placement = placement_headers([g.placement for g in generations])
            if placement:
                await context.send_initial_metadata(tuple(placement.items()))
            async with contextlib.aclosing(interleaved(generations)) as events:
                async for index, event in events:
                    if isinstance(event, Finished):
                        record = event.record
                        thought, rest, calls, reason = choices[index].finish(record.finish_reason)
                        if thought or rest:
                            chunk = pb.TextChunk(text=rest, reasoning=thought, index=index)
                            yield pb.GenerateResponse(chunk=chunk)
                        final = final_to_proto(
                            record,
                            event.stop_reason,
                            index,
                            calls or (),
                            reason,
                            event.reasoning_tokens,
                        )
                        yield pb.GenerateResponse(final=final)
                    elif event.text or event.token_ids:
                        thought, text = choices[index].add(event.text)
                        chunk = pb.TextChunk(
                            text=text,
                            token_ids=event.token_ids,
                            index=index,
                            logprobs=[_logprob_to_proto(lp) for lp in event.logprobs],
                            reasoning=thought,
                        )
                        yield pb.GenerateResponse(chunk=chunk)
        except ApiError as exc:
            failed = True
            await _abort(context, exc)
        finally:
            for generation in generations:
                generation.close(lost=failed)

    async def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClusterStatus:
        try:
            self.door.authenticate(_metadata(context).get("authorization"))
            status = await self.door.status()
        except ApiError as exc:  # Unavailable included: the controller does not answer
            await _abort(context, exc)
            raise  # not reached: grpc's abort raises
        return status_to_proto(status)


class GrpcServer:
    """A running gRPC door and the task that keeps its health status current."""

    def __init__(
        self, server: grpc.aio.Server, port: int, health: HealthServicer, serving: ServingServicer
    ):
        self.server = server
        self.port = port
        self.health = health
        self.serving = serving
        self.health_task = asyncio.create_task(self._watch_health())

    async def _watch_health(self) -> None:
        while True:
            try:
                status = await self.serving.door.status()
                up = any(r.alive for r in status.replicas)
            except Unavailable:
                up = False
            serving = health_pb2.HealthCheckResponse.SERVING
            state = serving if up else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await self.health.set(name, state)
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Refuse new generations from now on (health checks say NOT_SERVING) and let those in
        flight finish for up to `grace_s`, then stop, cancelling what is left. Only
        generations are waited for: a health `Watch` stream never ends by itself, and grpc's
        own grace would wait for it to the end."""
        self.serving.stopping = True
        self.health_task.cancel()
        await self.health.enter_graceful_shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.serving.idle.wait(), grace_s)
        await self.server.stop(0)


async def start_grpc_server(
    door: FrontDoor,
    host: str,
    port: int,
    *,
    tls: tuple[bytes, bytes] | None = None,
) -> GrpcServer:
    """Bind, register Serving + health + reflection, start; port 0 picks a free port.
    `tls`: (certificate chain, private key) PEM to serve TLS with; None: plaintext."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", door.schema.max_request_bytes)]
    )
    serving = ServingServicer(door)
    pb_grpc.add_ServingServicer_to_server(serving, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    if tls is not None:
        cert, key = tls
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        bound = server.add_insecure_port(address)
    await server.start()
    logger.info("gRPC door listening on %s:%d (%s)", host, bound, "TLS" if tls else "plaintext")
    return GrpcServer(server, bound, health, serving)
