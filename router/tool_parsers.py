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

In both, an output whose calls do not all parse is content only, as in vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router import json_text

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
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
    if not isinstance(made, dict) or not isinstance(made.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in made), None)
    arguments = {} if key is None else made[key]
    if not isinstance(arguments, dict):
        return None
    return made["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False)


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


def _hermes_content_end(text: str, since: int) -> int:
    first = text.find(START, max(0, since - len(START) + 1))
    if first >= 0:
        return first
    for cut in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-cut:]):
            return len(text) - cut
    return len(text)


def _llama3_content_end(text: str, since: int) -> int:
    """Calls are the whole output: text is content only once it cannot start as one."""
    if since > 0:
        return len(text)
    head = text.lstrip()
    if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
        return 0
    return len(text)


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
    "llama3_json": ToolParser("llama3_json", parse_llama3_json, _llama3_content_end),
}
"""`tool_call_parser` names and their formats."""
