"""A reasoning model's thinking apart from its answer: vLLM's `reasoning_content`.

DeepSeek-R1, Qwen3 and their kin write their thinking first, between `<think>` and
`</think>`, then the answer. Clients of vLLM's `--reasoning-parser` get the two apart: chat's
`message.reasoning_content` (streamed as `delta.reasoning_content`) and `content`. The split is
made on the text, as it streams: a marker split over two deltas is held until it is whole, so
a client never sees part of one. The same code splits a whole output (`split`), so streamed and
non-streamed responses agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ReasoningParser:
    """How the served model marks its thinking."""

    start: str
    end: str
    starts_open: bool
    """The output is thinking from its first token even without `start` (DeepSeek-R1's
    template opens it in the prompt); False: only an output that begins with `start` thinks
    (Qwen3's, whose thinking can be switched off). A request's prompt may say otherwise
    (`for_prompt`)."""
    include: bool = True
    """The thinking is reported; False (a request's `include_reasoning: false`): it is
    dropped, and only the answer goes out."""

    def __post_init__(self) -> None:
        if not isinstance(self.end, str) or not self.end:
            raise ValueError(f"reasoning_parser.end must be non-empty text, got {self.end!r}")
        if not isinstance(self.start, str):
            raise ValueError(f"reasoning_parser.start must be text, got {self.start!r}")
        if not isinstance(self.starts_open, bool):
            raise ValueError(
                f"reasoning_parser.starts_open must be true or false, got {self.starts_open!r}"
            )

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's (reasoning, content): reasoning None when it did not think."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more, rest = stream.finish()
        return (reasoning + more if stream.thought and self.include else None), content + rest

    def for_prompt(self, prompt: str, prefill: str | None = None) -> ReasoningParser:
        """This parser for the output that continues `prompt` (the rendered chat; `prefill`:
        the assistant message it continues, if any): the model's template, not its family,
        says where the output starts. Thinking from its first token when the prompt ends on
        `start` (a Qwen3-Thinking template's generation prompt) or the prefill leaves a block
        open (`<think>` continued); none when the prompt ends on `end` (an empty block that
        switches thinking off); otherwise as `starts_open` says. Only the prompt's end and
        the prefill count: a user's message that quotes a marker opens nothing."""
        tail = prompt.rstrip()
        opened = prefill is not None and prefill.rfind(self.start) > prefill.rfind(self.end)
        if self.start and (tail.endswith(self.start) or opened):
            return replace(self, starts_open=True)
        if tail.endswith(self.end):
            return replace(self, starts_open=False)
        return self

    def thinking_tokens(self, pieces: Sequence[bytes]) -> int:
        """OpenAI's `reasoning_tokens` of an output given as its tokens' bytes: those between
        the markers, which stay out of the count, as vLLM counts them. Bytes, not token ids,
        find the markers, as a marker may be several tokens or share one with text; a token
        holding any of the thinking counts."""
        output = b"".join(pieces)
        start = self.start.encode()
        if start and output.startswith(start):
            begin = len(start)
        elif self.starts_open:
            begin = 0
        else:
            return 0
        end = output.find(self.end.encode(), begin)
        if end < 0:
            end = len(output)
        count = 0
        at = 0
        for piece in pieces:
            after = at + len(piece)
            count += at < end and after > begin
            at = after
        return count


PARSERS = {
    "deepseek_r1": ReasoningParser("<think>", "</think>", starts_open=True),
    "qwen3": ReasoningParser("<think>", "</think>", starts_open=False),
}
"""vLLM's names for the parsers of the two families most reasoning models follow."""


def reasoning_parser(raw: object) -> ReasoningParser | None:
    """The `reasoning_parser` front door arg: a name of PARSERS, {start, end, starts_open} for
    another model's markers, or null."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(PARSERS)}, a mapping of start, end "
                f"and starts_open, or null; got {raw!r}"
            )
        return PARSERS[raw]
    if not isinstance(raw, Mapping) or set(raw) - {"start", "end", "starts_open"}:
        raise ValueError(
            f"reasoning_parser as a mapping takes start, end and starts_open, got {raw!r}"
        )
    fields: dict[str, Any] = dict(raw)
    return ReasoningParser(
        fields.get("start", ""), fields.get("end", ""), fields.get("starts_open", True)
    )


class ReasoningStream:
    """One choice's output as it streams: each delta's (reasoning, content), the reasoning
    empty when the parser does not `include` it."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.thinking: bool | None = None
        """None until the output's start says whether it thinks; then True until `end`."""
        self.thought = False
        """The output thought (some of it was reasoning, or `start` opened it)."""
        self.held = ""
        """Text that may be the start of a marker, not sent yet."""

    def feed(self, text: str) -> tuple[str, str]:
        return self._shown(*self._split(text))

    def _shown(self, reasoning: str, content: str) -> tuple[str, str]:
        """The thinking goes out only when the parser includes it."""
        return (reasoning if self.parser.include else ""), content

    def _split(self, text: str) -> tuple[str, str]:
        held = self.held + text
        self.held = ""
        if self.thinking is None:
            start = self.parser.start
            if start and len(held) < len(start) and start.startswith(held):
                self.held = held
                return "", ""
            opened = bool(start) and held.startswith(start)
            if opened:
                held = held[len(start) :]
            self.thinking = opened or self.parser.starts_open
            self.thought = self.thinking
        if not self.thinking:
            return "", held
        end = self.parser.end
        at = held.find(end)
        if at >= 0:
            self.thinking = False
            return held[:at], held[at + len(end) :]
        keep = _marker_prefix(held, end)
        self.held = held[len(held) - keep :]
        return held[: len(held) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: a marker it never completed is text."""
        if self.thinking is None:
            self.thinking = self.thought = self.parser.starts_open
        held, self.held = self.held, ""
        return self._shown(held, "") if self.thinking else ("", held)


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
