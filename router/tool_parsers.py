"""Tool calls a model writes among its text, for `tool_choice: "auto"`.

With "auto" the model decides whether to call a tool, so its output is not constrained: the
door reads the calls out of the text afterwards, in the format the model family was trained
to write. Which format is a deployment setting (`tool_call_parser`, vLLM's flag of the same
name), since nothing in a checkpoint says it reliably.

`hermes` (NousResearch's Hermes format, which Qwen2.5/Qwen3 and many fine-tunes write): each
call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before the first call
is the message's content, text between and after the calls is dropped. As in vLLM, a last
call the model ended without its closing tag counts, and an output whose calls do not all
parse is content only.
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
        made: Any = json_text.loads(block.strip())
        if not isinstance(made, dict) or not isinstance(made.get("name"), str):
            return None
        arguments = made.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return made["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:  # not JSON, or a number JSON cannot write back (1e999)
        return None


@dataclass(frozen=True)
class ToolParser:
    """One model family's call format."""

    name: str
    start: str
    """What a call starts with: a stream sends text as content only up to it."""
    parse: Callable[[str], ParsedCalls | None]

    def content_end(self, text: str, since: int = 0) -> int:
        """How much of a streamed output is surely content: up to its first call, and short
        of a tail that may be the start of one; `since`: what an earlier call returned (the
        search resumes there, so a stream is scanned once)."""
        first = text.find(self.start, max(0, since - len(self.start) + 1))
        if first >= 0:
            return first
        for cut in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-cut:]):
                return len(text) - cut
        return len(text)


PARSERS = {"hermes": ToolParser("hermes", START, parse_hermes)}
"""`tool_call_parser` names and their formats."""
