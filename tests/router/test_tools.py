"""Tool calls at the door: tool_choice becomes the grammar of the calls, the tools and the
conversation's earlier calls reach the chat template, and the output text becomes calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replica.request import SLO
from router.errors import BadRequest
from router.openai_schema import Endpoint, ParsedRequest, SchemaContext, parse_body
from router.structured import json_schema_grammar
from router.tokenizer import TextCodec
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
def codec(target_dir: Path) -> TextCodec:
    demo = TextCodec.from_dir(target_dir)
    return TextCodec(demo.tokenizer, TEMPLATE, demo.eos_token)


CTX = SchemaContext("demo", 2048, 4096, SLO(ttft_ms=2000, tpot_ms=200))


def parse(codec: TextCodec, **fields: Any) -> ParsedRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_body(Endpoint.CHAT, body, {}, CTX, codec, request_id="r", arrival_time=0.0)


def test_a_named_function_constrains_the_output_to_its_arguments(codec: TextCodec) -> None:
    parsed = parse(codec, tools=TOOLS, tool_choice=NAMED)
    assert parsed.tools == ToolCalling(LOOKUP, "lookup")
    vocab = lambda: codec.grammar_vocab  # noqa: E731
    assert parsed.requests[0].sampling.grammar == json_schema_grammar(LOOKUP, "tools", vocab)
    prompt = codec.decode(parsed.requests[0].prompt_token_ids)
    assert prompt.startswith("[lookup][now]<user>hi")
    no_arguments = parse(
        codec, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}
    )
    assert no_arguments.tools == ToolCalling({"type": "object", "properties": {}}, "now")


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
            "tools[0].function",
            "letters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "x": 1}}]},
            "tools[0]",
            "x is not",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]", "two tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]},
            "tools[0]",
            "schema",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "a", "parameters": {"type": "bad"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "Invalid type",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot go",
        ),
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
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "a", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
            "not JSON",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a"}}]}]},
            "messages[0].tool_calls",
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
