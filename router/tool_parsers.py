"""Tool calls a model writes among its text, for `tool_choice: "auto"`.

With "auto" the model decides whether to call a tool, so its output is not constrained: the
door reads the calls out of the text afterwards, in the format the model family was trained
to write. Which format is a deployment setting (`tool_call_parser`, vLLM's flag of the same
name), since nothing in a checkpoint says it reliably.

`hermes` (NousResearch's Hermes format, which Qwen2.5/Qwen3 and many fine-tunes write): each
call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before the first call
is the message's content, text between and after the calls is dropped. As in vLLM, a last
call the model ended without its closing tag counts.

`llama3_json` (Llama 3.1-3.3 with their own chat template): the whole output is the calls,
JSON objects `{"name": ..., "parameters": {...}}` (or "arguments"), separated by `;`, after an
optional `<|python_tag|>`; an output that does not start with one is content.

`pythonic` (Llama 3.2 and Llama 4 with their own templates, and models tuned to it): the whole
output is a Python list of calls with keyword arguments, `[get_weather(city="Paris"), now()]`,
optionally between `<|python_start|>` and `<|python_end|>`; the arguments must be literals
(strings, numbers, booleans, None, lists, dicts), written back as JSON. An output that does
not start with `[` is content.

In all, an output whose calls do not all parse is content only, as in vLLM.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router import json_text

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name as OpenAI allows it: every tool's, so a call naming anything else is not
one (nor, say, a name holding a lone surrogate no response could carry)."""
PYTHON_TAG = "<|python_tag|>"
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_SEPARATORS = " \t\r\n;"


@dataclass(frozen=True)
class ParsedCalls:
    """An output that made calls: its content before them (None when blank) and the calls,
    each `(name, arguments as JSON text)`."""

    content: str | None
    calls: list[tuple[str, str]]


def parse_hermes(text: str) -> ParsedCalls | None:
    """The calls in `text`, or None when it makes none (or any of them does not parse)."""
    first = text.find(START)
    if first < 0:
        return None
    calls = []
    for block in _BLOCK.findall(text, first):
        call = _parse_call(block)
        if call is None:
            return None
        calls.append(call)
    return ParsedCalls(text[:first] or None, calls)


def _parse_call(block: str) -> tuple[str, str] | None:
    try:
        return call_of(json_text.loads(block.strip()), "arguments")
    except ValueError:  # not JSON, or a number JSON cannot write back (1e999)
        return None


def call_of(made: Any, *argument_keys: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call; its arguments under the first of
    `argument_keys` it has (none: no arguments). Raises ValueError for numbers JSON cannot
    write (1e999 read as infinity)."""
    name = made.get("name") if isinstance(made, dict) else None
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return None
    key = next((k for k in argument_keys if k in made), None)
    arguments = {} if key is None else made[key]
    if not isinstance(arguments, dict):
        return None
    return name, arguments_json(arguments)


def arguments_json(arguments: dict[str, Any]) -> str:
    """A call's arguments as JSON text; escaped to ASCII only when they hold what UTF-8
    cannot carry (a lone surrogate the model wrote as "\\ud800"), which no response could
    send. Raises ValueError for numbers JSON cannot write."""
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(arguments, allow_nan=False)
    return text


def parse_llama3_json(text: str) -> ParsedCalls | None:
    """The calls `text` is made of, or None when it is not calls."""
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return None
    calls = []
    at = 0
    try:
        while at < len(body):
            made, at = json_text.DECODER.raw_decode(body, at)
            call = call_of(made, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and body[at] in _SEPARATORS:
                at += 1
    except ValueError:
        return None
    return ParsedCalls(None, calls)


def parse_pythonic(text: str) -> ParsedCalls | None:
    """The calls the list `text` is, or None when it is not a list of calls."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = [_pythonic_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    made = [c for c in calls if c is not None]
    return ParsedCalls(None, made) if made and len(made) == len(calls) else None


def _pythonic_call(node: ast.expr) -> tuple[str, str] | None:
    """A `name(keyword=literal, ...)` call; ValueError for a value that is not a literal (or
    a float JSON cannot write)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if not NAME.fullmatch(node.func.id):  # Python allows names no tool can have
        return None
    values = {k.arg: k.value for k in node.keywords if k.arg is not None}
    if len(values) < len(node.keywords):  # **kwargs, or a keyword given twice
        return None
    arguments = {name: ast.literal_eval(value) for name, value in values.items()}
    return node.func.id, arguments_json(arguments)


def _hermes_content_end(text: str, since: int) -> int:
    first = text.find(START, max(0, since - len(START) + 1))
    if first >= 0:
        return first
    for cut in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-cut:]):
            return len(text) - cut
    return len(text)


def _whole_output_end(*openers: str) -> Callable[[str, int], int]:
    """`content_end` of a format whose calls are the whole output: text is content only once
    it cannot start as calls (it starts with none of `openers`, nor with a part of one)."""

    def content_end(text: str, since: int) -> int:
        if since > 0:
            return len(text)
        head = text.lstrip()
        if not head or head.startswith(openers) or any(o.startswith(head) for o in openers):
            return 0
        return len(text)

    return content_end


@dataclass(frozen=True)
class ToolParser:
    """One model family's call format."""

    name: str
    parse: Callable[[str], ParsedCalls | None]
    """An output's calls, or None when it made none."""
    content_end: Callable[[str, int], int]
    """How much of a streamed output is surely content (text that cannot be, or start, a
    call), given what an earlier call returned (so a stream is scanned once)."""


PARSERS = {
    "hermes": ToolParser("hermes", parse_hermes, _hermes_content_end),
    "llama3_json": ToolParser("llama3_json", parse_llama3_json, _whole_output_end("{", PYTHON_TAG)),
    "pythonic": ToolParser("pythonic", parse_pythonic, _whole_output_end("[", PYTHON_START)),
}
"""`tool_call_parser` names and their formats."""
