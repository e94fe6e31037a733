"""Tool calls at the door: tool_choice becomes the grammar of the calls, the tools and the
conversation's earlier calls reach the chat template, and the output text becomes calls."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import llguidance
import pytest

from replica.request import SLO
from router.errors import BadRequest
from router.openai_schema import Endpoint, ParsedRequest, SchemaContext, parse_body, parse_tokenize
from router.structured import json_schema_grammar
from router.tokenizer import TextCodec
from router.tool_parsers import PARSERS
from router.tools import ToolCalling

LOOKUP = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]
NAMED = {"type": "function", "function": {"name": "lookup"}}
TEMPLATE = (
    "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}={{ c.function.arguments.name }}"
    "{% endfor %}{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %}{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def codec(codec: TextCodec) -> TextCodec:
    """The demo codec with a chat template that renders tools."""
    return replace(codec, chat_template=TEMPLATE)


CTX = SchemaContext("demo", 2048, 4096, SLO(ttft_ms=2000, tpot_ms=200))


def parse(codec: TextCodec, **fields: Any) -> ParsedRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_body(Endpoint.CHAT, body, {}, CTX, codec, request_id="r", arrival_time=0.0)


def test_a_named_function_constrains_the_output_to_its_arguments(codec: TextCodec) -> None:
    parsed = parse(codec, tools=TOOLS, tool_choice=NAMED)
    assert parsed.tools == ToolCalling(LOOKUP, "lookup", "tools[0].function.parameters")
    vocab = lambda: codec.grammar_vocab  # noqa: E731
    assert parsed.requests[0].sampling.grammar == json_schema_grammar(LOOKUP, "tools", vocab)
    prompt = codec.decode(parsed.requests[0].prompt_token_ids)
    assert prompt.startswith("[lookup][now]<user>hi")
    no_arguments = parse(
        codec, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}
    )
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    assert no_arguments.tools == ToolCalling(closed, "now", "tools[1].function.parameters")


def test_required_makes_an_array_of_calls_of_the_tools(codec: TextCodec) -> None:
    calling = parse(codec, tools=TOOLS, tool_choice="required").tools
    assert calling is not None and calling.named is None
    assert calling.schema["type"] == "array" and calling.schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in calling.schema["items"]["anyOf"]]
    assert names == ["lookup", "now"] and "maxItems" not in calling.schema
    one = parse(codec, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tools
    assert one is not None and one.schema["maxItems"] == 1
    made = calling.calls(
        '[{"name": "lookup", "parameters": {"name": "é"}}, {"name": "now", "parameters": {}}]'
    )
    assert made is not None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in made] == [
        ("lookup", '{"name": "é"}'),
        ("now", "{}"),
    ]
    assert len({c["id"] for c in made}) == 2 and all(c["type"] == "function" for c in made)
    assert calling.calls('[{"name": "lookup", "param') is None
    assert calling.calls('[{"name": "lookup", "parameters": {"x": 1e999}}]') is None
    assert calling.calls('{"name": "lookup"}') is None


def test_required_takes_the_tools_defs_to_the_root(codec: TextCodec) -> None:
    """Pydantic's nested models come as $defs referenced from the parameters: inside the
    array of calls they must sit at the root for the references to resolve."""
    nested = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/Point"}},
        "required": ["p"],
        "$defs": {
            "Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        },
    }
    tools = [{"type": "function", "function": {"name": "move", "parameters": nested}}, *TOOLS]
    parsed = parse(codec, tools=tools, tool_choice="required")
    grammar = parsed.requests[0].sampling.grammar
    assert grammar is not None
    matcher = llguidance.LLMatcher(codec.grammar_vocab, grammar, log_level=0)
    text = '[{"name": "move", "parameters": {"p": {"x": 3}}}, {"name": "now", "parameters": {}}]'
    assert matcher.consume_tokens(codec.encode(text)) and matcher.is_accepting()
    for wrong in (
        '[{"name": "move", "parameters": {"p": {"x": "3"}}}]',
        '[{"name": "now", "parameters": {"a": 1}}]',
        "[]",
    ):
        matcher = llguidance.LLMatcher(codec.grammar_vocab, grammar, log_level=0)
        assert not (matcher.consume_tokens(codec.encode(wrong)) and matcher.is_accepting()), wrong
    other = {**nested, "$defs": {"Point": {"type": "string"}}}
    clash = [*tools, {"type": "function", "function": {"name": "jump", "parameters": other}}]
    with pytest.raises(BadRequest, match="Point") as info:
        parse(codec, tools=clash, tool_choice="required")
    assert info.value.param == "tools[3].function.parameters"


def test_none_shows_the_tools_and_asks_for_text(codec: TextCodec) -> None:
    parsed = parse(codec, tools=TOOLS, tool_choice="none")
    assert parsed.tools is None and parsed.requests[0].sampling.grammar is None
    assert codec.decode(parsed.requests[0].prompt_token_ids).startswith("[lookup][now]")


def test_a_conversation_carries_calls_and_their_results(codec: TextCodec) -> None:
    messages = [
        {"role": "user", "content": "who?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"name": "ann"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
    ]
    parsed = parse(codec, messages=messages)
    text = codec.decode(parsed.requests[0].prompt_token_ids)
    assert text == "<user>who?<assistant>lookup=ann<tool>found@c1<assistant>"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "auto"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "auto"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": "lookup"}, "tools", "list"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "letters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "x": 1}}]},
            "tools[0].function.x",
            "x is not",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "description": 1}}]},
            "tools[0].function.description",
            "description must be a string",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
            "tools[0].function.strict",
            "strict must be a boolean",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]},
            "tools[0].function.parameters",
            "object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "a", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
            "object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {"properties": {"x": {"type": "bad"}}},
                        },
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "a"}},
            },
            "tools[0].function.parameters",
            "Invalid type",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {"properties": {"x": {"type": "bad"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "Invalid type",
        ),
        (
            {
                "tools": [
                    TOOLS[0],
                    {
                        "type": "function",
                        "function": {
                            "name": "b",
                            "parameters": {
                                "properties": {"tz": {"type": "string", "pattern": "(["}}
                            },
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "regex",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "stop": ["unit"]}, "stop", "cut it"),
        ({"tools": TOOLS, "tool_choice": NAMED, "stop_token_ids": [5]}, "stop_token_ids", "cut it"),
        (
            {"response_format": {"type": "json_object"}, "stop": "}"},
            "stop",
            "cannot go with structured output",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot go",
        ),
        ({"tools": TOOLS, "tool_choice": NAMED, "echo": True}, "echo", "cannot go"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "string"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]},
            "messages[0]",
            "only tool",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0]",
            "only assistant",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a"}}]}]},
            "messages[0].tool_calls[0]",
            "must be",
        ),
    ],
)
def test_bad_tools_are_named(
    codec: TextCodec, fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        parse(codec, **fields)
    assert info.value.param == param


def test_a_returned_message_goes_back_as_the_client_dumps_it(codec: TextCodec) -> None:
    """The openai package's dump of a message holds null fields of its own; /tokenize counts
    the tools the template shows."""
    dumped = {
        "role": "assistant",
        "content": "ok",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    parsed = parse(codec, messages=[{"role": "user", "content": "hi"}, dumped])
    assert codec.decode(parsed.requests[0].prompt_token_ids) == "<user>hi<assistant>ok<assistant>"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert codec.decode(parse_tokenize(body, CTX, codec)).startswith("[lookup][now]<user>hi")


def test_the_sdk_s_own_message_objects_go_back_as_they_are(codec: TextCodec) -> None:
    """`parsed`, a call's `index` (the stream helper) and `parsed_arguments` (`.parse()`) are
    the openai package's additions: ignored, as vLLM ignores them."""
    call = {
        "id": "c1",
        "index": 0,
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"name": "ann"}', "parsed_arguments": {}},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None}
    parsed = parse(codec, messages=[{"role": "user", "content": "who?"}, message])
    assert codec.decode(parsed.requests[0].prompt_token_ids).endswith("lookup=ann<assistant>")


def test_parameters_without_a_type_describe_an_object(codec: TextCodec) -> None:
    untyped = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "g", "parameters": untyped}}]
    named = {"type": "function", "function": {"name": "g"}}
    calling = parse(codec, tools=tools, tool_choice=named).tools
    assert calling is not None and calling.schema == {**untyped, "type": "object"}


def test_required_keeps_definitions_and_refuses_references_it_would_break(
    codec: TextCodec,
) -> None:
    """draft-07's `definitions` move to the root like `$defs`; a reference to the tool's own
    root or properties cannot survive inside the array of calls, so it is a 400 (a named
    function keeps it)."""
    old = {
        "type": "object",
        "properties": {"p": {"$ref": "#/definitions/P"}},
        "definitions": {"P": {"type": "integer"}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": old}}]
    calling = parse(codec, tools=tools, tool_choice="required").tools
    assert calling is not None and calling.schema["definitions"] == {"P": {"type": "integer"}}
    for ref in ("#", "#/properties/v"):
        tree = {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": ref}}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": tree}}]
        with pytest.raises(BadRequest, match="name the function instead") as info:
            parse(codec, tools=tools, tool_choice="required")
        assert info.value.param == "tools[0].function.parameters"
        named = {"type": "function", "function": {"name": "f"}}
        calling = parse(codec, tools=tools, tool_choice=named).tools
        assert calling is not None and calling.schema == tree


def test_parameters_nested_too_deeply_for_required_are_a_400(codec: TextCodec) -> None:
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(1200):
        deep = {"type": "array", "items": deep}
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"d": deep}}},
        }
    ]
    with pytest.raises(BadRequest, match="nested too deeply") as info:
        parse(codec, tools=tools, tool_choice="required")
    assert info.value.param == "tools[0].function.parameters"


def test_completions_take_no_tools(codec: TextCodec) -> None:
    with pytest.raises(BadRequest, match="unknown field") as info:
        parse_body(
            Endpoint.COMPLETIONS,
            {"prompt": "x", "tools": TOOLS},
            {},
            CTX,
            codec,
            request_id="r",
            arrival_time=0.0,
        )
    assert info.value.param == "tools"


def test_auto_with_a_parser_leaves_the_output_free_and_reads_the_calls(codec: TextCodec) -> None:
    hermes = PARSERS["hermes"]
    ctx = replace(CTX, tool_parser=hermes)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    for choice in ({}, {"tool_choice": "auto"}):
        parsed = parse_body(
            Endpoint.CHAT, body | choice, {}, ctx, codec, request_id="r", arrival_time=0.0
        )
        assert parsed.tools == ToolCalling(None, None, parser=hermes)
        assert parsed.requests[0].sampling.grammar is None
        prompt = codec.decode(parsed.requests[0].prompt_token_ids)
        assert prompt.startswith("[lookup][now]<user>hi")
    # The output may still be constrained by the request's own structured output.
    forced = {"structured_outputs": {"regex": "<tool_call>.*</tool_call>"}}
    parsed = parse_body(
        Endpoint.CHAT, body | forced, {}, ctx, codec, request_id="r", arrival_time=0.0
    )
    assert parsed.requests[0].sampling.grammar is not None
    assert parsed.tools is not None
    made = parsed.tools.message('<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert made is not None and made[0] is None
    (call,) = made[1]
    assert call["function"] == {"name": "now", "arguments": "{}"}
    assert call["id"].startswith("chatcmpl-tool-")
    two = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "lookup"}</tool_call>'
    made = parsed.tools.message(two)
    assert made is not None and [c["function"]["name"] for c in made[1]] == ["now", "lookup"]
    single = body | {"parallel_tool_calls": False}
    parsed = parse_body(Endpoint.CHAT, single, {}, ctx, codec, request_id="r", arrival_time=0.0)
    assert parsed.tools is not None
    made = parsed.tools.message(two)
    assert made is not None and [c["function"]["name"] for c in made[1]] == ["now"]
    with pytest.raises(BadRequest, match="echo cannot go with a tool_choice that makes calls"):
        parse_body(
            Endpoint.CHAT, body | {"echo": True}, {}, ctx, codec, request_id="r", arrival_time=0.0
        )
