"""Body parsing: valid bodies build the right Request; any other body is a clean 400 (or 404)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.request import SLO, Stage, Tier
from router.client import ChatMessage, GenerateOptions, ToolCall, build_request
from router.errors import ApiError, BadRequest, ModelNotFound
from router.grpc_server import request_to_body
from router.openai_schema import (
    MAX_CHOICES,
    MAX_PRIORITY,
    Echo,
    Endpoint,
    ParsedRequest,
    SchemaContext,
    parse_body,
    parse_detokenize,
    parse_tokenize,
)
from router.reasoning import PARSERS
from router.tokenizer import TextCodec
from tests.router.bodies import bodies, headers, json_values

DEFAULT = SLO(ttft_ms=2000, tpot_ms=200)
CHAT_TIER = SLO(ttft_ms=1000, tpot_ms=100)


@pytest.fixture(scope="module")
def ctx() -> SchemaContext:
    return SchemaContext(
        model_name="demo",
        max_model_len=2048,
        vocab_size=4096,
        default_slo=DEFAULT,
        tiers={"chat": CHAT_TIER},
    )


def parse(
    codec: TextCodec,
    ctx: SchemaContext,
    body: object,
    headers: dict[str, str] | None = None,
    endpoint: Endpoint = Endpoint.COMPLETIONS,
) -> ParsedRequest:
    return parse_body(
        endpoint, body, headers or {}, ctx, codec, request_id="r1", arrival_time=100.0
    )


def test_a_request_naming_no_model_is_for_the_served_one(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """As vLLM: a missing or empty model means the one model served."""
    for body in ({"prompt": "x"}, {"model": "", "prompt": "x"}):
        assert parse(codec, ctx, body).requests[0].model == "demo"


def test_vllm_options_at_their_defaults_are_taken(codec: TextCodec, ctx: SchemaContext) -> None:
    body = {
        "model": "demo",
        "prompt": "x",
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "min_p": 0.1,
    }
    assert parse(codec, ctx, body).requests[0].sampling.min_p == 0.1
    for name, value in [("skip_special_tokens", False), ("min_p", 1.5)]:
        with pytest.raises(BadRequest) as info:
            parse(codec, ctx, {**body, name: value})
        assert info.value.param == name
    options = {"continuous_usage_stats": True}
    with pytest.raises(BadRequest, match="continuous_usage_stats=true is not supported"):
        parse(codec, ctx, {**body, "stream_options": options})


def test_openai_options_with_nothing_to_do_here_are_taken(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """What the openai package sends that asks nothing of this server (identifiers for
    OpenAI's own caching and abuse checks, text output, no obfuscation padding) is taken, as
    OpenAI and vLLM take it; a value asking for more is refused by name. vLLM's
    return_tokens_as_token_ids is carried to the response."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    taken = {
        "safety_identifier": "u-1",
        "prompt_cache_key": "k",
        "modalities": ["text"],
        "audio": None,
        "stream_options": {"include_obfuscation": False},
        "return_tokens_as_token_ids": True,
    }
    parsed = parse(codec, ctx, {**chat, **taken}, endpoint=Endpoint.CHAT)
    assert parsed.tokens_as_ids and parse(codec, ctx, {"prompt": "x"}).tokens_as_ids is False
    refused = [
        ("safety_identifier", 7, "safety_identifier must be a string"),
        ("prompt_cache_key", ["k"], "prompt_cache_key must be a string"),
        ("modalities", ["text", "audio"], "modalities=.* is not supported"),
        ("audio", {"voice": "alloy"}, "audio=.* is not supported"),
        ("return_tokens_as_token_ids", "yes", "return_tokens_as_token_ids"),
    ]
    for name, value, message in refused:
        with pytest.raises(BadRequest, match=message) as info:
            parse(codec, ctx, {**chat, name: value}, endpoint=Endpoint.CHAT)
        assert info.value.param == name
    padded = {**chat, "stream_options": {"include_obfuscation": True}}
    with pytest.raises(BadRequest, match="include_obfuscation=true is not supported"):
        parse(codec, ctx, padded, endpoint=Endpoint.CHAT)
    with pytest.raises(BadRequest, match="unknown field"):
        parse(codec, ctx, {"prompt": "x", "modalities": ["text"]})


def test_completion_defaults(codec: TextCodec, ctx: SchemaContext) -> None:
    parsed = parse(codec, ctx, {"model": "demo", "prompt": "Hello world"})
    req = parsed.requests[0]
    assert req.prompt_token_ids == codec.encode("Hello world")
    assert req.sampling.max_tokens == 16
    assert req.sampling.temperature == 1.0
    assert req.slo == DEFAULT and req.tier is Tier.SLO and req.value == 1.0
    assert req.request_id == "r1" and req.arrival_time == 100.0 and req.model == "demo"
    assert not parsed.stream and not parsed.include_usage and parsed.slo_label == "default"


def test_completion_fields(codec: TextCodec, ctx: SchemaContext) -> None:
    body = {
        "model": "demo",
        "prompt": [5, 6, 7],
        "max_tokens": 8.0,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 4,
        "seed": 7,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": False},
        "priority": -2,
        "n": 1,
        "user": "alice",
    }
    parsed = parse(codec, ctx, body)
    s = parsed.requests[0].sampling
    assert parsed.requests[0].prompt_token_ids == [5, 6, 7]
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (
        8,
        0.0,
        0.5,
        4,
        7,
        ("\n",),
    )
    assert parsed.stream and not parsed.include_usage
    assert parsed.requests[0].value == 4.0
    vllm_style = parse(codec, ctx, {"model": "demo", "prompt": "x", "top_k": -1, "seed": -1})
    assert (vllm_style.requests[0].sampling.top_k, vllm_style.requests[0].sampling.seed) == (0, -1)


def test_chat_uses_template_and_remaining_context(codec: TextCodec, ctx: SchemaContext) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    parsed = parse(codec, ctx, {"model": "demo", "messages": messages}, endpoint=Endpoint.CHAT)
    text = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert parsed.requests[0].prompt_token_ids == codec.encode(text)
    assert parsed.requests[0].sampling.max_tokens == ctx.default_chat_max_tokens
    body = {"model": "demo", "messages": messages, "max_completion_tokens": 3}
    assert parse(codec, ctx, body, endpoint=Endpoint.CHAT).requests[0].sampling.max_tokens == 3
    long = [{"role": "user", "content": "a b c d " * ctx.max_model_len}]
    with pytest.raises(BadRequest, match=r"^the messages, rendered: prompt has") as info:
        parse(codec, ctx, {"model": "demo", "messages": long}, endpoint=Endpoint.CHAT)
    assert info.value.param == "messages"  # a chat body has no prompt field


def test_several_prompts_and_samples_make_one_request_per_choice(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """Choice i * n + j is prompt i's sample j; a seed makes each sample reproducible and
    different from its siblings; a lone choice keeps the response's id."""
    body = {"model": "demo", "prompt": [[4, 9], [5, 6, 7]], "n": 3, "seed": 2**63 - 2}
    parsed = parse(codec, ctx, body)
    assert parsed.n == 3 and parsed.response_id == "r1"
    assert [r.request_id for r in parsed.requests] == [f"r1-{i}" for i in range(6)]
    prompts = [r.prompt_token_ids for r in parsed.requests]
    assert prompts == [[4, 9]] * 3 + [[5, 6, 7]] * 3
    seeds = [r.sampling.seed for r in parsed.requests]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)] * 2  # wrapped to int64
    assert {r.arrival_time for r in parsed.requests} == {100.0}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    both = parse(codec, ctx, chat, endpoint=Endpoint.CHAT).requests
    assert len(both) == 2 and both[0].prompt_token_ids == both[1].prompt_token_ids
    assert [r.sampling.seed for r in both] == [None, None]
    one = parse(codec, ctx, {"model": "demo", "prompt": ["Hello"], "n": 1, "best_of": 1})
    assert [r.request_id for r in one.requests] == ["r1"]
    for whole in ({"n": 2.0, "best_of": 2}, {"n": 2, "best_of": 2.0}):
        assert parse(codec, ctx, {"model": "demo", "prompt": "x", **whole}).n == 2
    at_cap = parse(codec, ctx, {"model": "demo", "prompt": ["x", "y"], "n": MAX_CHOICES // 2})
    assert len(at_cap.requests) == MAX_CHOICES


def test_a_bad_prompt_among_several_is_named_by_index(codec: TextCodec, ctx: SchemaContext) -> None:
    with pytest.raises(BadRequest, match=r"prompt\[1\] must not be empty"):
        parse(codec, ctx, {"model": "demo", "prompt": ["a", ""]})
    with pytest.raises(BadRequest, match=r"prompt\[2\] has 2048 tokens"):
        parse(codec, ctx, {"model": "demo", "prompt": [[1], [2], [3] * 2048]})
    with pytest.raises(BadRequest, match=r"prompt is a list of token ids, but prompt\[1\] is"):
        parse(codec, ctx, {"model": "demo", "prompt": [1, "a"]})
    with pytest.raises(BadRequest, match="mixes strings and lists of token ids"):
        parse(codec, ctx, {"model": "demo", "prompt": ["a", [1]]})
    with pytest.raises(BadRequest, match=r"^prompt\[0\]: ") as fits:
        parse(codec, ctx, {"model": "demo", "prompt": [[1] * 2040, [2]], "max_tokens": 16})
    assert fits.value.param == "max_tokens"


def test_indented_code_longer_than_sixteen_characters_a_token_fits(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """The door refuses unread only a text longer than the context times the vocabulary's
    longest token: 1,600 tokens of 22.5 characters each fit (a fixed 16 a token refused them,
    saying they could not fit), by text and as chat, and the refusal names the true limit."""
    code = ("\n" + " " * 40 + "pass") * 800
    assert len(code) > 16 * ctx.max_model_len
    parsed = parse(codec, ctx, {"model": "demo", "prompt": code})
    assert len(parsed.requests[0].prompt_token_ids) < ctx.max_model_len
    chat = {"model": "demo", "messages": [{"role": "user", "content": code}], "max_tokens": 8}
    assert parse(codec, ctx, chat, endpoint=Endpoint.CHAT).requests
    limit = ctx.max_model_len * codec.max_token_chars
    with pytest.raises(BadRequest, match=f"at most {limit} can fit the 2048-token context"):
        parse(codec, ctx, {"model": "demo", "prompt": " " * (limit + 1)})
    too_long = {"role": "user", "content": " " * (limit + 1)}
    with pytest.raises(BadRequest, match=f"messages exceed {limit} characters"):
        parse(codec, ctx, {"model": "demo", "messages": [too_long]}, endpoint=Endpoint.CHAT)
    # The prompts of one request together: the door's tokenizing budget, not the vocabulary's.
    with pytest.raises(BadRequest, match="together they may have at most 262144"):
        parse(codec, ctx, {"model": "demo", "prompt": [" " * 90_000] * 3})


@dataclass
class Watched(TextCodec):
    """The demo codec, noting the longest text it tokenized and whether it rendered a chat."""

    longest: int = 0
    rendered: bool = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.longest = max(self.longest, len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, *args: Any, **kwargs: Any) -> str:
        self.rendered = True
        return super().render_chat(*args, **kwargs)


@pytest.mark.parametrize(
    ("body", "endpoint", "param", "message"),
    [
        ({"bad_words": ["x" + " " * 100_000]}, Endpoint.COMPLETIONS, "bad_words", "1..256"),
        (
            {"slo": {"stages": [{"tpot_ms": 20, "until": ":" * 100_000}, {"tpot_ms": 80}]}},
            Endpoint.COMPLETIONS,
            "slo.stages[0].until",
            "100000 characters, more than any token",
        ),
        ({"messages": [{"role": "user", "content": ""}] * 2049}, Endpoint.CHAT, "messages", "2049"),
        (
            {"messages": [{"role": "user", "content": "x", "name": "n" * 10**7}]},
            Endpoint.CHAT,
            "messages",
            "messages exceed",
        ),
    ],
)
def test_oversized_fields_are_refused_before_they_are_tokenized(
    codec: TextCodec,
    ctx: SchemaContext,
    body: dict[str, Any],
    endpoint: Endpoint,
    param: str,
    message: str,
) -> None:
    """A field the door would tokenize (or render into a chat) is bounded first: a few MB of
    it held the door's event loop for seconds to minutes, long enough for its lease on the
    cluster to lapse, which ended every client's requests."""
    watched = Watched(**{f.name: getattr(codec, f.name) for f in fields(TextCodec)})
    full = {"prompt": "x", **body} if endpoint is Endpoint.COMPLETIONS else body
    with pytest.raises(BadRequest, match=message) as info:
        parse(watched, ctx, full, endpoint=endpoint)
    assert info.value.param == param
    assert watched.longest <= 256 and not watched.rendered


def test_logprobs_as_each_endpoint_asks_for_them(codec: TextCodec, ctx: SchemaContext) -> None:
    def asked(body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> int | None:
        return (
            parse(codec, ctx, {"model": "demo", **body}, endpoint=endpoint)
            .requests[0]
            .sampling.logprobs
        )

    assert asked({"prompt": "x"}) is None and asked({"prompt": "x", "logprobs": None}) is None
    assert asked({"prompt": "x", "logprobs": 0}) == 0
    assert asked({"prompt": "x", "logprobs": 5}) == 5
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert asked(chat, Endpoint.CHAT) is None
    assert asked({**chat, "logprobs": True}, Endpoint.CHAT) == 0
    assert asked({**chat, "logprobs": True, "top_logprobs": 20}, Endpoint.CHAT) == 20
    assert asked({**chat, "logprobs": False, "top_logprobs": 0}, Endpoint.CHAT) is None
    for bad, param in [
        ({**chat, "top_logprobs": 2}, "top_logprobs"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**chat, "logprobs": 1}, "logprobs"),
    ]:
        with pytest.raises(BadRequest) as info:
            parse(codec, ctx, {"model": "demo", **bad}, endpoint=Endpoint.CHAT)
        assert info.value.param == param


def test_slo_sources_in_order(codec: TextCodec, ctx: SchemaContext) -> None:
    base = {"model": "demo", "prompt": "x"}
    headers = {"X-SLO-TTFT-MS": "500", "x-slo-tpot-ms": "50"}
    by_header = parse(codec, ctx, base, headers)
    assert by_header.requests[0].slo == SLO(500, 50) and by_header.slo_label == "header"
    only_ttft = parse(codec, ctx, base, {"x-slo-ttft-ms": "700"}).requests[0].slo
    assert only_ttft == SLO(700, DEFAULT.tpot_ms)
    body = {**base, "slo": {"ttft_ms": 300}}
    assert parse(codec, ctx, body, headers).requests[0].slo == SLO(300, DEFAULT.tpot_ms)
    named = parse(codec, ctx, {**base, "slo": "chat"}, headers)
    assert named.requests[0].slo == CHAT_TIER and named.slo_label == "chat"
    staged = {
        **base,
        "slo": {
            "ttft_ms": 100,
            "stages": [{"name": "think", "tpot_ms": 20, "num_tokens": 50}, {"tpot_ms": 80}],
        },
    }
    slo = parse(codec, ctx, staged).requests[0].slo
    assert slo == SLO(100, 20, (Stage(20, 50, None, "think"), Stage(80)))


def test_a_stage_may_end_on_tokens_given_by_id_or_as_text(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    (colon,) = codec.encode(":", add_special_tokens=False)
    thinking = {"name": "think", "tpot_ms": 20, "end_token_ids": [7], "until": ["return", ":"]}
    body = {"prompt": "x", "slo": {"stages": [thinking, {"tpot_ms": 80}]}}
    slo = parse(codec, ctx, body).requests[0].slo
    assert slo is not None
    ends = (7, codec.encode("return", add_special_tokens=False)[0], colon)
    assert slo.stages[0] == Stage(20, None, None, "think", ends)
    # A single string is one end token; the stage may be bounded too.
    one = {"tpot_ms": 20, "until": ":", "num_tokens": 64}
    body = {"prompt": "x", "slo": {"stages": [one, {"tpot_ms": 80}]}}
    slo = parse(codec, ctx, body).requests[0].slo
    assert slo is not None and slo.stages[0] == Stage(20, 64, end_token_ids=(colon,))
    # A token given twice (by id and as text) counts once.
    twice = {"tpot_ms": 20, "end_token_ids": [colon], "until": [":", ":"]}
    body = {"prompt": "x", "slo": {"stages": [twice, {"tpot_ms": 80}]}}
    slo = parse(codec, ctx, body).requests[0].slo
    assert slo is not None and slo.stages[0].end_token_ids == (colon,)


@pytest.mark.parametrize(
    ("stage", "param", "message"),
    [
        ({"until": "</think>"}, "slo.stages[0].until", "is 5 tokens of the model's vocabulary"),
        ({"until": ""}, "slo.stages[0].until", "a string or a list"),
        ({"until": [":"] * 17}, "slo.stages[0].until", "a string or a list"),
        ({"until": 3}, "slo.stages[0].until", "a string or a list"),
        ({"end_token_ids": [-1]}, "slo.stages[0].end_token_ids", "non-negative integers"),
        ({"end_token_ids": list(range(17))}, "slo.stages[0].end_token_ids", "at most 16"),
        ({"end_token_ids": [4096]}, "slo.stages[].end_token_ids", "outside the vocabulary"),
        ({}, "slo", r"slo.stages\[0\] needs num_tokens or end_token_ids"),
        (
            {
                "end_token_ids": list(range(100, 110)),
                "until": [":", "def", "return", "if", "x", "y", "z"],
            },
            "slo.stages[0].until",
            "end it on 17 tokens, at most 16",
        ),
    ],
)
def test_bad_stage_ends_are_named(
    codec: TextCodec, ctx: SchemaContext, stage: dict[str, Any], param: str, message: str
) -> None:
    body = {"prompt": "x", "slo": {"stages": [{"tpot_ms": 20, **stage}, {"tpot_ms": 80}]}}
    with pytest.raises(BadRequest, match=message) as info:
        parse(codec, ctx, body)
    assert info.value.param == param


def test_a_ttft_alone_keeps_a_staged_default_s_stages_and_a_tpot_replaces_them(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    staged = SLO(3000, 50, (Stage(50, end_token_ids=(7,)), Stage(100)))
    reasoning = replace(ctx, default_slo=staged)
    ttft = {"x-slo-ttft-ms": "900"}
    assert parse(codec, reasoning, {"prompt": "x"}, ttft).requests[0].slo == replace(
        staged, ttft_ms=900
    )
    body = {"prompt": "x", "slo": {"ttft_ms": 900}}
    assert parse(codec, reasoning, body).requests[0].slo == replace(staged, ttft_ms=900)
    tpot = {"x-slo-tpot-ms": "80"}
    assert parse(codec, reasoning, {"prompt": "x"}, tpot).requests[0].slo == SLO(3000, 80)
    body = {"prompt": "x", "slo": {"tpot_ms": 80}}
    assert parse(codec, reasoning, body).requests[0].slo == SLO(3000, 80)


def test_chat_gives_thinking_apart_unless_a_grammar_holds_the_output_to_a_form(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    thinking = replace(ctx, reasoning_parser=PARSERS["deepseek_r1"])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(codec, ctx, chat, endpoint=Endpoint.CHAT).reasoning is None
    assert parse(codec, thinking, chat, endpoint=Endpoint.CHAT).reasoning is PARSERS["deepseek_r1"]
    assert parse(codec, thinking, {"prompt": "x"}).reasoning is None  # completions: raw text
    formed = {**chat, "response_format": {"type": "json_object"}}
    assert parse(codec, thinking, formed, endpoint=Endpoint.CHAT).reasoning is None


def test_flex_is_best_effort_without_slo(codec: TextCodec, ctx: SchemaContext) -> None:
    parsed = parse(codec, ctx, {"model": "demo", "prompt": "x", "service_tier": "flex"})
    assert parsed.requests[0].tier is Tier.BEST_EFFORT and parsed.requests[0].slo is None
    assert parsed.slo_label == "flex"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "demo"}, "prompt"),
        ({"model": "demo", "prompt": ""}, "prompt"),
        ({"model": "demo", "prompt": ["a", 3]}, "prompt"),
        ({"model": "demo", "prompt": ["a", [3]]}, "prompt"),
        ({"model": "demo", "prompt": "x", "n": 2, "best_of": 2.5}, "best_of"),
        ({"model": "demo", "prompt": ["a", ""]}, "prompt"),
        ({"model": "demo", "prompt": [[1], []]}, "prompt"),
        ({"model": "demo", "prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
        ({"model": "demo", "prompt": ["x" * 2048 * 16] * 9}, "prompt"),
        ({"model": "demo", "prompt": [1, 99999]}, "prompt"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "demo", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "demo", "prompt": "x", "max_tokens": 2048}, "max_tokens"),
        ({"model": "demo", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "demo", "prompt": "x", "temperature": math.nan}, "temperature"),
        ({"model": "demo", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "demo", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "demo", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "demo", "prompt": "x", "slo": {"ttft_ms": 0}}, "slo.ttft_ms"),
        ({"model": "demo", "prompt": "x", "slo": {"tpot_ms": 1e9}}, "slo.tpot_ms"),
        ({"model": "demo", "prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ({"model": "demo", "prompt": "x", "top_k": -2}, "top_k"),
        ({"model": "demo", "prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"model": "demo", "prompt": "x", "n": 0}, "n"),
        ({"model": "demo", "prompt": "x", "n": MAX_CHOICES + 1}, "n"),
        ({"model": "demo", "prompt": ["x", "y"], "n": MAX_CHOICES // 2 + 1}, "n"),
        ({"model": "demo", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"model": "demo", "prompt": "x", "echo": 1}, "echo"),
        ({"model": "demo", "prompt": "x", "priority": MAX_PRIORITY + 1}, "priority"),
        ({"model": "demo", "prompt": "x", "service_tier": "scale"}, "service_tier"),
        ({"model": "demo", "prompt": "x", "slo": {"ttft_ms": -1}}, "slo.ttft_ms"),
        ({"model": "demo", "prompt": "x", "slo": {"ttfb_ms": 1}}, "slo.ttfb_ms"),
        ({"model": "demo", "prompt": "x", "slo": "gold"}, "slo"),
        ({"model": "demo", "prompt": "x", "slo": {"stages": [{"num_tokens": 3}]}}, None),
        ({"model": "demo", "prompt": "x", "slo": "chat", "service_tier": "flex"}, "slo"),
        ({"model": "demo", "prompt": "x", "stream_options": {}}, "stream_options"),
        ({"model": "demo", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": "demo", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "demo", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "demo", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"5": None}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"4096": 1}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5]"),
        ({"model": "demo", "prompt": "x", "logit_bias": [5, 1]}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "min_tokens": 17}, "min_tokens"),
        ({"model": "demo", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"model": "demo", "prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
        ({"model": "demo", "prompt": "x", "stop_token_ids": [5, -1]}, "stop_token_ids"),
        ({"model": "demo", "prompt": "x", "stop_token_ids": [4096]}, "stop_token_ids"),
        ({"model": "demo", "prompt": "x", "allowed_token_ids": [4096]}, "allowed_token_ids"),
        ({"model": "demo", "prompt": "x", "allowed_token_ids": ["a"]}, "allowed_token_ids"),
        ({"model": "demo", "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"model": "demo", "prompt": "x", "metadata": {"k": 1}}, "metadata"),
        ({"model": "demo", "prompt": "x", "tools": []}, "tools"),  # a chat field
        ({"model": "demo", "prompt": "x" * 2048 * 17}, "prompt"),
    ],
)
def test_bad_fields_are_named(
    codec: TextCodec, ctx: SchemaContext, body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(BadRequest) as info:
        parse(codec, ctx, body)
    if param is not None:
        assert info.value.param == param
    else:
        assert info.value.param is not None and info.value.param.startswith("slo.stages[0]")


def test_openai_and_vllm_options_at_their_no_op_are_accepted(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """What SDKs send by default; any other value is refused by name (above)."""
    common = {
        "store": False,
        "metadata": {"app": "x"},
        "repetition_penalty": 1.0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
    }
    parse(codec, ctx, {"model": "demo", "prompt": "x", "suffix": "", **common})
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        **common,
    }
    parse(codec, ctx, chat, endpoint=Endpoint.CHAT)
    with pytest.raises(BadRequest, match="needs tools") as info:
        parse(codec, ctx, {**chat, "tool_choice": "auto"}, endpoint=Endpoint.CHAT)
    assert info.value.param == "tool_choice"


def test_penalties_bias_and_stop_conditions_reach_the_sampling(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "12": 2.5},
        "max_completion_tokens": 20,
        "min_tokens": 20,
        "stop_token_ids": [3, 9],
        "include_stop_str_in_output": True,
        "allowed_token_ids": [3, 4.0],
    }
    sampling = parse(codec, ctx, body, endpoint=Endpoint.CHAT).requests[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == 1.3
    assert sampling.logit_bias == ((7, -100.0), (12, 2.5))
    assert (sampling.min_tokens, sampling.stop_token_ids) == (20, (3, 9))
    assert sampling.include_stop_str_in_output
    assert sampling.allowed_token_ids == (3, 4)
    with pytest.raises(BadRequest, match="min_tokens=21 exceeds max_completion_tokens=20"):
        parse(codec, ctx, {**body, "min_tokens": 21}, endpoint=Endpoint.CHAT)
    with pytest.raises(BadRequest, match=r"min_tokens=17 exceeds max_tokens=16 \(the default\)"):
        parse(codec, ctx, {"model": "demo", "prompt": "x", "min_tokens": 17})
    integral = {"model": "demo", "prompt": "x", "stop_token_ids": [5.0, 7]}
    assert parse(codec, ctx, integral).requests[0].sampling.stop_token_ids == (5, 7)
    for bad in ([5.5], [None], [True]):
        with pytest.raises(BadRequest, match="stop_token_ids must hold non-negative integers"):
            parse(codec, ctx, {**integral, "stop_token_ids": bad})
    with pytest.raises(BadRequest, match="allowed_token_ids must name at least one token id"):
        parse(codec, ctx, {**integral, "allowed_token_ids": []})  # none allowed: vLLM refuses it


def test_bad_header_is_named(codec: TextCodec, ctx: SchemaContext) -> None:
    for value in ("fast", "1_000", "nan", "1e308", "0"):
        with pytest.raises(BadRequest) as info:
            parse(codec, ctx, {"model": "demo", "prompt": "x"}, {"x-slo-tpot-ms": value})
        assert info.value.param == "x-slo-tpot-ms", value
    with pytest.raises(BadRequest, match=r"top_p must be a finite number in \(0, 1\]"):
        parse(codec, ctx, {"model": "demo", "prompt": "x", "top_p": 0})


def test_unknown_model_is_404(codec: TextCodec, ctx: SchemaContext) -> None:
    with pytest.raises(ModelNotFound):
        parse(codec, ctx, {"model": "gpt-4", "prompt": "x"})


def test_chat_message_errors(codec: TextCodec, ctx: SchemaContext) -> None:
    for messages, param in [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0]"),
    ]:
        with pytest.raises(BadRequest) as info:
            parse(codec, ctx, {"model": "demo", "messages": messages}, endpoint=Endpoint.CHAT)
        assert info.value.param == param


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, hdrs=headers, endpoint=st.sampled_from(list(Endpoint)))
def test_any_body_parses_or_fails_cleanly(
    codec: TextCodec,
    ctx: SchemaContext,
    body: dict[str, Any],
    hdrs: dict[str, str],
    endpoint: Endpoint,
) -> None:
    try:
        parsed = parse(codec, ctx, body, hdrs, endpoint)
    except ApiError as exc:
        assert isinstance(exc, BadRequest | ModelNotFound)
        assert exc.message and len(exc.message) < 1000
        json.dumps({"message": exc.message, "param": exc.param})
        return
    assert 1 <= len(parsed.requests) <= MAX_CHOICES
    for request in parsed.requests:
        assert request.prompt_len + request.sampling.max_tokens <= ctx.max_model_len


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.one_of(
        st.text(min_size=1, max_size=3000),
        st.lists(st.integers(min_value=-5, max_value=5000), min_size=1, max_size=3000),
    )
)
def test_any_prompt_parses_or_fails_cleanly(
    codec: TextCodec, ctx: SchemaContext, prompt: object
) -> None:
    try:
        parse(codec, ctx, {"model": "demo", "prompt": prompt, "max_tokens": 1})
    except BadRequest as exc:
        assert exc.param == "prompt"


def test_enormous_names_make_short_messages(codec: TextCodec, ctx: SchemaContext) -> None:
    long = "k" * 100_000
    bodies: list[dict[str, Any]] = [
        {"model": "demo", "prompt": "x", long: 1},
        {"model": long, "prompt": "x"},
        {"model": "demo", "prompt": "x", "slo": {long: 1}},
        {"model": "demo", "prompt": "x", "stop": [long]},
        {"model": "demo", "prompt": "x", "max_tokens": 10**100},
    ]
    for body in bodies:
        with pytest.raises(ApiError) as info:
            parse(codec, ctx, body)
        assert len(info.value.message) < 1000


def test_tokenize_gives_the_ids_a_request_would_send(codec: TextCodec, ctx: SchemaContext) -> None:
    prompt = {"model": "demo", "prompt": "def f(x):"}
    assert (
        parse_tokenize(prompt, ctx, codec) == parse(codec, ctx, prompt).requests[0].prompt_token_ids
    )
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    sent = parse(codec, ctx, chat, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids
    assert parse_tokenize(chat, ctx, codec) == sent
    defaults = {"add_special_tokens": True, "add_generation_prompt": True}
    assert parse_tokenize({"prompt": "def f(x):", **defaults}, ctx, codec) == parse_tokenize(
        prompt, ctx, codec
    )
    assert parse_detokenize({"tokens": [5]}, ctx) == [5]
    for body, param in [
        ({"model": "demo"}, "prompt"),
        ({**prompt, **chat}, "prompt"),
        ({"model": "demo", "prompt": [1, 2]}, "prompt"),
        ({**prompt, "add_special_tokens": False}, "add_special_tokens"),
        ({**chat, "continue_final_message": True}, "continue_final_message"),
        ({**prompt, "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ({"model": "demo", "messages": []}, "messages"),
    ]:
        with pytest.raises(BadRequest) as info:
            parse_tokenize(body, ctx, codec)
        assert info.value.param == param, body
    with pytest.raises(ModelNotFound):
        parse_tokenize({**prompt, "model": "other"}, ctx, codec)


def test_detokenize_takes_the_models_ids(ctx: SchemaContext) -> None:
    assert parse_detokenize({"model": "demo", "tokens": [5, 6.0, 4095]}, ctx) == [5, 6, 4095]
    for tokens in ([4096], [-1], [1.5], ["1"], None, [1] * 2049):
        with pytest.raises(BadRequest) as info:
            parse_detokenize({"model": "demo", "tokens": tokens}, ctx)
        assert info.value.param == "tokens", tokens


@settings(deadline=None)
@given(body=bodies, tokens=json_values)
def test_any_tokenize_or_detokenize_body_parses_or_fails_cleanly(
    codec: TextCodec, ctx: SchemaContext, body: dict[str, Any], tokens: object
) -> None:
    for parse_one in (
        lambda: parse_tokenize(body, ctx, codec),
        lambda: parse_detokenize({"model": "demo", "tokens": tokens}, ctx),
    ):
        try:
            parse_one()
        except ApiError as exc:
            assert isinstance(exc, BadRequest | ModelNotFound) and len(exc.message) < 1000


def test_echo_repeats_each_prompt_before_its_choices(codec: TextCodec, ctx: SchemaContext) -> None:
    body = {"model": "demo", "prompt": ["Hello", "Bye"], "n": 2, "echo": True, "logprobs": 1}
    parsed = parse(codec, ctx, body)
    assert [e.text for e in parsed.echo] == ["Hello", "Hello", "Bye", "Bye"]
    assert parsed.echo[3].token_ids == tuple(codec.encode("Bye"))
    ids = parse(codec, ctx, {**body, "prompt": [[5, 6], [7]]}).echo
    assert [(e.text, e.token_ids) for e in ids[1:3]] == [
        (codec.decode([5, 6]), (5, 6)),
        (codec.decode([7]), (7,)),
    ]
    assert all(r.sampling.prompt_logprobs == 1 for r in parsed.requests)
    special = parse(codec, ctx, {**body, "prompt": [0, 319]}).echo[0]
    assert special.text == codec.decode([0, 319], skip_special_tokens=False) != codec.decode([319])
    plain = parse(codec, ctx, {**body, "logprobs": None})
    assert all(r.sampling.prompt_logprobs is None for r in plain.requests)
    assert parse(codec, ctx, {**body, "echo": False}).echo == ()
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "echo": True}
    assert parse(codec, ctx, chat, endpoint=Endpoint.CHAT).echo == ()  # the user's turn: nothing
    assert parse(codec, ctx, {**chat, "echo": False}, endpoint=Endpoint.CHAT).echo == ()
    started = [*chat["messages"], {"role": "assistant", "content": "def f("}]  # type: ignore[misc]
    continued = {**chat, "messages": started, "n": 2}
    assert parse(codec, ctx, continued, endpoint=Endpoint.CHAT).echo == (Echo("def f(", ()),) * 2


def test_echo_may_ask_for_the_prompt_alone(codec: TextCodec, ctx: SchemaContext) -> None:
    """max_tokens 0 with echo: the cluster draws one token to score the prompt, then drops it."""
    body = {"model": "demo", "prompt": "def f(x):", "echo": True, "logprobs": 1, "max_tokens": 0}
    parsed = parse(codec, ctx, body)
    assert parsed.echo[0].prompt_only and parsed.echo[0].logprobs
    assert parsed.requests[0].sampling.max_tokens == 1
    assert not parse(codec, ctx, {**body, "max_tokens": 1}).echo[0].prompt_only
    for bad in ({**body, "echo": False}, {**body, "min_tokens": 1}):
        with pytest.raises(BadRequest):
            parse(codec, ctx, bad)


def test_bad_words_are_tokenized_as_vllm_does(codec: TextCodec, ctx: SchemaContext) -> None:
    """Each word as written, and with a leading space when that is as many tokens starting
    differently (the word inside a sentence)."""
    sampling = (
        parse(codec, ctx, {"prompt": "x", "bad_words": ["return", " def x"]}).requests[0].sampling
    )
    texts = [codec.decode(list(word)) for word in sampling.bad_words]
    assert texts == ["return", " return", "def x", " def x"]
    assert [len(word) for word in sampling.bad_words] == [1, 1, 2, 2]
    assert sampling.shapes_logits
    for bad in ("return", [""], ["  "], [3], ["x"] * 65, ["a" * 300]):
        with pytest.raises(BadRequest, match="bad_words") as info:
            parse(codec, ctx, {"prompt": "x", "bad_words": bad})
        assert info.value.param == "bad_words"


def test_the_chat_template_options_vllm_takes(codec: TextCodec, ctx: SchemaContext) -> None:
    """No generation prompt; the final message continued (the template's end of turn cut);
    the template's own keyword arguments, which may not replace what the server passes."""
    flavored = replace(codec, chat_template="{{ flavor }}" + str(codec.chat_template))
    user = {"role": "user", "content": "hi"}
    started = {"role": "assistant", "content": "def f("}

    def text(body: dict[str, Any], on: TextCodec = codec) -> str:
        ids = parse(on, ctx, {"messages": [user], **body}, endpoint=Endpoint.CHAT).requests[0]
        return on.decode(ids.prompt_token_ids, skip_special_tokens=False)

    assert text({}) == "<|user|>\nhi\n<|assistant|>\n"
    assert text({"add_generation_prompt": False}) == "<|user|>\nhi\n"
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert text({**continued, "messages": [user, started]}) == "<|user|>\nhi\n<|assistant|>\ndef f("
    assert text({"chat_template_kwargs": {"flavor": "T:"}}, flavored).startswith("T:<|user|>")
    tokenized = parse_tokenize({"messages": [user, started], **continued}, ctx, codec)
    assert codec.decode(tokenized, skip_special_tokens=False).endswith("<|assistant|>\ndef f(")
    for body, param in [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": ["flavor"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ]:
        with pytest.raises(BadRequest) as info:
            text(body)
        assert info.value.param == param, body


THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if reasoning_effort %}"
    "effort={{ reasoning_effort }}\n{% endif %}<think>{% endif %}"
)
"""A Qwen3-style template: earlier thinking rendered, the generation prompt opening a block."""


def test_an_assistant_reply_goes_back_with_its_thinking(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """A multi-turn loop sends the reply as the server gave it (`reasoning_content`, or
    newer vLLM's `reasoning`, null when it did not think): a template that reads the
    thinking renders it, and others ignore it."""
    thinker = replace(codec, chat_template=THINKING_TEMPLATE)
    for name in ("reasoning_content", "reasoning"):
        reply = {"role": "assistant", "content": "4", "refusal": None, name: "2 + 2."}
        chat = {"messages": [{"role": "user", "content": "2+2?"}, reply]}
        prompt = parse(thinker, ctx, chat, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids
        assert thinker.decode(prompt, skip_special_tokens=False).endswith(
            "<|assistant|>\n<think>2 + 2.</think>4\n<|assistant|>\n<think>"
        )
        bare = {"messages": [chat["messages"][0], {"role": "assistant", "content": "4"}]}
        assert parse(codec, ctx, chat, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids == (
            parse(codec, ctx, bare, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids
        )
        null = {"messages": [{"role": "user", "content": "hi"}, {**reply, name: None}]}
        assert parse(codec, ctx, null, endpoint=Endpoint.CHAT).requests
    for message, param in [
        ({"role": "assistant", "content": "4", "reasoning_content": 7}, "reasoning_content"),
        ({"role": "assistant", "content": "4", "reasoning": ["x"]}, "reasoning"),
        ({"role": "user", "content": "4", "reasoning": "x"}, ""),
    ]:
        chat = {"messages": [{"role": "user", "content": "hi"}, message]}
        with pytest.raises(BadRequest) as info:
            parse(codec, ctx, chat, endpoint=Endpoint.CHAT)
        assert info.value.param == f"messages[1].{param}".rstrip(".")


def test_the_prompt_decides_whether_the_output_starts_thinking(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """An assistant prefill `<think>` continued, or a template whose generation prompt opens
    the block, leaves the output inside it: qwen3's parser takes it as thinking until
    `</think>`."""
    qwen3 = replace(ctx, reasoning_parser=PARSERS["qwen3"])
    prefill = {
        "messages": [
            {"role": "user", "content": "How many bytes?"},
            {"role": "assistant", "content": "<think>"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    for thinker, chat in [
        (codec, prefill),
        (replace(codec, chat_template=THINKING_TEMPLATE), {"messages": prefill["messages"][:1]}),
    ]:
        reasoning = parse(thinker, qwen3, chat, endpoint=Endpoint.CHAT).reasoning
        assert reasoning is not None
        assert reasoning.split("Return the bytes.</think>\n4") == ("Return the bytes.", "\n4")
    plain = {"messages": prefill["messages"][:1]}
    assert parse(codec, qwen3, plain, endpoint=Endpoint.CHAT).reasoning is PARSERS["qwen3"]


def test_vllm_s_reasoning_request_fields_are_taken(codec: TextCodec, ctx: SchemaContext) -> None:
    """`include_reasoning: false` drops the thinking from the response; `reasoning_effort`
    (OpenAI's values) reaches the template, as vLLM passes it, and otherwise does nothing."""
    qwen3 = replace(ctx, reasoning_parser=PARSERS["qwen3"])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    hidden = parse(codec, qwen3, {**chat, "include_reasoning": False}, endpoint=Endpoint.CHAT)
    assert hidden.reasoning == replace(PARSERS["qwen3"], include=False)
    shown = parse(codec, qwen3, {**chat, "include_reasoning": True}, endpoint=Endpoint.CHAT)
    assert shown.reasoning is PARSERS["qwen3"]
    assert parse(codec, ctx, {**chat, "include_reasoning": False}, endpoint=Endpoint.CHAT)
    thinker = replace(codec, chat_template=THINKING_TEMPLATE)
    for effort in ("minimal", "low", "medium", "high", None):
        body = {**chat, "reasoning_effort": effort}
        prompt = parse(thinker, ctx, body, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids
        text = thinker.decode(prompt, skip_special_tokens=False)
        assert text.endswith(f"effort={effort}\n<think>" if effort else "<|assistant|>\n<think>")
        assert parse(codec, ctx, body, endpoint=Endpoint.CHAT).requests
    for name, value in [
        ("reasoning_effort", "max"),
        ("reasoning_effort", 2),
        ("include_reasoning", "no"),
    ]:
        with pytest.raises(BadRequest, match=name) as info:
            parse(codec, ctx, {**chat, name: value}, endpoint=Endpoint.CHAT)
        assert info.value.param == name
    with pytest.raises(BadRequest, match="unknown field"):
        parse(codec, ctx, {"prompt": "x", "reasoning_effort": "low"})


CUT_ARGUMENTS = '{"path": "path", "path_binary_'
"""A named call's arguments cut by max_tokens (`finish_reason: length`), as returned."""
CALLS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} ARGUMENTS</call>{% endfor %}"
    "\n{% endfor %}<|assistant|>\n"
)
"""A template showing earlier calls, ARGUMENTS written as one family's template writes them."""
ARGUMENTS = {
    "hermes, qwen3": "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}",
    "qwen2.5, llama3.1": "{{ c.function.arguments | tojson }}",
    "llama3.2 pythonic": "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}"
    "{% endfor %}",
    "qwen3-coder": "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %}",
}


def _called(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": arguments}}
    return [
        {"role": "user", "content": "Read it."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "no such file", "tool_call_id": "c1"},
    ]


def _prompt(codec: TextCodec, ctx: SchemaContext, body: dict[str, Any]) -> str:
    ids = parse(codec, ctx, body, endpoint=Endpoint.CHAT).requests[0].prompt_token_ids
    return codec.decode(ids, skip_special_tokens=False)


def test_a_call_cut_by_max_tokens_goes_back_as_its_text(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """An agent sends back the call the server returned: arguments that are no JSON object
    reach the template as sent (OpenAI takes any string there); a template printing them
    prints that text, one reading them as an object is a 400 naming the call."""
    for arguments in (CUT_ARGUMENTS, "[1]", ""):
        assert _prompt(codec, ctx, {"messages": _called(arguments)}) == (
            "<|user|>\nRead it.\n<|assistant|>\n\n<|tool|>\nno such file\n<|assistant|>\n"
        )
    shown = {
        name: replace(codec, chat_template=CALLS_TEMPLATE.replace("ARGUMENTS", arguments))
        for name, arguments in ARGUMENTS.items()
    }
    cut = {"messages": _called(CUT_ARGUMENTS)}
    assert f"<call>read {CUT_ARGUMENTS}</call>" in _prompt(shown["hermes, qwen3"], ctx, cut)
    quoted = '<call>read "{\\"path\\": \\"path\\", \\"path_binary_"</call>'
    assert quoted in _prompt(shown["qwen2.5, llama3.1"], ctx, cut)
    for name in ("llama3.2 pythonic", "qwen3-coder"):
        with pytest.raises(BadRequest, match="is not a JSON object") as info:
            parse(shown[name], ctx, cut, endpoint=Endpoint.CHAT)
        assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    whole = {"messages": _called('{"path": "a"}')}
    assert '<call>read {"path": "a"}</call>' in _prompt(shown["hermes, qwen3"], ctx, whole)
    assert "<call>read path=a</call>" in _prompt(shown["llama3.2 pythonic"], ctx, whole)


def test_grpc_sends_a_cut_call_back_as_http_does(codec: TextCodec, ctx: SchemaContext) -> None:
    messages = [
        ("user", "Read it."),
        ChatMessage("assistant", tool_calls=[ToolCall("c1", "read", CUT_ARGUMENTS)]),
        ChatMessage("tool", "no such file", tool_call_id="c1"),
    ]
    endpoint, body = request_to_body(build_request(None, messages, GenerateOptions()), "demo")
    hermes = replace(
        codec, chat_template=CALLS_TEMPLATE.replace("ARGUMENTS", ARGUMENTS["hermes, qwen3"])
    )
    http = {"messages": _called(CUT_ARGUMENTS)}
    assert endpoint is Endpoint.CHAT and _prompt(hermes, ctx, body) == _prompt(hermes, ctx, http)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=st.one_of(st.text(max_size=30), json_values.map(json.dumps)))
def test_any_call_arguments_render_or_name_the_call(
    codec: TextCodec, ctx: SchemaContext, arguments: str
) -> None:
    for template in ARGUMENTS.values():
        shown = replace(codec, chat_template=CALLS_TEMPLATE.replace("ARGUMENTS", template))
        try:
            parse(shown, ctx, {"messages": _called(arguments)}, endpoint=Endpoint.CHAT)
        except BadRequest as exc:
            assert exc.param == "messages[1].tool_calls[0].function.arguments"
