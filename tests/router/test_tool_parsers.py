"""Reading the calls a model wrote among its text (tool_choice "auto")."""

from __future__ import annotations

import json

import pytest

from router.tool_parsers import (
    PARSERS,
    ParsedCalls,
    parse_hermes,
    parse_llama3_json,
    parse_pythonic,
)

HERMES = PARSERS["hermes"]
LLAMA = PARSERS["llama3_json"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def test_text_without_calls_is_content() -> None:
    assert parse_hermes("The weather is fine.") is None
    assert parse_hermes("") is None


def test_calls_after_content_and_between_blocks() -> None:
    now = '<tool_call>{"name": "now"}</tool_call>\n'
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n{now}"
    parsed = parse_hermes(text)
    assert parsed == ParsedCalls(
        "Let me check.\n",
        [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")],
    )
    assert json.loads(parsed.calls[0][1]) == {"city": "Paris", "days": 2}


def test_no_lead_is_no_content_and_an_unclosed_last_call_counts() -> None:
    parsed = parse_hermes(f"<tool_call>\n{WEATHER}")
    assert parsed is not None and parsed.content is None
    assert [name for name, _ in parsed.calls] == ["get_weather"]
    spaced = parse_hermes(f"  \n<tool_call>{WEATHER}</tool_call> and after")
    assert spaced is not None and spaced.content == "  \n", "as vLLM: what a stream sent"
    assert len(spaced.calls) == 1


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        '{"arguments": {}}',  # no name
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": "city=Paris"}',  # arguments not an object
        '["get_weather"]',
        '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
        '{"name": "f", "arguments": {"x": 1e999}}',  # not writable back as JSON
    ],
)
def test_an_output_whose_calls_do_not_all_parse_is_content(block: str) -> None:
    assert parse_hermes(f"<tool_call>{WEATHER}</tool_call><tool_call>{block}</tool_call>") is None


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("Hello", 5),
        ("Hello <tool", 6),
        ("Hello <", 6),
        ("Hello <tool_call>{", 6),
        ("<tool_call", 0),
        ("a < b", 5),
        ("", 0),
    ],
)
def test_a_stream_sends_as_content_only_what_cannot_start_a_call(text: str, end: int) -> None:
    assert HERMES.content_end(text, 0) == end
    # Resuming from any earlier answer gives the same one.
    assert all(HERMES.content_end(text, since) == end for since in range(end + 1))


def test_llama3_calls_are_the_whole_output() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_llama3_json(one) == ParsedCalls(None, [("get_weather", '{"city": "Paris"}')])
    tagged = f'<|python_tag|>{one}; {{"name": "now", "arguments": {{}}}}\n'
    parsed = parse_llama3_json(tagged)
    assert parsed is not None and [name for name, _ in parsed.calls] == ["get_weather", "now"]
    assert parse_llama3_json('  {"name": "now"}') == ParsedCalls(None, [("now", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        'Sure: {"name": "now", "parameters": {}}',  # text first: content
        '{"name": "now", "parameters": {}} and then some text',
        '{"name": "now", "parameters": [1]}',
        '{"parameters": {}}',
        '{"name": "now", "parameters": {"x": 1e999}}',
        '{"name": "now", "parameters": {"x": NaN}}',
        '{"name": "now", "parameters": {',
        "",
    ],
)
def test_llama3_output_that_is_not_all_calls_is_content(text: str) -> None:
    assert parse_llama3_json(text) is None


@pytest.mark.parametrize(
    ("text", "since", "end"),
    [
        ("Hello", 0, 5),
        ("  ", 0, 0),
        ('{"name"', 0, 0),
        ("<|python", 0, 0),
        ("<|python_tag|>{", 0, 0),
        ("<b>", 0, 3),
        ("Hello {", 5, 7),
    ],
)
def test_a_llama3_stream_holds_back_an_output_that_may_be_calls(
    text: str, since: int, end: int
) -> None:
    assert LLAMA.content_end(text, since) == end


def test_pythonic_calls_are_a_list_of_calls_with_literal_keywords() -> None:
    text = '[get_weather(city="Paris", days=3), now()]'
    assert parse_pythonic(text) == ParsedCalls(
        None, [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}")]
    )
    tagged = "<|python_start|>[f(x=[1, (2, 3)], y={'a': None}, z=True)]<|python_end|>\n"
    assert parse_pythonic(tagged) == ParsedCalls(
        None, [("f", '{"x": [1, [2, 3]], "y": {"a": null}, "z": true}')]
    )
    assert parse_pythonic('  [say(text="ça")]') == ParsedCalls(None, [("say", '{"text": "ça"}')])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "Sure: [now()]",  # text first: content
        "[now()] and then some text",
        "[]",
        "[now(), 3]",
        "[now(1)]",  # positional arguments: no names to give them
        "[f(x=g())]",  # not a literal
        "[f(**kw)]",
        "[tools.f(x=1)]",
        "[f(x=1e999)]",
        "[f(x={1, 2})]",  # a set: no JSON for it
        "[f(x=1j)]",
        "[f(a=1, a=2)]",  # a keyword given twice
        "[f(x=1),",
        "(f(x=1),)",
        "",
    ],
)
def test_pythonic_output_that_is_not_all_calls_is_content(text: str) -> None:
    assert parse_pythonic(text) is None


@pytest.mark.parametrize(
    ("text", "since", "end"),
    [
        ("Hello", 0, 5),
        ("  ", 0, 0),
        ("[get_", 0, 0),
        ("<|python", 0, 0),
        ("<|python_start|>[", 0, 0),
        ("<b>", 0, 3),
        ("Hello [", 5, 7),
    ],
)
def test_a_pythonic_stream_holds_back_an_output_that_may_be_calls(
    text: str, since: int, end: int
) -> None:
    assert PARSERS["pythonic"].content_end(text, since) == end


def test_arguments_no_response_could_carry_stay_escaped() -> None:
    """A lone surrogate (the model wrote it as an escape) cannot be encoded as UTF-8: such
    arguments keep their escapes; everything else is written as is."""
    for parsed in (
        parse_hermes('<tool_call>{"name": "f", "arguments": {"x": "\\ud800", "y": "ça"}}'),
        parse_pythonic("[f(x='\\ud800', y='ça')]"),
    ):
        assert parsed is not None
        ((_, arguments),) = parsed.calls
        assert arguments == '{"x": "\\ud800", "y": "\\u00e7a"}'
        arguments.encode()
    parsed = parse_hermes('<tool_call>{"name": "f", "arguments": {"y": "ça"}}')
    assert parsed is not None and parsed.calls == [("f", '{"y": "ça"}')]
    assert parse_hermes('<tool_call>{"name": "f\\ud800", "arguments": {}}') is None
