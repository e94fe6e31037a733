"""gRPC messages map onto the same validation as HTTP bodies, and records map back."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.api import (
    ClusterStatus,
    FinalRecord,
    Placement,
    ReplicaStatus,
    StageVerdict,
    Verdict,
)
from replica.batch import TokenLogprob
from replica.request import SLO, Stage, Tier
from router.client import (
    OPTIONAL_SCALARS,
    CallTool,
    ChatMessage,
    Chunk,
    Client,
    GenerateOptions,
    StructuredOutputs,
    Tool,
    ToolCall,
    _item,
    build_request,
    placement_from_metadata,
    result_from_proto,
    status_from_proto,
)
from router.errors import BadRequest
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.grpc_server import final_to_proto, request_to_body, status_to_proto
from router.openai_format import ChoiceText, cluster_info
from router.openai_schema import Endpoint, SchemaContext, parse_body
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tokenizer import TextCodec
from router.tool_parsers import PARSERS as TOOL_PARSERS
from router.tools import ToolCalling
from tests.router.test_tools import LOOKUP, TEMPLATE

CTX = SchemaContext("demo", 2048, 4096, SLO(2000, 200), {"chat": SLO(1000, 100)})


def test_sdk_request_parses_like_the_http_body(codec: TextCodec) -> None:
    slo = SLO(300, 40, (Stage(20, 8, name="think"), Stage(60)))
    options = GenerateOptions(max_tokens=4, slo=slo, priority=1, temperature=0.0, stop=["\n"])
    endpoint, body = request_to_body(build_request("Hello", None, options), "demo")
    assert endpoint is Endpoint.COMPLETIONS
    req = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0).requests[0]
    assert req.slo == slo and req.value == 0.5 and req.sampling.temperature == 0.0
    assert req.sampling.max_tokens == 4 and req.sampling.stop == ("\n",)
    assert req.prompt_token_ids == codec.encode("Hello")


def test_a_stage_that_ends_on_a_token_crosses_grpc(codec: TextCodec) -> None:
    slo = SLO(300, 40, (Stage(20, name="think", end_token_ids=(5, 9)), Stage(60)))
    endpoint, body = request_to_body(build_request("Hi", None, GenerateOptions(slo=slo)), "demo")
    req = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0).requests[0]
    assert req.slo == slo
    # `until` gives the end tokens as text, as over HTTP.
    stage = pb.Stage(tpot_ms=20, name="think", until=["return"])
    request = pb.GenerateRequest(prompt="Hi", slo=pb.SLO(stages=[stage, pb.Stage(tpot_ms=60)]))
    endpoint, body = request_to_body(request, "demo")
    req = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0).requests[0]
    assert req.slo is not None
    assert req.slo.stages[0].end_token_ids == tuple(
        codec.encode("return", add_special_tokens=False)
    )


def test_penalties_bias_and_stop_conditions_cross_grpc(codec: TextCodec) -> None:
    options = GenerateOptions(
        max_tokens=8,
        presence_penalty=-0.5,
        frequency_penalty=1.0,
        repetition_penalty=1.2,
        logit_bias={7: -100.0, 12: 2.5},
        min_tokens=3,
        stop_token_ids=[9, 4],
        include_stop_str_in_output=True,
        allowed_token_ids=[5, 6],
        bad_words=["return"],
    )
    endpoint, body = request_to_body(build_request("Hello", None, options), "demo")
    req = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0).requests[0]
    sampling = req.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-0.5, 1.0)
    assert sampling.repetition_penalty == 1.2
    assert sorted(sampling.logit_bias) == [(7, -100.0), (12, 2.5)]
    assert (sampling.min_tokens, sampling.stop_token_ids) == (3, (9, 4))
    assert sampling.include_stop_str_in_output
    assert sampling.allowed_token_ids == (5, 6)
    assert sampling.bad_words and sampling.bad_words[0] == tuple(codec.encode("return"))
    with pytest.raises(ValueError, match="bad_words must be a list"):
        build_request("x", None, GenerateOptions(bad_words="return"))
    with pytest.raises(ValueError, match="stop must be a list"):
        build_request("x", None, GenerateOptions(stop="END"))
    _, unset = request_to_body(build_request("Hello", None, GenerateOptions()), "demo")
    assert set(unset) == {"model", "prompt", "n"}
    with pytest.raises(ValueError, match="stop_token_ids"):
        build_request("x", None, GenerateOptions(stop_token_ids=[-1]))
    with pytest.raises(ValueError, match="logit_bias"):
        build_request("x", None, GenerateOptions(logit_bias={"a": 1.0}))  # type: ignore[dict-item]


def test_structured_outputs_cross_grpc(codec: TextCodec) -> None:
    """Each kind reaches the HTTP door's parsing as `structured_outputs` and makes the grammar
    HTTP's would; none or two set are the door's 400."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    kinds: list[tuple[StructuredOutputs, dict[str, object]]] = [
        (StructuredOutputs(json=schema), {"json": schema}),
        (StructuredOutputs(json='{"type": "array"}'), {"json": {"type": "array"}}),
        (StructuredOutputs(regex="[ab]+"), {"regex": "[ab]+"}),
        (StructuredOutputs(choice=["x", "y"]), {"choice": ["x", "y"]}),
        (StructuredOutputs(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
        (StructuredOutputs(json_object=True), {"json_object": True}),
    ]
    for wanted, http in kinds:
        endpoint, body = request_to_body(
            build_request("Hello", None, GenerateOptions(structured_outputs=wanted)), "demo"
        )
        grpc_grammar = (
            parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
            .requests[0]
            .sampling.grammar
        )
        http_body = {"prompt": "Hello", "structured_outputs": http}
        http_grammar = (
            parse_body(endpoint, http_body, {}, CTX, codec, request_id="h", arrival_time=1.0)
            .requests[0]
            .sampling.grammar
        )
        assert grpc_grammar == http_grammar and grpc_grammar is not None, wanted
    for wrong in (StructuredOutputs(), StructuredOutputs(regex="a", choice=["a"])):
        endpoint, body = request_to_body(
            build_request("x", None, GenerateOptions(structured_outputs=wrong)), "demo"
        )
        with pytest.raises(BadRequest, match="exactly one"):
            parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
    with pytest.raises(ValueError, match="choice must be a list"):
        build_request(
            "x", None, GenerateOptions(structured_outputs=StructuredOutputs(choice="yes"))
        )
    with pytest.raises(ValueError, match="structured_outputs="):
        build_request("x", None, GenerateOptions(structured_outputs=StructuredOutputs(choice=[3])))  # type: ignore[list-item]


def test_every_optional_proto_scalar_is_an_sdk_option() -> None:
    """The SDK and the server walk the proto's optional scalars by name."""
    assert set(OPTIONAL_SCALARS) <= {f.name for f in dataclasses.fields(GenerateOptions)}
    assert {"max_tokens", "seed", "repetition_penalty"} <= set(OPTIONAL_SCALARS)


def test_samples_and_logprobs_cross_grpc(codec: TextCodec) -> None:
    """n and logprobs reach the same parsing as HTTP's, for a prompt and for chat."""
    options = GenerateOptions(n=3, logprobs=2, seed=7, temperature=0.8)
    endpoint, body = request_to_body(build_request("Hello", None, options), "demo")
    parsed = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
    assert parsed.n == 3 and [r.sampling.seed for r in parsed.requests] == [7, 8, 9]
    assert all(r.sampling.logprobs == 2 for r in parsed.requests)
    chat, body = request_to_body(build_request(None, [("user", "hi")], options), "demo")
    assert chat is Endpoint.CHAT and (body["logprobs"], body["top_logprobs"]) == (True, 2)
    _, plain = request_to_body(build_request("Hello", None, GenerateOptions()), "demo")
    assert "logprobs" not in plain and plain["n"] == 1
    with pytest.raises(ValueError, match="n=-1: "):
        build_request("x", None, GenerateOptions(n=-1))
    with pytest.raises(ValueError, match=r"stop_token_ids=\[-1\]: "):
        build_request("x", None, GenerateOptions(stop_token_ids=[-1]))
    with pytest.raises(ValueError, match="returns one choice"):
        Client("127.0.0.1:9").complete("x", n=2)


def test_placement_of_choices_on_different_replicas_names_none() -> None:
    split = placement_from_metadata(
        (("x-slos-serve-verdict", "best_effort"), ("x-slos-serve-hops", "2"))
    )
    assert split == Placement(Verdict.BEST_EFFORT, None, 2)
    assert placement_from_metadata((("other", "x"),)) is None


def test_chunks_carry_their_choice_and_logprobs() -> None:
    logprob = pb.TokenLogprob(logprob=-0.5, top=[pb.TopLogprob(token_id=4, logprob=-0.25)])
    chunk = pb.TextChunk(text="a", token_ids=[4], index=2, logprobs=[logprob])
    item = _item(pb.GenerateResponse(chunk=chunk), None)
    assert isinstance(item, Chunk) and item.index == 2
    assert item.logprobs == (TokenLogprob(-0.5, ((4, -0.25),)),)


def test_chat_flex_and_tier_name(codec: TextCodec) -> None:
    messages = [("user", "Hi")]
    options = GenerateOptions(service_tier="flex")
    endpoint, body = request_to_body(build_request(None, messages, options), "demo")
    req = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0).requests[0]
    assert endpoint is Endpoint.CHAT and req.tier is Tier.BEST_EFFORT and req.slo is None
    _, body = request_to_body(build_request([7, 8], None, GenerateOptions(slo="chat")), "demo")
    req = parse_body(
        Endpoint.COMPLETIONS, body, {}, CTX, codec, request_id="g", arrival_time=1.0
    ).requests[0]
    assert req.slo == SLO(1000, 100) and req.prompt_token_ids == [7, 8]


def test_vllm_conventions_cross_the_unsigned_proto_fields() -> None:
    """top_k -1 is off; a negative seed travels as uint64 and arrives as the same int64."""
    request = build_request("x", None, GenerateOptions(top_k=-1, seed=-5))
    assert request.top_k == 0 and request.seed == 2**64 - 5
    _, body = request_to_body(request, "demo")
    assert (body["top_k"], body["seed"]) == (0, -5)
    _, big = request_to_body(pb.GenerateRequest(prompt="x", seed=2**63), "demo")
    assert big["seed"] == -(2**63)
    with pytest.raises(ValueError, match="top_k=-2"):
        build_request("x", None, GenerateOptions(top_k=-2))


def test_an_unknown_service_tier_is_refused() -> None:
    with pytest.raises(BadRequest, match="service_tier"):
        request_to_body(pb.GenerateRequest(prompt="x", service_tier=7), "demo")  # type: ignore[arg-type]


def test_input_must_be_exactly_one() -> None:
    """An empty prompt is no prompt in proto3: the message says they are all empty."""
    cases = [
        (pb.GenerateRequest(), "all empty"),
        (pb.GenerateRequest(prompt=""), "all empty"),
        (pb.GenerateRequest(prompt="x", prompt_token_ids=[1]), "exactly one of"),
    ]
    for request, message in cases:
        with pytest.raises(BadRequest, match=message) as info:
            request_to_body(request, "demo")
        assert info.value.param == "prompt"


def test_tier_name_excludes_numbers() -> None:
    request = pb.GenerateRequest(prompt="x", slo=pb.SLO(tier="chat", ttft_ms=5))
    with pytest.raises(BadRequest) as info:
        request_to_body(request, "demo")
    assert info.value.param == "slo.tier"


def test_final_and_status_round_trip() -> None:
    record = FinalRecord(
        "r",
        Verdict.ADMITTED,
        replica=0,
        hops=1,
        finish_reason="stop",
        arrival_time=1.0,
        first_token_time=1.25,
        finish_time=2.0,
        num_prompt_tokens=3,
        num_output_tokens=2,
        stages=(StageVerdict("default", True, 0),),
    )
    result = result_from_proto(final_to_proto(record))
    assert (result.verdict, result.replica, result.finish_reason) == ("admitted", 0, "stop")
    assert result.ttft_s == 0.25 and result.e2e_s == 1.0 and result.slo_attained is True
    assert result.stop_reason is None
    assert result_from_proto(final_to_proto(record, "\n")).stop_reason == "\n"
    assert result_from_proto(final_to_proto(record, 0)).stop_reason == 0
    assert result_from_proto(final_to_proto(record, None, 3)).index == 3
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = result_from_proto(final_to_proto(record, None, 0, [call], "tool_calls"))
    assert called.tool_calls == (ToolCall("c1", "f", "{}"),)
    assert called.finish_reason == "tool_calls" and result.tool_calls == ()
    aborted = dataclasses.replace(record, finish_reason="abort", reason="its grammar: x")
    assert result_from_proto(final_to_proto(aborted)).abort_reason == "its grammar: x"
    assert cluster_info(aborted)["abort_reason"] == "its grammar: x"
    reasoned = dataclasses.replace(record, reason="a reason only an abort gives")
    assert result.abort_reason == result_from_proto(final_to_proto(reasoned)).abort_reason == ""
    assert "abort_reason" not in cluster_info(reasoned)
    assert result.reasoning_tokens is None  # no reasoning parser: unset, not 0
    thought = result_from_proto(final_to_proto(record, None, 0, (), None, 0))
    assert thought.reasoning_tokens == 0
    assert result_from_proto(final_to_proto(record, None, 0, (), None, 7)).reasoning_tokens == 7
    replica = ReplicaStatus(0, True, 1, 2, 1, 0, 0.5, {"decode": 1.25})
    status = ClusterStatus("demo", (replica,), {"admitted": 4}, scheduler="sarathi")
    assert status_from_proto(status_to_proto(status)) == status  # as HTTP reports it
    draining = ReplicaStatus(1, True, 1, 0, 0, 1, 0.1, draining=True)
    scaled = ClusterStatus(
        "demo", (replica, draining), target_replicas=1, starting=2, start_error="replica 1: OSError"
    )
    assert status_from_proto(status_to_proto(scaled)) == scaled


TOOLS = (Tool("lookup", parameters=LOOKUP), Tool("now", "The time."))
HTTP_TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]


def test_tools_and_earlier_calls_cross_grpc(codec: TextCodec) -> None:
    """Tools, each tool_choice and a conversation carrying calls parse as the HTTP body that
    says the same: the same prompt (tools and calls through the chat template), grammar and
    tool calling."""
    codec = dataclasses.replace(codec, chat_template=TEMPLATE)
    messages = [
        ("user", "who?"),
        ChatMessage("assistant", tool_calls=[ToolCall("c1", "lookup", '{"name": "ann"}')]),
        ChatMessage("tool", "found", tool_call_id="c1"),
    ]
    http_messages = [
        {"role": "user", "content": "who?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"name": "ann"}'},
                }
            ],
        },
        {"role": "tool", "content": "found", "tool_call_id": "c1"},
    ]
    named = {"type": "function", "function": {"name": "now"}}
    for choice, http_choice, parallel in (
        (CallTool("now"), named, None),
        ("required", "required", False),
        ("none", "none", None),
    ):
        options = GenerateOptions(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        endpoint, body = request_to_body(build_request(None, messages, options), "demo")
        http_body = {"model": "demo", "messages": http_messages, "tools": HTTP_TOOLS, "n": 1}
        http_body["tool_choice"] = http_choice
        if parallel is not None:
            http_body["parallel_tool_calls"] = parallel
        assert endpoint is Endpoint.CHAT and body == http_body
        parsed = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
        assert parsed.tools is None if choice == "none" else parsed.tools is not None
        text = codec.decode(parsed.requests[0].prompt_token_ids)
        assert text == "[lookup][now]<user>who?<assistant>lookup=ann<tool>found@c1<assistant>"
    _, body = request_to_body(build_request(None, [("user", "hi")], GenerateOptions()), "demo")
    assert "tools" not in body and "tool_choice" not in body
    # A tool message without an id sends "" as HTTP takes it, not a missing field.
    answer = [("user", "who?"), ChatMessage("tool", "found")]
    endpoint, body = request_to_body(build_request(None, answer, GenerateOptions()), "demo")
    assert body["messages"][1] == {"role": "tool", "content": "found", "tool_call_id": ""}
    parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
    # The same conversation as OpenAI's dicts, the calls' content null as OpenAI sends it.
    as_openai = copy.deepcopy(http_messages)
    as_openai[1] |= {"content": None, "refusal": None}  # as a response's message echoes it
    call = as_openai[1]["tool_calls"][0]
    call["index"] = 0  # as the OpenAI SDK's parse() gives its calls
    call["function"]["parsed_arguments"] = {"name": "ann"}
    sent = build_request(None, as_openai, GenerateOptions())
    assert sent == build_request(None, messages, GenerateOptions())
    assert request_to_body(sent, "demo")[1]["messages"] == http_messages
    # And the tools as OpenAI's dicts.
    tools_as_dicts = build_request(None, messages, GenerateOptions(tools=HTTP_TOOLS))
    assert tools_as_dicts == build_request(None, messages, GenerateOptions(tools=TOOLS))


def test_bad_tools_are_named_at_either_end() -> None:
    bad = GenerateOptions(tools=[Tool("lookup", parameters="{not json")])
    with pytest.raises(BadRequest, match="not JSON") as info:
        request_to_body(build_request(None, [("user", "hi")], bad), "demo")
    assert info.value.param == "tools[0].parameters"
    with pytest.raises(ValueError, match="tool_choice must be"):
        build_request(None, [("user", "hi")], GenerateOptions(tool_choice="always"))
    with pytest.raises(ValueError, match=r'a tool dict is \{"type": "function"'):
        build_request(None, [("user", "hi")], GenerateOptions(tools=[{"name": "f"}]))
    nameless = {"type": "function", "function": {"description": "f"}}
    with pytest.raises(ValueError, match="a tool's function needs a name"):
        build_request(None, [("user", "hi")], GenerateOptions(tools=[nameless]))
    with pytest.raises(ValueError, match="tools must be Tool objects or OpenAI's tool dicts"):
        build_request(None, [("user", "hi")], GenerateOptions(tools=["f"]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="priority=2147483648"):
        build_request("x", None, GenerateOptions(priority=2**31))
    with pytest.raises(ValueError, match="tool 'f'"):
        build_request(None, [("user", "hi")], GenerateOptions(tools=[Tool("f", parameters={1j})]))  # type: ignore[arg-type]


THINKING_CALL = (
    '<think>Who is ann?</think>Checking.<tool_call>{"name": "lookup", "arguments": {"q": "a"}}'
    "</tool_call>"
)


@given(cuts=st.lists(st.integers(0, len(THINKING_CALL)), max_size=8))
def test_a_choice_streams_its_thinking_apart_and_its_calls_from_the_answer(
    cuts: list[int],
) -> None:
    """However the output streams, its chunks carry what the whole output splits into (as
    the non-streamed chat response splits it): the thinking, the answer's content, then the
    calls read from the answer."""
    tools = ToolCalling(None, None, parser=TOOL_PARSERS["hermes"])
    parser = REASONING_PARSERS["deepseek_r1"]
    choice = ChoiceText(tools, parser)
    points = sorted({0, len(THINKING_CALL), *cuts})
    sent = [choice.add(THINKING_CALL[a:b]) for a, b in itertools.pairwise(points)]
    thought, text, calls, reason = choice.finish("stop")
    whole_thought, answer = parser.split(THINKING_CALL)
    made = tools.message(answer)
    assert whole_thought == "Who is ann?" and made is not None
    content, whole_calls = made
    assert "".join(t for t, _ in sent) + thought == whole_thought
    assert "".join(c for _, c in sent) + text == content == "Checking."
    assert calls is not None
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert reason == tools.finish_reason("stop") == "tool_calls"
    with pytest.raises(ValueError, match="named function"):
        ChoiceText(ToolCalling({"type": "object"}, "lookup"), parser)
    plain = ChoiceText(None, REASONING_PARSERS["qwen3"])
    assert plain.add("No thinking <think>here") == ("", "No thinking <think>here")
    assert plain.finish("length") == ("", "", None, "length")


def test_a_message_may_be_a_pair_or_an_openai_dict() -> None:
    pairs = [("system", "Be brief."), ("user", "hi")]
    dicts = [{"role": role, "content": content} for role, content in pairs]
    sent = build_request(None, dicts, GenerateOptions())
    assert sent == build_request(None, pairs, GenerateOptions())
    assert request_to_body(sent, "demo")[1]["messages"] == dicts
    named = [("system", "Be brief."), {"role": "user", "content": "hi", "name": "ann"}]
    body = request_to_body(build_request(None, named, GenerateOptions()), "demo")[1]
    assert body["messages"][1] == named[1]
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    as_parts = build_request(
        None, [{"role": "system", "content": parts}, ("user", "hi")], GenerateOptions()
    )
    assert as_parts == build_request(None, pairs, GenerateOptions())
    bad: list[Any] = [
        {"role": "user"},
        {"role": "user", "content": "hi", "age": 3},
        {"role": "user", "content": "hi", "name": 3},
        {"role": "user", "content": None},
        {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {}}]},
        {"role": "assistant", "content": "", "tool_calls": "lookup"},
        ("user", 3),
        ("user", "hi", "again"),
        "hi",
    ]
    for message in bad:
        with pytest.raises(ValueError, match=r"^messages\[1\]"):
            build_request(None, [("user", "hi"), message], GenerateOptions())


def test_the_sdk_refuses_what_http_refuses_before_sending() -> None:
    """n 0 would reach the server as unset (one choice), bytes as token ids; a list of
    prompts is refused as other options are; an SLO may be HTTP's slo object, a dict the
    server checks and completes as HTTP's."""
    with pytest.raises(ValueError, match=r"^n=0: must be at least 1"):
        build_request("x", None, GenerateOptions(n=0))
    with pytest.raises(ValueError, match=r"^n=0: must be at least 1"):
        Client("127.0.0.1:9").complete("x", n=0)
    with pytest.raises(ValueError, match=r"^allowed_token_ids=\[\]: name at least one"):
        build_request("x", None, GenerateOptions(allowed_token_ids=[]))
    with pytest.raises(ValueError, match=r"^prompt must be text .* got bytes"):
        build_request(b"abc", None, GenerateOptions())
    with pytest.raises(ValueError, match=r"^prompt=\['a', 'b'\]: .* one prompt a call"):
        build_request(["a", "b"], None, GenerateOptions())  # type: ignore[list-item]
    as_dict = GenerateOptions(slo={"ttft_ms": 300, "tpot_ms": 40})
    assert build_request("x", None, as_dict) == build_request(
        "x", None, GenerateOptions(slo=SLO(300, 40))
    )
    partial = build_request("x", None, GenerateOptions(slo={"ttft_ms": 300}))
    assert request_to_body(partial, "demo")[1]["slo"] == {"ttft_ms": 300}
    staged = {"stages": [{"name": "think", "tpot_ms": 20, "until": ["</think>"]}]}
    staged_body = request_to_body(build_request("x", None, GenerateOptions(slo=staged)), "demo")
    assert staged_body[1]["slo"] == staged
    with pytest.raises(ValueError, match=r"^slo has unknown field\(s\) ttft; known: ttft_ms,"):
        build_request("x", None, GenerateOptions(slo={"ttft": 300}))
    with pytest.raises(ValueError, match=r"^slo must be an SLO"):
        build_request("x", None, GenerateOptions(slo=300))  # type: ignore[arg-type]


def test_tools_with_a_prompt_are_refused_as_chat_only() -> None:
    with_tools = GenerateOptions(tools=[Tool("lookup")], tool_choice="auto")
    for options, field in (
        (with_tools, "tools"),
        (GenerateOptions(tool_choice=CallTool("lookup")), "tool_choice"),
        (GenerateOptions(parallel_tool_calls=False), "parallel_tool_calls"),
    ):
        for prompt in ("x", [7, 8]):
            with pytest.raises(BadRequest, match=f"^{field} is chat-only: send messages") as info:
                request_to_body(build_request(prompt, None, options), "demo")
            assert info.value.param == field
    endpoint, _ = request_to_body(build_request(None, [("user", "hi")], with_tools), "demo")
    assert endpoint is Endpoint.CHAT


def test_chat_template_options_cross_grpc(codec: TextCodec) -> None:
    """vLLM's chat template options, as HTTP takes them; refused with a prompt, and template
    variables that are no JSON named."""
    codec = dataclasses.replace(
        codec,
        chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ mood }}",
    )
    messages = [("user", "hi"), ("assistant", "well")]
    options = GenerateOptions(
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"mood": "!"},
    )
    endpoint, body = request_to_body(build_request(None, messages, options), "demo")
    http_body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}],
        "n": 1,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"mood": "!"},
    }
    assert endpoint is Endpoint.CHAT and body == http_body
    parsed = parse_body(endpoint, body, {}, CTX, codec, request_id="g", arrival_time=1.0)
    assert codec.decode(parsed.requests[0].prompt_token_ids).startswith("<user>hi<assistant>well")
    as_text = GenerateOptions(chat_template_kwargs='{"mood": "!"}')
    assert build_request(None, messages, as_text).chat_template_kwargs == '{"mood": "!"}'
    for chat_only in (
        GenerateOptions(add_generation_prompt=False),
        GenerateOptions(continue_final_message=True),
        GenerateOptions(chat_template_kwargs={"mood": "!"}),
    ):
        with pytest.raises(BadRequest, match="is chat-only: send messages"):
            request_to_body(build_request("x", None, chat_only), "demo")
    broken = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    broken.chat_template_kwargs = "{mood"
    with pytest.raises(BadRequest, match=r"^chat_template_kwargs is not JSON") as info:
        request_to_body(broken, "demo")
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(ValueError, match=r"^chat_template_kwargs="):
        build_request(None, messages, GenerateOptions(chat_template_kwargs={"f": {1, 2}}))


def test_reasoning_chat_options_cross_grpc(codec: TextCodec) -> None:
    """An assistant reply sent back with its thinking (as the openai package's message dict
    holds it, `reasoning_content` or `reasoning`), include_reasoning and reasoning_effort, as
    HTTP takes them (the SDK refused the message, and the proto had no such fields)."""
    codec = dataclasses.replace(
        codec,
        chat_template="{% for m in messages %}<{{ m.role }}>{{ m.reasoning_content }}|"
        "{{ m.content }}{% endfor %}<assistant>{{ reasoning_effort }}",
    )
    reply = {"role": "assistant", "content": "4", "reasoning": "2+2", "refusal": None}
    messages = [("user", "2+2?"), reply, ("user", "and 3+3?")]
    options = GenerateOptions(include_reasoning=False, reasoning_effort="low")
    endpoint, body = request_to_body(build_request(None, messages, options), "demo")
    assert body["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    assert (body["include_reasoning"], body["reasoning_effort"]) == (False, "low")
    qwen3 = dataclasses.replace(CTX, reasoning_parser=REASONING_PARSERS["qwen3"])
    parsed = parse_body(endpoint, body, {}, qwen3, codec, request_id="g", arrival_time=1.0)
    assert codec.decode(parsed.requests[0].prompt_token_ids) == (
        "<user>|2+2?<assistant>2+2|4<user>|and 3+3?<assistant>low"
    )
    assert parsed.reasoning is not None and not parsed.reasoning.include
    for chat_only in (
        GenerateOptions(include_reasoning=True),
        GenerateOptions(reasoning_effort="low"),
    ):
        with pytest.raises(BadRequest, match="is chat-only: send messages"):
            request_to_body(build_request("x", None, chat_only), "demo")
    told = [("user", "hi"), {"role": "user", "content": "hi", "reasoning_content": "no"}]
    with pytest.raises(BadRequest, match=r"messages\[1\]: only assistant messages take"):
        parse_body(
            *request_to_body(build_request(None, told, GenerateOptions()), "demo"),
            {},
            qwen3,
            codec,
            request_id="g",
            arrival_time=1.0,
        )
