"""OpenAI request bodies -> `Request`: parsing, validation, tokenization, SLO resolution.

Pure (no I/O, no clock: the caller passes the id and arrival time) and shared by the HTTP and
gRPC doors. Every problem raises `BadRequest` naming the field at fault, or `ModelNotFound`;
nothing else escapes, whatever the body holds.

SLO sources, first match wins: the body's `slo` (an object, or the name of a configured tier),
then the headers `x-slo-ttft-ms` / `x-slo-tpot-ms` (llm-d's names), then the configured default.
Fields an object or the headers leave out come from the default SLO.

`service_tier`: "auto" and "default" ask for an SLO guarantee; "flex" is the best-effort tier
(no SLO, served from leftover capacity, preemptible).

`priority` (vLLM's convention: an integer, lower is more important) becomes the admission weight
`value = 2 ** -priority`: priority 0 is worth 1, each step down doubles the worth of admitting
the request when the DP cannot admit everyone. Allowed range: -19..19.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import partial
from typing import Any, Protocol, TypeVar

import llguidance

from replica.request import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LATENCY_MS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STAGE_END_TOKENS,
    MAX_STOP_TOKEN_IDS,
    REPETITION_PENALTY_RANGE,
    SLO,
    Request,
    SamplingParams,
    Stage,
    Tier,
)
from router import json_text
from router.errors import BadRequest, ModelNotFound
from router.reasoning import ReasoningParser
from router.structured import FIELDS as STRUCTURED_FIELDS
from router.structured import json_schema_grammar, structured_grammar
from router.tokenizer import ChatOptions
from router.tool_parsers import ToolParser
from router.tools import ToolCalling, tool_calling, tools_of
from router.wire import (
    ECHOED_MESSAGE_FIELDS,
    SENT_MESSAGE_FIELDS,
    STAGE_FIELDS,
    message_content,
    message_reasoning,
    tool_call_fields,
)

MAX_PRIORITY = 19
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CHOICES = 128
"""Choices one request may ask for (prompts x n): OpenAI's cap on `n`."""
MAX_REQUEST_MB = 16.0
"""The largest HTTP body and gRPC message the doors read by default, in MiB."""
PROMPTS_CHARS_PER_CONTEXT_TOKEN = 128
"""A request's prompts together hold at most this many characters per context token: the
door tokenizes them on its event loop, which every stream shares (262,144 characters, the
demo's 2,048-token context's worth, took 110 ms), so the bound is the door's, whatever the
vocabulary's longest token (each prompt is also held to what can fit)."""
DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
"""A plain decimal number (float() also takes "1_000", "nan" and "inf")."""
HEADER_TTFT = "x-slo-ttft-ms"
HEADER_TPOT = "x-slo-tpot-ms"
T = TypeVar("T")


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


class Codec(Protocol):
    """What parsing needs from a tokenizer."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions | None = None,
    ) -> str: ...

    @property
    def grammar_vocab(self) -> llguidance.LLTokenizer:
        """The vocabulary structured-output grammars are checked against."""
        ...


@dataclass(frozen=True)
class SchemaContext:
    """What the served model and the config say about acceptable requests."""

    model_name: str
    max_model_len: int
    vocab_size: int
    default_slo: SLO
    tiers: Mapping[str, SLO] = field(default_factory=dict)
    """Named SLO tiers a body may ask for with `"slo": "<name>"`."""
    default_chat_max_tokens: int = 256
    """Chat's `max_tokens` when absent (capped by the context left after the prompt)."""
    max_request_bytes: int = int(MAX_REQUEST_MB * 2**20)
    """The largest body (HTTP) or message (gRPC) read (`FrontDoorConfig.max_request_mb`)."""
    tool_parser: ToolParser | None = None
    """How the model writes tool calls among its text: what `tool_choice: "auto"` needs."""
    reasoning_parser: ReasoningParser | None = None
    """How the model marks its thinking: chat responses give it apart (`reasoning_content`)."""


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before a choice's output: a completion's prompt (its text, as given or
    decoded from the ids given, and its token ids), or chat's final assistant message (its
    text alone, as vLLM's chat echo)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: bool = False
    """The request asked for log-probabilities: the prompt's lead them."""
    prompt_only: bool = False
    """max_tokens 0: the prompt alone. The cluster draws one token to score the prompt (its
    prefill computes the prompt's log-probabilities); that token is not returned."""


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: Endpoint
    response_id: str
    requests: tuple[Request, ...]
    """One cluster request per choice, in choice order: prompt i's sample j is choice i * n + j
    (as vLLM numbers them), each admitted and served on its own."""
    n: int
    stream: bool
    include_usage: bool
    slo_label: str
    """Where the SLO came from, for metrics: a tier name, custom, header, default or flex."""
    echo: tuple[Echo, ...] = ()
    """Per choice, the prompt its text and log-probabilities begin with (completions'
    `echo`); empty without echo."""
    tools: ToolCalling | None = None
    """Chat's `tool_choice` when it makes (or, "auto", may make) the output tool calls."""
    prompt_logprobs: bool = False
    """vLLM's `prompt_logprobs` was asked for: the response reports the prompt's."""
    reasoning: ReasoningParser | None = None
    """Chat with a reasoning parser, whose output no grammar holds to a form from its first
    token: the response gives the thinking apart from the answer. The parser is the
    request's own: its prompt says whether the output starts inside a block, its
    `include_reasoning` whether the thinking is sent."""
    tokens_as_ids: bool = False
    """vLLM's `return_tokens_as_token_ids`: log-probabilities name tokens by id."""

    @property
    def arrival_time(self) -> float:
        return self.requests[0].arrival_time


CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""vLLM's chat fields on how the template renders the conversation."""
TEMPLATE_NAMES = {"messages", "tools", "add_generation_prompt", "eos_token"}
"""What the template gets from the server, which chat_template_kwargs may not replace."""
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "stream_options",
    "slo",
    "service_tier",
    "priority",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
    "min_p",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "echo",
    "prompt_logprobs",
    "store",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "return_tokens_as_token_ids",
    *STRUCTURED_FIELDS,
}
FIELDS = {
    Endpoint.COMPLETIONS: COMMON_FIELDS | {"prompt", "best_of", "suffix"},
    Endpoint.CHAT: COMMON_FIELDS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        *CHAT_TEMPLATE_FIELDS,
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "modalities",
        "audio",
        "include_reasoning",
        "reasoning_effort",
    },
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TAKEN_MESSAGE_FIELDS = {*SENT_MESSAGE_FIELDS, *ECHOED_MESSAGE_FIELDS}
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
"""OpenAI's `reasoning_effort` values, which the chat template gets as it is given."""


def parse_body(
    endpoint: Endpoint,
    body: object,
    headers: Mapping[str, str],
    ctx: SchemaContext,
    codec: Codec,
    *,
    request_id: str,
    arrival_time: float,
) -> ParsedRequest:
    """Validate an OpenAI body and build the cluster request (prompt tokenized)."""
    body = _known_fields(body, FIELDS[endpoint], ctx)
    model = ctx.model_name
    _check_unsupported(endpoint, body)
    rendered, prefill = "", None
    if endpoint is Endpoint.CHAT:
        calling, tools = tool_calling(body, ctx.tool_parser)
        rendered, prefill = _chat_text(body, ctx, codec, tools)
        prompts = [_encode(rendered, "prompt", ctx, codec)]
    else:
        calling, prompts = None, _completion_prompts(body, ctx, codec)
    n = _choices_per_prompt(body, len(prompts))
    echo = endpoint is Endpoint.COMPLETIONS and _bool(body, "echo", False)
    tier, slo, slo_label = _tier_and_slo(body, headers, ctx, codec)
    value = _value(body)
    sampling = _sampling(endpoint, body, ctx, codec, len(prompts[0]), echo, calling)
    requests = []
    for i, prompt in enumerate(prompts):
        where = "" if len(prompts) == 1 else f"prompt[{i}]: "
        for j in range(n):
            index = i * n + j
            request = _build(
                partial(
                    Request,
                    request_id=request_id if len(prompts) * n == 1 else f"{request_id}-{index}",
                    prompt_token_ids=prompt,
                    sampling=_sample(sampling, j),
                    slo=slo,
                    tier=tier,
                    arrival_time=arrival_time,
                    value=value,
                    model=model,
                ),
                "prompt",
                where,
            )
            check = partial(request.check_fits, ctx.max_model_len, ctx.vocab_size)
            try:
                _build(check, "max_tokens", where)
            except BadRequest as exc:  # a chat's prompt is its messages, rendered
                if endpoint is not Endpoint.CHAT or exc.param != "prompt":
                    raise
                raise BadRequest(f"the messages, rendered: {exc.message}", "messages") from exc
            requests.append(request)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options needs stream: true", "stream_options")
    include_usage = False  # as OpenAI: a stream's usage chunk (no choices) only when asked
    if options is not None:
        if not isinstance(options, dict) or set(options) - STREAM_OPTIONS:
            raise BadRequest(
                "stream_options may hold only include_usage (and continuous_usage_stats, "
                "include_obfuscation: false)",
                "stream_options",
            )
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
        for name in ("continuous_usage_stats", "include_obfuscation"):
            if _bool(options, name, False, f"stream_options.{name}"):
                raise BadRequest(
                    f"stream_options.{name}=true is not supported", f"stream_options.{name}"
                )
    prompt_logprobs = body.get("prompt_logprobs") is not None
    if prompt_logprobs and stream:
        raise BadRequest("prompt_logprobs cannot be streamed (vLLM's rule)", "prompt_logprobs")
    echoes: tuple[Echo, ...] = ()
    if endpoint is Endpoint.CHAT and _bool(body, "echo", False):
        echoes = _chat_echo(body, calling, n)
    if echo:
        texts = _prompt_texts(body.get("prompt"), prompts, codec)
        logprobs = sampling.logprobs is not None
        only = _integral(body.get("max_tokens")) == 0
        echoes = tuple(
            Echo(texts[i], tuple(prompts[i]), logprobs, only)
            for i in range(len(prompts))
            for _ in range(n)
        )
    include = _bool(body, "include_reasoning", True)
    reasoning = None
    thinks = endpoint is Endpoint.CHAT and sampling.grammar is None and not echoes
    if ctx.reasoning_parser is not None and thinks:
        reasoning = ctx.reasoning_parser.for_prompt(rendered, prefill)
        if not include:
            reasoning = replace(reasoning, include=False)
    return ParsedRequest(
        endpoint,
        request_id,
        tuple(requests),
        n,
        stream,
        include_usage,
        slo_label,
        echoes,
        calling,
        prompt_logprobs,
        reasoning,
        _bool(body, "return_tokens_as_token_ids", False),
    )


def _chat_echo(body: dict[str, Any], calling: ToolCalling | None, n: int) -> tuple[Echo, ...]:
    """vLLM's chat `echo`: a final assistant message (say one the model continues) leads each
    choice's content; any other final message, nothing."""
    if calling is not None:
        raise BadRequest("echo cannot go with a tool_choice that makes calls", "echo")
    last = body["messages"][-1]  # checked with the prompt
    if last.get("role") != "assistant" or last.get("content") is None:
        return ()
    return (Echo(message_content(last["content"], "messages"), ()),) * n


def _prompt_texts(raw: object, prompts: list[list[int]], codec: Codec) -> list[str]:
    """Each prompt's text as given, or decoded where ids were given."""
    given = [raw] if isinstance(raw, str) or _is_token_list(raw) else raw
    assert isinstance(given, list)
    return [
        p if isinstance(p, str) else codec.decode(ids, skip_special_tokens=False)
        for p, ids in zip(given, prompts, strict=True)
    ]


def parse_tokenize(body: object, ctx: SchemaContext, codec: Codec) -> list[int]:
    """vLLM's /tokenize body: a completion `prompt` (a string) or chat `messages`, to the
    token ids a completion or chat request would send the model."""
    fields = {"model", "prompt", "messages", "tools", "add_special_tokens", *CHAT_TEMPLATE_FIELDS}
    body = _known_fields(body, fields, ctx)
    if not _bool(body, "add_special_tokens", True):
        raise BadRequest("add_special_tokens=false is not supported", "add_special_tokens")
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give either prompt or messages", "prompt")
    if "messages" in body:
        return _encode(
            _chat_text(body, ctx, codec, tools_of(body.get("tools")))[0], "prompt", ctx, codec
        )
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", "prompt")
    return _encode(prompt, "prompt", ctx, codec)


def parse_detokenize(body: object, ctx: SchemaContext) -> list[int]:
    """vLLM's /detokenize body: `tokens`, at most a context's worth of the model's ids."""
    body = _known_fields(body, {"model", "tokens"}, ctx)
    if body.get("tokens") is None:
        raise BadRequest("tokens is required", "tokens")
    ids = _token_ids(body, "tokens", ctx.max_model_len)
    if any(t >= ctx.vocab_size for t in ids):
        raise BadRequest(f"tokens must be ids in [0, {ctx.vocab_size})", "tokens")
    return list(ids)


def _known_fields(body: object, fields: set[str], ctx: SchemaContext) -> dict[str, Any]:
    """A JSON object holding only `fields`, for this server's model (none named means it,
    as in vLLM)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(str(k)[:64] for k in body if k not in fields)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown[:8])}", unknown[0])
    model = body.get("model")
    if model is None or model == "":
        return body
    if not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    if model != ctx.model_name:
        raise ModelNotFound(
            f"model {_short(model)} does not exist; this server has {ctx.model_name!r}", "model"
        )
    return body


def _build(make: Callable[[], T], param: str, where: str = "") -> T:
    """Run a domain constructor, turning its ValueError into a 400 that names the field
    (`where` prefixes the message: which of several prompts)."""
    try:
        return make()
    except BadRequest:
        raise
    except ValueError as exc:
        message = str(exc)
        head = message.split(" ", 1)[0]
        named = head.replace("[]", "").replace(".", "").replace("_", "").isalnum()
        raise BadRequest(where + message, head if named else param) from exc


def _check_unsupported(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Refuse OpenAI options we would otherwise silently ignore, unless set to their no-op."""
    noop: dict[str, tuple[object, ...]] = {
        "echo": (None, False, True),
        "skip_special_tokens": (None, True),
        "spaces_between_special_tokens": (None, True),
        "suffix": (None, ""),
        "store": (None, False),
        "parallel_tool_calls": (None, True, False),
        "modalities": (None, ["text"]),
        "audio": (None,),
    }
    for name, allowed in noop.items():
        value = body.get(name)
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise BadRequest(f"{name}={value!r} is not supported", name)
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # OpenAI's, ours to ignore
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string", name)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(v, str) for v in metadata.values())  # keys are str in JSON
    ):
        raise BadRequest("metadata must be an object of strings", "metadata")


def _choices_per_prompt(body: dict[str, Any], num_prompts: int) -> int:
    n = _int(body, "n", 1, low=1, high=MAX_CHOICES)
    if _int(body, "best_of", n, low=1, high=MAX_CHOICES) != n:
        raise BadRequest(
            f"best_of={_short(body['best_of'])} is not supported: the server does not pick "
            "the best of several samples; best_of may only equal n",
            "best_of",
        )
    if num_prompts * n > MAX_CHOICES:
        raise BadRequest(
            f"{num_prompts} prompts x n={n} ask for {num_prompts * n} choices; at most "
            f"{MAX_CHOICES} fit one request",
            "n",
        )
    return n


def _sample(sampling: SamplingParams, j: int) -> SamplingParams:
    """Sample j of a prompt: a seeded request's samples get seeds seed, seed + 1, ... (wrapped
    to int64), as vLLM's, so n seeded choices differ yet each is reproducible."""
    if j == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + j + MAX_SEED + 1) % 2**64 - MAX_SEED - 1)


def _completion_prompts(body: dict[str, Any], ctx: SchemaContext, codec: Codec) -> list[list[int]]:
    """The prompts' token ids: a completion's `prompt` is a string or a list of token ids
    (one prompt), or a list of either (one choice per prompt and sample)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [_prompt_ids(prompt, "prompt", ctx, codec)]
    if isinstance(prompt, list) and any(_is_int(p) for p in prompt):
        bad = next(i for i, p in enumerate(prompt) if not _is_int(p))
        raise BadRequest(f"prompt is a list of token ids, but prompt[{bad}] is not one", "prompt")
    if isinstance(prompt, list) and len({isinstance(p, str) for p in prompt}) > 1:
        raise BadRequest("prompt mixes strings and lists of token ids; give one kind", "prompt")
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_CHOICES:
        chars = sum(len(p) for p in prompt if isinstance(p, str))
        limit = PROMPTS_CHARS_PER_CONTEXT_TOKEN * ctx.max_model_len
        if chars > limit:
            raise BadRequest(
                f"the prompts have {chars} characters; together they may have at most {limit}",
                "prompt",
            )
        return [_prompt_ids(p, f"prompt[{i}]", ctx, codec) for i, p in enumerate(prompt)]
    raise BadRequest(
        "prompt must be a non-empty string, a list of token ids, or a list of 1.."
        f"{MAX_CHOICES} of either",
        "prompt",
    )


def _prompt_ids(prompt: object, where: str, ctx: SchemaContext, codec: Codec) -> list[int]:
    if isinstance(prompt, str):
        return _encode(prompt, where, ctx, codec)
    if not _is_token_list(prompt):
        raise BadRequest(f"{where} must be a non-empty string or a list of token ids", "prompt")
    assert isinstance(prompt, list)
    if len(prompt) >= ctx.max_model_len:
        raise BadRequest(
            f"{where} has {len(prompt)} tokens; the model context is {ctx.max_model_len}",
            "prompt",
        )
    return [int(t) for t in prompt]


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _max_prompt_chars(ctx: SchemaContext, codec: Codec) -> int:
    """The most characters a text that fits the context can have: longer ones are refused
    unread, before the door's event loop spends time tokenizing them."""
    return ctx.max_model_len * codec.max_token_chars


def _encode(text: str, where: str, ctx: SchemaContext, codec: Codec) -> list[int]:
    if not text:
        raise BadRequest(f"{where} must not be empty", "prompt")
    limit = _max_prompt_chars(ctx, codec)
    if len(text) > limit:
        raise BadRequest(
            f"{where} has {len(text)} characters; at most {limit} can fit the "
            f"{ctx.max_model_len}-token context",
            "prompt",
        )
    ids = codec.encode(text)
    if not ids:
        raise BadRequest(f"{where} encodes to no tokens", "prompt")
    return ids


def _chat_text(
    body: dict[str, Any], ctx: SchemaContext, codec: Codec, tools: list[dict[str, Any]] | None
) -> tuple[str, str | None]:
    """The conversation as the chat template renders it, and the final message's text when
    the output continues it (its prefill), with vLLM's options: no generation
    prompt, the final message continued, and the template's own keyword arguments (say a
    reasoning model's enable_thinking, or OpenAI's `reasoning_effort`, which vLLM passes to
    the template too)."""
    add = _bool(body, "add_generation_prompt", True)
    continued = _bool(body, "continue_final_message", False)
    if add and continued:
        raise BadRequest(
            "continue_final_message needs add_generation_prompt: false", "continue_final_message"
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    taken = sorted(TEMPLATE_NAMES & set(kwargs or ()))
    if taken:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do",
            "chat_template_kwargs",
        )
    kwargs = dict(kwargs or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} or null, got "
                f"{_short(effort)}",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
    options = ChatOptions(add, continued, kwargs)
    messages = _messages(body.get("messages"), ctx, codec)
    prefill = str(messages[-1]["content"]) if continued else None
    return codec.render_chat(messages, tools, options), prefill


def _messages(raw: object, ctx: SchemaContext, codec: Codec) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: an assistant's tool calls with their
    arguments as objects (as HF templates read them; other text as sent) and its thinking as
    `reasoning_content` (as Qwen3's read it), a tool message with the call it answers."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    if len(raw) > ctx.max_model_len:  # each takes a token at least; the template renders all
        raise BadRequest(
            f"messages has {len(raw)} entries; at most {ctx.max_model_len} (one a token of the "
            "context) are taken",
            "messages",
        )
    messages: list[dict[str, Any]] = []
    total, limit = 0, _max_prompt_chars(ctx, codec)
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", where)
        extra = sorted(str(k)[:64] for k in m if k not in TAKEN_MESSAGE_FIELDS)
        if extra:
            raise BadRequest(f"{where} has unsupported field(s): {', '.join(extra[:8])}", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}", f"{where}.role"
            )
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise BadRequest(f"{where}: only assistant messages make tool_calls", where)
        raw_content = m.get("content")
        if calls is not None and raw_content is None:
            raw_content = ""
        message: dict[str, Any] = {
            "role": "system" if role == "developer" else str(role),
            "content": message_content(raw_content, f"{where}.content"),
        }
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        elif m.get("tool_call_id") is not None:
            raise BadRequest(f"{where}: only tool messages take a tool_call_id", where)
        thinking = message_reasoning(m, where)
        if thinking is not None:
            message["reasoning_content"] = thinking
        texts = ("content", "name", "tool_call_id", "reasoning_content")
        total += sum(len(message.get(k, "")) for k in texts)
        total += sum(len(str(c)) for c in calls or ())
        if total > limit:
            raise BadRequest(
                f"messages exceed {limit} characters; they cannot fit the "
                f"{ctx.max_model_len}-token context",
                "messages",
            )
        messages.append(message)
    return messages


def _tool_calls(raw: object, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, their arguments as the template takes them."""
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be a list", where)
    calls = []
    for j, call in enumerate(raw):
        call_id, name, text = tool_call_fields(call, f"{where}[{j}]")
        arguments = _call_arguments(text)
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return calls


def _call_arguments(text: str) -> dict[str, Any] | str:
    """A call's arguments as an object, as HF templates read them; any other text (a call
    cut by max_tokens, as this server returns it) stays as sent: OpenAI takes any string
    there, and an agent sending back what it was given must not be refused for it."""
    try:
        arguments = json_text.loads(text)
    except (ValueError, RecursionError):
        return text
    return arguments if isinstance(arguments, dict) else text


def _sampling(
    endpoint: Endpoint,
    body: dict[str, Any],
    ctx: SchemaContext,
    codec: Codec,
    prompt_len: int,
    echo: bool,
    calling: ToolCalling | None,
) -> SamplingParams:
    """The sampling every choice shares (`prompt_len`: the chat prompt's, whose default
    max_tokens fills the context). With echo, max_tokens may be 0 (the prompt alone, scored
    with one token drawn and dropped: `Echo.prompt_only`), and the prompt's
    log-probabilities come with the output's."""
    room = max(1, ctx.max_model_len - prompt_len)
    max_tokens_name = "max_tokens"
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_tokens")
        max_tokens_name = "max_completion_tokens"
    default = 16 if endpoint is Endpoint.COMPLETIONS else min(ctx.default_chat_max_tokens, room)
    max_tokens = _int(body, max_tokens_name, default, low=0 if echo else 1, high=ctx.max_model_len)
    if max_tokens == 0 and _int(body, "min_tokens", 0, low=0, high=MAX_SEED):
        raise BadRequest("min_tokens needs max_tokens > 0", "min_tokens")
    max_tokens = max(max_tokens, 1)
    seed = body.get("seed")
    if seed is not None:
        seed = _int(body, "seed", 0, low=-MAX_SEED - 1, high=MAX_SEED)
    logprobs = _logprobs(endpoint, body)
    prompt_logprobs = logprobs if echo else None
    if body.get("prompt_logprobs") is not None:
        if prompt_logprobs is not None:
            raise BadRequest(
                "prompt_logprobs and echo with logprobs both report the prompt's; use one",
                "prompt_logprobs",
            )
        prompt_logprobs = _int(body, "prompt_logprobs", 0, low=0, high=MAX_LOGPROBS)
    allowed = _token_ids(body, "allowed_token_ids", ctx.vocab_size)
    if not allowed and body.get("allowed_token_ids") is not None:  # vLLM's rule too
        raise BadRequest(
            "allowed_token_ids must name at least one token id (leave it out to allow any)",
            "allowed_token_ids",
        )

    def vocab() -> llguidance.LLTokenizer:
        return codec.grammar_vocab

    grammar = structured_grammar(body, vocab)
    if calling is not None and calling.schema is not None:
        if grammar is not None:
            raise BadRequest(
                "tool_choice makes the output tool calls; it cannot go with structured output",
                "tool_choice",
            )
        try:
            grammar = json_schema_grammar(calling.schema, calling.where, vocab)
        except BadRequest:
            for where, part in calling.parts:  # the tool whose schema fails alone, if one does
                json_schema_grammar(part, where, vocab)
            raise
    stopped = [name for name in ("stop", "stop_token_ids") if body.get(name)]
    if grammar is not None and stopped:
        raise BadRequest(
            f"{stopped[0]} cannot go with structured output or a tool_choice that forces "
            "calls: the grammar decides where the output ends, and a stop would cut it "
            "mid-value",
            stopped[0],
        )
    return _build(
        lambda: SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
            top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, above_low=True),
            top_k=max(_int(body, "top_k", 0, low=-1, high=ctx.vocab_size), 0),  # vLLM's -1: off
            min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
            seed=seed,
            stop=_stop(body.get("stop")),
            ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=_number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
            repetition_penalty=_number(
                body,
                "repetition_penalty",
                1.0,
                low=REPETITION_PENALTY_RANGE[0],
                high=REPETITION_PENALTY_RANGE[1],
            ),
            logit_bias=_logit_bias(body.get("logit_bias")),
            min_tokens=_min_tokens(body, max_tokens, max_tokens_name),
            stop_token_ids=_token_ids(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
            allowed_token_ids=allowed,
            bad_words=_bad_words(body.get("bad_words"), codec),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
            grammar=grammar,
        ),
        "sampling",
    )


def _min_tokens(body: dict[str, Any], max_tokens: int, max_tokens_name: str) -> int:
    min_tokens = _int(body, "min_tokens", 0, low=0, high=MAX_SEED)
    if min_tokens > max_tokens:
        default = "" if body.get(max_tokens_name) is not None else " (the default)"
        raise BadRequest(
            f"min_tokens={min_tokens} exceeds {max_tokens_name}={max_tokens}{default}",
            "min_tokens",
        )
    return min_tokens


def _bad_words(raw: object, codec: Codec) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words: each word's tokens as written, and with a leading space when that
    tokenizes to as many tokens, starting differently (the word inside a sentence)."""
    if raw is None:
        return ()
    most = MAX_BAD_WORDS // 2
    if (
        not isinstance(raw, list)
        or len(raw) > most
        or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in raw)
    ):
        raise BadRequest(
            f"bad_words must be a list of at most {most} words of 1..{MAX_STOP_CHARS} characters",
            "bad_words",
        )
    sequences: list[tuple[int, ...]] = []
    for word in raw:
        bare = tuple(codec.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(codec.encode(" " + word.lstrip(), add_special_tokens=False))
        if not 0 < len(bare) <= MAX_BAD_WORD_TOKENS or len(spaced) > MAX_BAD_WORD_TOKENS:
            raise BadRequest(
                f"bad_words: {_short(word)} must be 1..{MAX_BAD_WORD_TOKENS} tokens",
                "bad_words",
            )
        sequences.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return tuple(sequences)


def _logit_bias(raw: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (decimal strings, as JSON keys must be) to biases."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias"
        )
    pairs: dict[int, float] = {}
    for key in raw:
        text = str(key)
        if not text.isascii() or not text.isdigit() or len(text) > 12:
            raise BadRequest(f"logit_bias keys must be token ids, got {_short(key)}", "logit_bias")
        token = int(text)
        if token in pairs:
            raise BadRequest(f"logit_bias names token id {token} twice", "logit_bias")
        if raw[key] is None:
            raise BadRequest(f"logit_bias[{text}] must be a number, got None", "logit_bias")
        pairs[token] = _number(raw, key, 0.0, low=-100.0, high=100.0, name=f"logit_bias[{text}]")
    return tuple(pairs.items())


def _token_ids(
    body: dict[str, Any], name: str, most: int, param: str | None = None
) -> tuple[int, ...]:
    """A list of at most `most` token ids (the vocabulary is checked with the prompt's);
    `param` names the field in errors (default: `name`)."""
    param = param or name
    raw = body.get(name)
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > most:
        raise BadRequest(f"{param} must be a list of at most {most} token ids", param)
    ids = [_integral(t) for t in raw]
    valid = [t for t in ids if t is not None and t >= 0]
    if len(valid) < len(ids):
        raise BadRequest(f"{param} must hold non-negative integers", param)
    return tuple(valid)


def _logprobs(endpoint: Endpoint, body: dict[str, Any]) -> int | None:
    """How many alternatives each token's log-probability lists (0: the token's own only),
    or None: completions' `logprobs` is that number; chat asks with `logprobs: true` and
    counts with `top_logprobs`."""
    if endpoint is Endpoint.COMPLETIONS:
        if body.get("logprobs") is None or body.get("logprobs") is False:
            return None
        return _int(body, "logprobs", 0, low=0, high=MAX_LOGPROBS)
    top = _int(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top


def _stop(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS}", "stop")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise BadRequest(f"stop entries must be strings of 1..{MAX_STOP_CHARS} chars", "stop")
    return tuple(stops)


def _value(body: dict[str, Any]) -> float:
    priority = _int(body, "priority", 0, low=-MAX_PRIORITY, high=MAX_PRIORITY)
    return float(2.0**-priority)


def _tier_and_slo(
    body: dict[str, Any], headers: Mapping[str, str], ctx: SchemaContext, codec: Codec
) -> tuple[Tier, SLO | None, str]:
    service_tier = body.get("service_tier")
    if service_tier not in (None, "auto", "default", "flex"):
        raise BadRequest("service_tier must be auto, default or flex", "service_tier")
    if service_tier == "flex":
        if body.get("slo") is not None:
            raise BadRequest("slo cannot be combined with service_tier flex", "slo")
        return Tier.BEST_EFFORT, None, "flex"
    raw = body.get("slo")
    lowered = {k.lower(): v for k, v in headers.items()}
    if isinstance(raw, str):
        if raw not in ctx.tiers:
            raise BadRequest(
                f"unknown SLO tier {reprlib.repr(raw)}; known: {sorted(ctx.tiers)}", "slo"
            )
        return Tier.SLO, ctx.tiers[raw], raw
    if raw is not None:
        return Tier.SLO, _body_slo(raw, ctx.default_slo, codec), "custom"
    if HEADER_TTFT in lowered or HEADER_TPOT in lowered:
        return Tier.SLO, _header_slo(lowered, ctx.default_slo), "header"
    return Tier.SLO, ctx.default_slo, "default"


def tier_slo(ttft_ms: float, tpot_ms: float, stages: Sequence[Any], codec: Codec) -> SLO:
    """A configured tier's SLO: its stages as a request's `slo.stages` would give them."""
    raw = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "stages": list(stages) or None}
    return _body_slo(raw, SLO(ttft_ms, tpot_ms), codec)


def _body_slo(raw: object, base: SLO, codec: Codec) -> SLO:
    """`base` with what `raw` gives: a TTFT alone keeps its stages (a staged default tier's
    thinking), a TPOT or stages replace them."""
    if not isinstance(raw, dict):
        raise BadRequest("slo must be an object or the name of a tier", "slo")
    extra = sorted(str(k)[:64] for k in raw if k not in ("ttft_ms", "tpot_ms", "stages"))
    if extra:
        raise BadRequest(f"unknown slo field(s): {', '.join(extra[:8])}", f"slo.{extra[0]}")
    stages = _stages(raw.get("stages"), codec)
    if "stages" not in raw and "tpot_ms" not in raw:
        stages = base.stages
    tpot_default = stages[0].tpot_ms if stages else base.tpot_ms
    ttft = _number(
        raw,
        "ttft_ms",
        base.ttft_ms,
        low=0.0,
        high=MAX_LATENCY_MS,
        name="slo.ttft_ms",
        above_low=True,
    )
    tpot = _number(
        raw,
        "tpot_ms",
        tpot_default,
        low=0.0,
        high=MAX_LATENCY_MS,
        name="slo.tpot_ms",
        above_low=True,
    )
    return _build(partial(SLO, ttft_ms=ttft, tpot_ms=tpot, stages=stages), "slo")


def _header_slo(lowered: Mapping[str, str], base: SLO) -> SLO:
    """`base` with the headers' numbers: a TTFT alone keeps its stages, a TPOT replaces them."""
    return _build(
        lambda: SLO(
            ttft_ms=_header_ms(lowered, HEADER_TTFT, base.ttft_ms),
            tpot_ms=_header_ms(lowered, HEADER_TPOT, base.tpot_ms),
            stages=() if HEADER_TPOT in lowered else base.stages,
        ),
        "slo",
    )


def _stages(raw: object, codec: Codec) -> tuple[Stage, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > 16:
        raise BadRequest("slo.stages must be a list of 1..16 stages", "slo.stages")
    stages = []
    for i, st in enumerate(raw):
        where = f"slo.stages[{i}]"
        if not isinstance(st, dict):
            raise BadRequest(f"{where} must be an object", where)
        extra = sorted(str(k)[:64] for k in st if k not in STAGE_FIELDS)
        if extra:
            raise BadRequest(
                f"unknown {where} field(s): {', '.join(extra[:8])}", f"{where}.{extra[0]}"
            )
        if "tpot_ms" not in st:
            raise BadRequest(f"{where}.tpot_ms is required", f"{where}.tpot_ms")
        name = st.get("name", "")
        if not isinstance(name, str) or len(name) > 64:
            raise BadRequest(f"{where}.name must be a string of at most 64 chars", f"{where}.name")
        num_tokens = None
        if st.get("num_tokens") is not None:
            num_tokens = _int(st, "num_tokens", 1, low=1, high=2**31, name=f"{where}.num_tokens")
        ttft = None
        if st.get("ttft_ms") is not None:
            ttft = _number(st, "ttft_ms", 0.0, low=0.0, name=f"{where}.ttft_ms")
        tpot = _number(st, "tpot_ms", 0.0, low=0.0, name=f"{where}.tpot_ms")
        ends = _stage_ends(st, where, codec)
        make = partial(
            Stage, tpot_ms=tpot, num_tokens=num_tokens, ttft_ms=ttft, name=name, end_token_ids=ends
        )
        stages.append(_build(make, where))
    return tuple(stages)


def _stage_ends(stage: dict[str, Any], where: str, codec: Codec) -> tuple[int, ...]:
    """The tokens that end a stage: `end_token_ids`, and `until`'s text (a string or a list),
    each of which must be one token of the model's vocabulary, as a reasoning model's
    end-of-thinking marker is."""
    ids = _token_ids(stage, "end_token_ids", MAX_STAGE_END_TOKENS, f"{where}.end_token_ids")
    raw = stage.get("until")
    if raw is None:
        return ids
    texts = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(texts, list)
        or not 0 < len(texts) <= MAX_STAGE_END_TOKENS
        or not all(isinstance(t, str) and t for t in texts)
    ):
        raise BadRequest(
            f"{where}.until must be a string or a list of 1..{MAX_STAGE_END_TOKENS} strings",
            f"{where}.until",
        )
    for text in texts:
        if len(text) > codec.max_token_chars:  # refused before the door's loop tokenizes it
            raise BadRequest(
                f"{where}.until: {_short(text)} has {len(text)} characters, more than any "
                f"token of the model's vocabulary ({codec.max_token_chars}); a stage ends on "
                "one token",
                f"{where}.until",
            )
        tokens = codec.encode(text, add_special_tokens=False)
        if len(tokens) != 1:
            raise BadRequest(
                f"{where}.until: {_short(text)} is {len(tokens)} tokens of the model's "
                "vocabulary; a stage ends on one token (give end_token_ids for several)",
                f"{where}.until",
            )
        ids = (*ids, tokens[0])
    ids = tuple(dict.fromkeys(ids))
    if len(ids) > MAX_STAGE_END_TOKENS:
        raise BadRequest(
            f"{where}: end_token_ids and until end it on {len(ids)} tokens, at most "
            f"{MAX_STAGE_END_TOKENS}",
            f"{where}.until",
        )
    return ids


def _header_ms(headers: Mapping[str, str], name: str, default: float) -> float:
    raw = headers.get(name)
    if raw is None:
        return default
    if not DECIMAL.fullmatch(raw.strip()):
        raise BadRequest(f"header {name} must be a number of milliseconds, got {raw!r}", name)
    value = float(raw)
    if not 0 < value <= MAX_LATENCY_MS:
        raise BadRequest(
            f"header {name} must be a number of milliseconds in (0, {MAX_LATENCY_MS:g}], "
            f"got {raw!r}",
            name,
        )
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integral(value: object) -> int | None:
    """An integer, or an integral JSON float (5.0), as an int; None for anything else."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _int(
    body: Mapping[str, Any],
    key: str,
    default: int,
    *,
    low: int,
    high: int,
    name: str | None = None,
) -> int:
    name = name or key
    value = body.get(key)
    if value is None:
        return default
    number = _integral(value)
    if number is None:
        raise BadRequest(f"{name} must be an integer, got {_short(value)}", name)
    if not low <= number <= high:
        raise BadRequest(f"{name} must be in [{low}, {high}], got {_short(value)}", name)
    return number


def _number(
    body: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float,
    high: float = float("inf"),
    name: str | None = None,
    above_low: bool = False,
) -> float:
    """`above_low`: `low` itself is out of range too."""
    name = name or key
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {_short(value)}", name)
    if isinstance(value, int) and abs(value) > 2**53:
        raise BadRequest(f"{name} is out of range, got {_short(value)}", name)
    number = float(value)
    too_low = number <= low if above_low else number < low
    if not math.isfinite(number) or too_low or number > high:
        bracket = "(" if above_low else "["
        raise BadRequest(
            f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {_short(value)}",
            name,
        )
    return number


def _bool(body: Mapping[str, Any], key: str, default: bool, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name or key} must be true or false, got {_short(value)}", name or key)
    return value


def _short(value: object) -> str:
    """A bounded repr, so an enormous field never makes an enormous error message."""
    return reprlib.repr(value)
