"""Python SDK for the gRPC door: `Client` (blocking) and `AsyncClient` (asyncio).

`generate` streams `Chunk`s and ends each choice with its `Result` (verdict, replica, hops,
usage, SLO attainment; one choice unless `n` > 1); the first `Chunk` already says where the
request was bound (`placement`, from the initial metadata). Calls have a deadline
(`timeout_s`, spanning retries). Only UNAVAILABLE is retried, with exponential backoff, and
only before the first response arrived: a started stream is never replayed, so no token is
ever delivered twice. Every other failure raises `ClientError` with the gRPC code
(RESOURCE_EXHAUSTED carries the server's retry-after), a stream that ends without each
choice's `Result` and metadata that does not parse included. While the server is down the
channels try to reconnect at most 2 s apart (`CHANNEL_OPTIONS`), so a restarted server is
reached again within seconds; with `wait_for_ready` a call waits for it (until its
deadline) instead of failing. A blocking stream is a `Stream`, which another thread may
`cancel()`. A client belongs to its process: a worker process (multiprocessing) makes its own,
as grpc channels are not carried across a fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import reprlib
import threading
import time
from collections.abc import (
    AsyncGenerator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import json_format

from cluster.api import ClusterStatus, Placement, ReplicaStatus, Verdict
from replica.batch import TokenLogprob
from replica.request import SLO
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc
from router.wire import (
    ECHOED_MESSAGE_FIELDS,
    HEADER_HOPS,
    HEADER_REPLICA,
    HEADER_VERDICT,
    MESSAGE_FIELDS,
    SENT_MESSAGE_FIELDS,
    STAGE_FIELDS,
    message_content,
    message_reasoning,
    tool_call_fields,
)


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]
    placement: Placement | None = None
    """On the first chunk: where the cluster bound the request (verdict, replica, hops), from
    the server's initial metadata, so a caller that stops reading early still knows it. With
    n > 1 the choices may differ; each one's `Result` says where it ran."""
    index: int = 0
    """The choice (sample) the chunk belongs to: 0 .. n - 1."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token id when `logprobs` was asked for."""
    reasoning: str = ""
    """The thinking the chunk adds, apart from `text` (the answer): chat, on a server with a
    reasoning parser."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """A JSON object, as its text (one cut by max_tokens is not JSON; sent back in a chat,
    the template gets it as that text)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str | Mapping[str, Any] | None = None
    """The JSON schema of its arguments object, as an object or its text (None: none)."""


@dataclass(frozen=True)
class CallTool:
    """`tool_choice` naming the tool the output must call (its arguments are the output)."""

    name: str


@dataclass(frozen=True)
class ChatMessage:
    """A message with what a (role, content) pair cannot say: an assistant's earlier calls, or
    the call a tool message answers."""

    role: str
    content: str = ""
    tool_calls: Sequence[ToolCall] = ()
    tool_call_id: str = ""
    name: str = ""
    """The participant's name, for chat templates that show it."""


Message = tuple[str, str] | Mapping[str, Any] | ChatMessage
"""A chat message: a (role, content) pair, an OpenAI chat message (role, content as a string
or text parts, and optionally name, tool_calls, tool_call_id), or a `ChatMessage`."""


@dataclass(frozen=True)
class StageResult:
    name: str
    attained: bool
    late_tokens: int
    tokens: int = 0
    """Output tokens the stage covered."""


@dataclass(frozen=True)
class Result:
    """What the cluster did with the request; the last item of every stream."""

    request_id: str
    verdict: Verdict
    """admitted | best_effort."""
    replica: int | None
    hops: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    slo_attained: bool | None
    stages: tuple[StageResult, ...]
    migrations: int
    ttft_s: float | None
    e2e_s: float | None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the output (None: EOS, or not stopped)."""
    index: int = 0
    """The choice (sample) it ends: 0 .. n - 1."""
    cached_tokens: int = 0
    """Of `prompt_tokens`, those a replica's prefix cache held."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the output made (chat with tools; finish_reason tool_calls, or stop for a
    named tool): the chunks' text was the message content alone."""
    abort_reason: str = ""
    """Why, when finish_reason is abort and the server knows (say, an output grammar the
    model could no longer follow)."""
    reasoning_tokens: int | None = None
    """Of `completion_tokens`, the thinking's (between its markers); None when the server
    has no reasoning parser for the model."""


@dataclass(frozen=True)
class Completion:
    text: str
    result: Result
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""
    """The thinking apart from `text` (chat, on a server with a reasoning parser)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int | None = None
    """None: as many as `max_retry_s` allows."""
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    max_retry_s: float = 60.0
    """No retry starts later than this after the first attempt. A Serve update that replaces
    the front door closes its gRPC port for 10-40 s (Serve stops the old door before the new
    one listens); four attempts gave up after 0.7 s."""

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not (math.isfinite(self.max_retry_s) and self.max_retry_s >= 0):
            raise ValueError(f"max_retry_s must be >= 0 and finite, got {self.max_retry_s}")

    def gives_up(self, attempt: int, retry_at: float) -> bool:
        """Whether call `attempt` failing ends the retries, the next one being due `retry_at`
        seconds after the first began."""
        spent = self.max_attempts is not None and attempt >= self.max_attempts
        return spent or retry_at > self.max_retry_s

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number `attempt` (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))


class ClientError(Exception):
    """A call that failed: its gRPC status `code`, what the server said (`details`) and, on
    RESOURCE_EXHAUSTED, when the server suggests trying again (`retry_after_s`)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(code, details, retry_after_s)  # all of them: it pickles (a worker's)
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


@dataclass(frozen=True)
class StructuredOutputs:
    """Structured output (vLLM's `structured_outputs`): set exactly one field."""

    json: str | Mapping[str, Any] | None = None
    """A JSON schema, as an object or its text."""
    regex: str | None = None
    choice: Sequence[str] = field(default_factory=tuple)
    grammar: str | None = None
    """Lark or GBNF."""
    json_object: bool = False


@dataclass(frozen=True)
class GenerateOptions:
    """Everything `generate` sends besides the input; see the proto for each field."""

    max_tokens: int | None = None
    slo: SLO | Mapping[str, Any] | str | None = None
    """An SLO; or HTTP's `slo` object as a dict (ttft_ms, tpot_ms, stages of dicts with
    tpot_ms, name, num_tokens, ttft_ms, end_token_ids, until; what it leaves out is the
    server's default); or the name of a tier the server configured."""
    service_tier: str = "default"
    """default | flex (best-effort)."""
    priority: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False
    model: str = ""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    allowed_token_ids: Sequence[int] | None = None
    """The only tokens the output may hold; None allows any (an empty list is refused, as
    HTTP refuses it: proto3 would send it as unset, allowing any)."""
    bad_words: Sequence[str] = field(default_factory=tuple)
    n: int = 1
    """Samples of the prompt, each its own request (`Chunk.index`, one `Result` each)."""
    logprobs: int | None = None
    """Each token's log-probability and its `logprobs` most likely alternatives (0..20)."""
    structured_outputs: StructuredOutputs | None = None
    """Every token follows it; the output ends once it is complete."""
    tools: Sequence[Tool | Mapping[str, Any]] = field(default_factory=tuple)
    """Chat only: functions the model may call, as `Tool`s or OpenAI's tool dicts
    ({"type": "function", "function": {name, description, parameters}})."""
    tool_choice: str | CallTool | None = None
    """none | auto | required, or the tool to call; None: auto with tools (the deployment
    must name a tool_call_parser), none without."""
    parallel_tool_calls: bool | None = None
    """False: one call at most."""
    add_generation_prompt: bool | None = None
    """Chat only: False leaves the template's generation prompt out."""
    continue_final_message: bool | None = None
    """Chat only: the output continues the last (assistant) message."""
    chat_template_kwargs: str | Mapping[str, Any] | None = None
    """Chat only: the template's own variables, as an object or its JSON text."""
    include_reasoning: bool | None = None
    """Chat only: False drops the thinking (no `Chunk.reasoning`)."""
    reasoning_effort: str | None = None
    """Chat only: OpenAI's minimal | low | medium | high, which the chat template gets."""


OPTIONAL_SCALARS = tuple(
    f.name
    for f in pb.GenerateRequest.DESCRIPTOR.fields
    if f.has_presence and f.message_type is None
)
"""GenerateRequest's scalars that may be unset (the server's default then applies), named as
their `GenerateOptions` and OpenAI fields."""


def _wire_value(name: str, value: float) -> float:
    """vLLM's conventions on the proto's unsigned fields: top_k -1 is off (0), and a negative
    seed travels as its 64-bit two's complement (the server reads it back as int64)."""
    if name == "top_k" and value == -1:
        return 0
    if name == "seed" and -(2**63) <= value < 0:
        return value + 2**64
    return value


def _structured(wanted: StructuredOutputs) -> pb.StructuredOutputs:
    schema = wanted.json
    if isinstance(wanted.choice, str):
        raise ValueError(
            f"structured_outputs choice must be a list of strings, got {wanted.choice!r}"
        )
    try:
        return pb.StructuredOutputs(
            json=schema if schema is None or isinstance(schema, str) else json.dumps(schema),
            regex=wanted.regex,
            choice=list(wanted.choice),
            grammar=wanted.grammar,
            json_object=wanted.json_object,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs={wanted!r}: {exc}") from None


def _tool(tool: Tool | Mapping[str, Any]) -> pb.Tool:
    if isinstance(tool, Mapping):
        tool = _openai_tool(tool)
    if not isinstance(tool, Tool):
        raise ValueError(f"tools must be Tool objects or OpenAI's tool dicts, got {tool!r}")
    schema = tool.parameters
    try:
        text = schema if schema is None or isinstance(schema, str) else json.dumps(schema)
        return pb.Tool(name=tool.name, description=tool.description, parameters=text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tool {tool.name!r}: {exc}") from None


def _openai_tool(raw: Mapping[str, Any]) -> Tool:
    """OpenAI's {"type": "function", "function": {...}} as a `Tool` (the server checks the
    rest, as HTTP does)."""
    function = raw.get("function")
    if raw.get("type") != "function" or not isinstance(function, Mapping):
        raise ValueError(f'a tool dict is {{"type": "function", "function": {{...}}}}, got {raw!r}')
    name = function.get("name")
    if not isinstance(name, str):
        raise ValueError(f"a tool's function needs a name, got {dict(function)!r}")
    return Tool(name, function.get("description", ""), function.get("parameters"))


def _tool_choice(choice: str | CallTool) -> pb.ToolChoice:
    if isinstance(choice, CallTool):
        return pb.ToolChoice(function=choice.name)
    if choice not in ("none", "auto", "required"):
        raise ValueError(
            f'tool_choice must be "none", "auto", "required" or a CallTool, got {choice!r}'
        )
    return pb.ToolChoice(mode=choice)


def _message(index: int, message: Message) -> pb.ChatMessage:
    if isinstance(message, ChatMessage):
        calls = [
            pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls
        ]
        return pb.ChatMessage(
            role=message.role,
            content=message.content,
            tool_calls=calls,
            tool_call_id=message.tool_call_id,
            name=message.name,
        )
    if isinstance(message, Mapping):
        return _openai_message(index, message)
    if isinstance(message, tuple | list) and len(message) == 2:
        role, content = message
    else:
        raise ValueError(
            f"messages[{index}] must be a (role, content) pair, an OpenAI chat message (a "
            f"dict) or a ChatMessage, got {reprlib.repr(message)}"
        )
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(
            f"messages[{index}]: role and content must be strings, got {reprlib.repr(message)}"
        )
    return pb.ChatMessage(role=role, content=content)


def _openai_message(index: int, message: Mapping[str, Any]) -> pb.ChatMessage:
    """An OpenAI chat message as the proto says it: an assistant's calls flattened to
    (id, name, arguments), content null only beside calls, as OpenAI allows it, text parts
    joined, and the fields a response's message echoes (refusal, ...) dropped, as HTTP
    takes them."""
    where = f"messages[{index}]"
    _known_fields(message, SENT_MESSAGE_FIELDS, where, ignored=ECHOED_MESSAGE_FIELDS)
    fields = {k: v for k, v in message.items() if k in MESSAGE_FIELDS}
    thinking = message_reasoning(message, where)
    if thinking is not None:
        fields["reasoning_content"] = thinking
    calls = fields.pop("tool_calls", None)
    if calls is not None:
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise ValueError(f"{where}.tool_calls must be a list, got {reprlib.repr(calls)}")
        fields["tool_calls"] = [
            _openai_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
        ]
        if fields.get("content") is None:
            fields["content"] = ""
    fields["content"] = message_content(fields.get("content"), f"{where}.content")
    try:
        return json_format.ParseDict(fields, pb.ChatMessage())
    except json_format.ParseError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _openai_call(call: object, where: str) -> dict[str, str]:
    """An earlier call as the proto's ToolCall, checked as HTTP checks it."""
    call_id, name, arguments = tool_call_fields(call, where)
    return {"id": call_id, "name": name, "arguments": arguments}


def build_request(
    prompt: str | Sequence[int] | None,
    messages: Sequence[Message] | None,
    options: GenerateOptions,
) -> pb.GenerateRequest:
    if options.service_tier not in ("default", "flex"):
        raise ValueError(f"service_tier must be default or flex, got {options.service_tier!r}")
    for name in ("stop", "bad_words"):
        if isinstance(getattr(options, name), str):
            raise ValueError(f"{name} must be a list of strings, got {getattr(options, name)!r}")
    request = pb.GenerateRequest(
        model=options.model,
        ignore_eos=options.ignore_eos,
        include_stop_str_in_output=options.include_stop_str_in_output,
        service_tier=pb.SERVICE_TIER_FLEX
        if options.service_tier == "flex"
        else pb.SERVICE_TIER_DEFAULT,
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, bytes | bytearray):  # a sequence of ints, but not token ids
        raise ValueError("prompt must be text or a list of token ids, got bytes: decode them")
    elif prompt is not None:
        if not isinstance(prompt, Sequence):
            raise ValueError(f"prompt must be text or a list of token ids, got {prompt!r}")
        try:
            request.prompt_token_ids.extend(prompt)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"prompt={reprlib.repr(prompt)}: {exc} (a prompt is text or a list of token "
                "ids, one prompt a call)"
            ) from None
    request.messages.extend(_message(i, m) for i, m in enumerate(messages or ()))
    request.tools.extend(_tool(t) for t in options.tools)
    if options.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(options.tool_choice))
    for name in OPTIONAL_SCALARS:
        value = getattr(options, name)
        if value is not None:
            try:
                setattr(request, name, _wire_value(name, value))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}={value!r}: {exc}") from None
    setters: dict[str, Callable[[Any], object]] = {
        "stop": request.stop.extend,
        "logit_bias": request.logit_bias.update,
        "stop_token_ids": request.stop_token_ids.extend,
        "allowed_token_ids": lambda ids: request.allowed_token_ids.extend(ids or ()),
        "bad_words": request.bad_words.extend,
        "min_tokens": functools.partial(setattr, request, "min_tokens"),
        "n": functools.partial(setattr, request, "n"),
        "priority": functools.partial(setattr, request, "priority"),
    }
    for name, put in setters.items():
        value = getattr(options, name)
        try:
            put(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None
    if request.n < 1:  # proto3 sends 0 as unset, which the server serves as one choice
        raise ValueError(f"n={options.n!r}: must be at least 1")
    if options.allowed_token_ids is not None and not request.allowed_token_ids:
        raise ValueError("allowed_token_ids=[]: name at least one token id (None allows any)")
    if options.structured_outputs is not None:
        request.structured_outputs.CopyFrom(_structured(options.structured_outputs))
    kwargs = options.chat_template_kwargs
    if kwargs is not None:
        try:
            request.chat_template_kwargs = kwargs if isinstance(kwargs, str) else json.dumps(kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"chat_template_kwargs={reprlib.repr(kwargs)}: {exc}") from None
    if isinstance(options.slo, str):
        request.slo.tier = options.slo
    elif isinstance(options.slo, Mapping):  # HTTP's slo object: the server checks and fills it
        _http_slo(options.slo, request.slo)
    elif options.slo is not None:
        if not isinstance(options.slo, SLO):
            raise ValueError(
                f"slo must be an SLO, a dict of HTTP's slo fields or a tier name, got "
                f"{options.slo!r}"
            )
        slo = options.slo
        request.slo.ttft_ms = slo.ttft_ms
        request.slo.tpot_ms = slo.tpot_ms
        for st in slo.stages:
            stage = request.slo.stages.add(tpot_ms=st.tpot_ms, name=st.name)
            if st.num_tokens is not None:
                stage.num_tokens = st.num_tokens
            if st.ttft_ms is not None:
                stage.ttft_ms = st.ttft_ms
            stage.end_token_ids.extend(st.end_token_ids)
    return request


def _http_slo(raw: Mapping[str, Any], slo: pb.SLO) -> None:
    """HTTP's `slo` object into `slo`, taking what HTTP takes (`until` as a string or a list,
    numbers as numbers) and naming fields as HTTP does; the server checks the values."""
    _known_fields(raw, ("ttft_ms", "tpot_ms", "stages"), "slo")
    stages = raw.get("stages")
    if stages is not None and not isinstance(stages, list | tuple):
        raise ValueError(f"slo.stages must be a list of stage dicts, got {stages!r}")
    try:
        _numbers(raw, slo, ("ttft_ms", "tpot_ms"), "slo")
        for i, raw_stage in enumerate(stages or ()):
            where = f"slo.stages[{i}]"
            if not isinstance(raw_stage, Mapping):
                raise ValueError(f"{where} must be a dict, got {raw_stage!r}")
            _known_fields(raw_stage, STAGE_FIELDS, where)
            stage = slo.stages.add()
            _numbers(raw_stage, stage, ("tpot_ms", "ttft_ms"), where)
            if raw_stage.get("num_tokens") is not None:
                stage.num_tokens = raw_stage["num_tokens"]
            stage.name = raw_stage.get("name", "")
            stage.end_token_ids.extend(raw_stage.get("end_token_ids") or ())
            until = raw_stage.get("until")
            if until is not None:
                stage.until.extend([until] if isinstance(until, str) else until)
    except TypeError as exc:
        raise ValueError(f"slo={dict(raw)!r}: {exc}") from None


def _known_fields(
    raw: Mapping[str, Any], known: Sequence[str], where: str, ignored: Sequence[str] = ()
) -> None:
    """Refuse the keys of `raw` neither `known` nor `ignored` (taken and dropped)."""
    extra = sorted(str(k) for k in raw if k not in known and k not in ignored)
    if extra:
        raise ValueError(
            f"{where} has unknown field(s) {', '.join(extra)}; known: {', '.join(known)}"
        )


def _numbers(raw: Mapping[str, Any], message: Any, names: Sequence[str], where: str) -> None:
    """Copy the numbers `names` (those given) into `message`'s fields of the same names."""
    for name in names:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}.{name} must be a number, got {value!r}")
        setattr(message, name, value)


def result_from_proto(final: pb.Final) -> Result:
    try:
        verdict = Verdict(final.verdict)
    except ValueError:
        raise ClientError(
            grpc.StatusCode.INTERNAL, f"the server sent an unknown verdict {final.verdict!r}"
        ) from None
    return Result(
        request_id=final.request_id,
        verdict=verdict,
        replica=final.replica if final.HasField("replica") else None,
        hops=final.hops,
        finish_reason=final.finish_reason,
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        reasoning_tokens=final.reasoning_tokens if final.HasField("reasoning_tokens") else None,
        slo_attained=final.slo_attained if final.HasField("slo_attained") else None,
        stages=tuple(
            StageResult(s.name, s.attained, s.late_tokens, s.tokens) for s in final.stages
        ),
        migrations=final.migrations,
        ttft_s=final.ttft_s if final.HasField("ttft_s") else None,
        e2e_s=final.e2e_s if final.HasField("e2e_s") else None,
        stop_reason=final.stop_token_id
        if final.HasField("stop_token_id")
        else final.stop_string or None,
        index=final.index,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in final.tool_calls),
        abort_reason=final.abort_reason,
    )


def status_from_proto(status: pb.ClusterStatus) -> ClusterStatus:
    return ClusterStatus(
        model=status.model,
        replicas=tuple(
            ReplicaStatus(
                r.replica,
                r.alive,
                r.running,
                r.waiting,
                r.admitted,
                r.best_effort,
                r.kv_usage,
                dict(r.calibration),
                r.draining,
            )
            for r in status.replicas
        ),
        counters=dict(status.counters),
        scheduler=status.scheduler,
        target_replicas=status.target_replicas,
        starting=status.starting,
        start_error=status.start_error,
    )


def placement_from_metadata(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> Placement | None:
    """The `x-slos-serve-*` initial metadata; None when the server sent none. Choices bound
    to different replicas name none: the weakest verdict and the most hops."""
    values = {k: v for k, v in metadata or () if isinstance(v, str)}
    if HEADER_VERDICT not in values:
        return None
    replica = values.get(HEADER_REPLICA)
    try:
        return Placement(
            Verdict(values[HEADER_VERDICT]),
            None if replica is None else int(replica),
            int(values[HEADER_HOPS]),
        )
    except (KeyError, ValueError) as exc:
        shown = {k: v for k, v in values.items() if k.startswith("x-slos-serve-")}
        raise ClientError(
            grpc.StatusCode.INTERNAL, f"the server's placement metadata is malformed: {shown}"
        ) from exc


def _item(
    response: pb.GenerateResponse, metadata: Iterable[tuple[str, str | bytes]] | None
) -> Chunk | Result:
    """A response as SDK type; the initial `metadata` is passed with the first one only."""
    if response.HasField("final"):
        return result_from_proto(response.final)
    chunk = response.chunk
    logprobs = tuple(
        TokenLogprob(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in chunk.logprobs
    )
    placement = placement_from_metadata(metadata)
    return Chunk(
        chunk.text, tuple(chunk.token_ids), placement, chunk.index, logprobs, chunk.reasoning
    )


def _one_choice(options: dict[str, Any]) -> None:
    if options.get("n", 1) > 1:
        raise ValueError("complete() returns one choice; read generate() for n > 1")


@dataclass
class _Collected:
    """A one-choice stream gathered into its `Completion`."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    result: Result | None = None

    def add(self, item: Chunk | Result) -> None:
        if isinstance(item, Result):
            self.result = item
            return
        self.parts.append(item.text)
        self.logprobs.extend(item.logprobs)
        self.thinking.append(item.reasoning)

    def completion(self) -> Completion:
        """The stream's whole output (its generator raised if no `Result` came)."""
        assert self.result is not None
        text, reasoning = "".join(self.parts), "".join(self.thinking)
        return Completion(text, self.result, tuple(self.logprobs), reasoning)


@dataclass
class _Ended:
    """Counts a stream's `Result`s: one per choice must come before the server ends it."""

    choices: int
    """The request's `n` (0, unset on the wire, is one)."""
    results: int = 0

    def seen(self, item: Chunk | Result) -> Chunk | Result:
        self.results += isinstance(item, Result)
        return item

    def check(self) -> None:
        expected = max(1, self.choices)
        if self.results < expected:
            raise ClientError(
                grpc.StatusCode.INTERNAL,
                f"the server ended the stream after {self.results} of {expected} results",
            )


def _error(exc: grpc.RpcError) -> ClientError:
    """The typed error of a failed call (grpc raises the call itself, with code and trailers)."""
    retry_after = None
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(TypeError, ValueError):  # a bad hint is no hint
                retry_after = float(value) / 1000
    return ClientError(exc.code(), exc.details() or "", retry_after)


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if root_certificates is not None and not tls:
        raise ValueError("root_certificates verify a TLS server: pass tls=True with them")
    return grpc.ssl_channel_credentials(root_certificates) if tls else None


CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
"""Reconnect at most 2 s apart while the server is down: grpc's default backoff grows to 120 s,
so a client whose server was down for a minute (a restart) would fail for up to a further
minute once it is back, and every channel of the process with it (grpc shares connections)."""


NO_DEADLINE_S = 1e9
"""Timeouts from this many seconds on (30 years; `math.inf` included) set no deadline: grpc's
clock cannot hold one that far off."""

MIN_ATTEMPT_S = 0.1
"""A retry is made only with at least this much of the deadline left to it."""


def _timeout(value: object) -> float | None:
    """A `timeout_s` checked: seconds > 0, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {value!r}")
    if not value > 0:  # NaN too
        raise ValueError(f"timeout_s must be > 0 (math.inf: no deadline), got {value!r}")
    return float(value)


class _Base:
    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout_s: float | None = 600.0,
        retry: RetryPolicy | None = None,
        wait_for_ready: bool = False,
    ) -> None:
        """`timeout_s`: each call's deadline, a stream's whole length included (None or
        math.inf: none; a call may set its own). `retry`: how UNAVAILABLE is retried before a
        stream starts. `wait_for_ready`: a call made while the server is unreachable waits
        for it, until its deadline, instead of failing at once."""
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy or None, got {retry!r}")
        self.target = target
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.credentials = _credentials(tls, root_certificates)
        self.timeout_s = _timeout(timeout_s)
        self.retry = retry or RetryPolicy()
        self.wait_for_ready = wait_for_ready
        self.closed = False

    def _channel(self, kind: Any) -> Any:
        """A channel of `kind` (grpc, or grpc.aio) to the target."""
        if self.credentials is not None:
            return kind.secure_channel(self.target, self.credentials, options=CHANNEL_OPTIONS)
        return kind.insecure_channel(self.target, options=CHANNEL_OPTIONS)

    def _deadline(self, timeout_s: float | None) -> float | None:
        """A call's deadline (None: none); refuses a closed client, before any call."""
        if self.closed:
            raise ValueError("the client is closed")
        timeout = self.timeout_s if timeout_s is None else _timeout(timeout_s)
        if timeout is None or timeout >= NO_DEADLINE_S:
            return None
        return time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _backoff(
        self,
        exc: grpc.RpcError,
        attempt: int,
        deadline: float | None,
        first: float,
        started: bool = False,
    ) -> float:
        """The wait before retrying call `attempt` (the first began at `first`), which failed
        with `exc`; raises its `ClientError` when it is not retried (not UNAVAILABLE, out of
        attempts or time, or a stream that had started). The last wait is cut to leave the
        retry its time."""
        error = _error(exc)
        wait = self.retry.backoff_s(attempt)
        left = self._remaining(deadline)
        if left is not None:
            wait = min(wait, left - MIN_ATTEMPT_S)
        if (
            started
            or error.code is not grpc.StatusCode.UNAVAILABLE
            or self.retry.gives_up(attempt, time.monotonic() + wait - first)
            or wait < 0
        ):
            raise error from None
        return wait


class Stream(Iterator[Chunk | Result]):
    """A blocking stream (`Client.generate`). To stop early, `close()` it from the thread
    reading it (or read it in a `with` block), or `cancel()` it from any thread (a UI's stop
    button): the reader then gets ClientError CANCELLED. Either ends the request on the
    server at once; a loop left with `break` keeps it running until the stream is closed or
    collected."""

    def __init__(self, client: Client, request: pb.GenerateRequest, deadline: float | None):
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self.cancelled = False
        self._items = client._stream(request, deadline, self)

    def __next__(self) -> Chunk | Result:
        return next(self._items)

    def close(self) -> None:
        self._items.close()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def _calling(self, call: grpc.Call) -> None:
        """`call` is the attempt being read (a cancel may have come before it)."""
        with self._lock:
            self._call = call
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Client(_Base):
    """Blocking client, safe to share among threads. Use as a context manager or call
    `close()` (streams open then end with ClientError CANCELLED)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self.channel = self._channel(grpc)
        self.stub = pb_grpc.ServingStub(self.channel)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Stream:
        """Stream the output: `Chunk`s, and each choice's `Result` as it ends (one choice
        unless `n` > 1). The arguments are checked here, before the stream is read."""
        request = build_request(prompt, messages, GenerateOptions(**options))
        return Stream(self, request, self._deadline(timeout_s))

    def _stream(
        self, request: pb.GenerateRequest, deadline: float | None, stream: Stream
    ) -> Generator[Chunk | Result]:
        attempt, first = 1, time.monotonic()
        while True:
            call = self.stub.Generate(
                request,
                timeout=self._remaining(deadline),
                metadata=self.metadata,
                wait_for_ready=self.wait_for_ready,
            )
            stream._calling(call)
            started = False
            ended = _Ended(request.n)
            try:
                for response in call:
                    metadata = None if started else call.initial_metadata()
                    started = True
                    yield ended.seen(_item(response, metadata))
                ended.check()
                return
            except grpc.RpcError as exc:
                if stream.cancelled:
                    raise ClientError(
                        grpc.StatusCode.CANCELLED, "the stream was cancelled"
                    ) from None
                wait = self._backoff(exc, attempt, deadline, first, started)
            finally:
                call.cancel()
            time.sleep(wait)
            attempt += 1

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """The whole output at once (one choice: `generate` streams n > 1)."""
        _one_choice(kwargs)
        collected = _Collected()
        for item in self.generate(prompt, **kwargs):
            collected.add(item)
        return collected.completion()

    def cluster_status(self, timeout_s: float | None = None) -> ClusterStatus:
        """The replicas' state and the cluster's counters, as `GET /v1/cluster/status`."""
        deadline = self._deadline(timeout_s)
        attempt, first = 1, time.monotonic()
        while True:
            try:
                reply = self.stub.GetClusterStatus(
                    pb.GetClusterStatusRequest(),
                    timeout=self._remaining(deadline),
                    metadata=self.metadata,
                    wait_for_ready=self.wait_for_ready,
                )
                return status_from_proto(reply)
            except grpc.RpcError as exc:
                wait = self._backoff(exc, attempt, deadline, first)
            time.sleep(wait)
            attempt += 1

    def close(self) -> None:
        self.closed = True
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio). Use as an async context manager or await `close()`
    (streams open then end with ClientError CANCELLED). Its channel is made on the first
    call, in that call's event loop, which every later call must share (a grpc.aio channel
    belongs to one loop); once that loop is closed (`asyncio.run` returned), the next call
    makes a channel in its own."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self.channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ServingStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def stub(self) -> pb_grpc.ServingStub:
        loop = asyncio.get_running_loop()
        if self._stub is None or self._loop is None or self._loop.is_closed():
            self.channel = self._channel(grpc.aio)
            self._stub, self._loop = pb_grpc.ServingStub(self.channel), loop
        elif self._loop is not loop:
            raise RuntimeError(
                "this AsyncClient's channel belongs to the event loop of its first call, which "
                "still runs: make an AsyncClient for each event loop"
            )
        return self._stub

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> AsyncGenerator[Chunk | Result]:
        """Stream the output: `Chunk`s, and each choice's `Result` as it ends (one choice
        unless `n` > 1). The arguments are checked here, before the stream is read. To stop
        early, close the generator (`await stream.aclose()`, or iterate inside
        `contextlib.aclosing`): a loop left with `break` keeps the request running until the
        generator is collected."""
        request = build_request(prompt, messages, GenerateOptions(**options))
        return self._stream(request, self._deadline(timeout_s))

    async def _stream(
        self, request: pb.GenerateRequest, deadline: float | None
    ) -> AsyncGenerator[Chunk | Result]:
        attempt, first = 1, time.monotonic()
        while True:
            call = self.stub.Generate(
                request,
                timeout=self._remaining(deadline),
                metadata=self.metadata,
                wait_for_ready=self.wait_for_ready,
            )
            started = False
            ended = _Ended(request.n)
            try:
                async for response in call:
                    metadata = None if started else await call.initial_metadata()
                    started = True
                    yield ended.seen(_item(response, metadata))
                ended.check()
                return
            except grpc.RpcError as exc:
                wait = self._backoff(exc, attempt, deadline, first, started)
            except asyncio.CancelledError:
                if self.closed and not _cancelling():  # grpc.aio cancels the calls it closes
                    raise ClientError(
                        grpc.StatusCode.CANCELLED, "the client was closed during the stream"
                    ) from None
                raise
            finally:
                call.cancel()
            await asyncio.sleep(wait)
            attempt += 1

    async def complete(
        self, prompt: str | Sequence[int] | None = None, **kwargs: Any
    ) -> Completion:
        _one_choice(kwargs)
        collected = _Collected()
        async for item in self.generate(prompt, **kwargs):
            collected.add(item)
        return collected.completion()

    async def cluster_status(self, timeout_s: float | None = None) -> ClusterStatus:
        """The replicas' state and the cluster's counters, as `GET /v1/cluster/status`."""
        deadline = self._deadline(timeout_s)
        attempt, first = 1, time.monotonic()
        while True:
            try:
                reply = await self.stub.GetClusterStatus(
                    pb.GetClusterStatusRequest(),
                    timeout=self._remaining(deadline),
                    metadata=self.metadata,
                    wait_for_ready=self.wait_for_ready,
                )
                return status_from_proto(reply)
            except grpc.RpcError as exc:
                wait = self._backoff(exc, attempt, deadline, first)
            await asyncio.sleep(wait)
            attempt += 1

    async def close(self) -> None:
        self.closed = True
        if self.channel is not None:
            await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _cancelling() -> bool:
    """Whether the running task is being cancelled (by its owner, not by grpc)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
