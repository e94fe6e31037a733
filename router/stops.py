"""Stop strings in the text a client sees: cut right before the first one, even inside a
token, and never sent in part while streaming.

The engine stops generating at the token that completes a stop string (and counts it, as
vLLM does); only the text can end mid-token, so the cut is made here, on the detokenized text.
With min_tokens, as in vLLM v1, no stop string may end in the first min_tokens tokens' text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from replica.model_source import REPLACEMENT_CHAR
from replica.request import SamplingParams
from router.tokenizer import IncrementalDetokenizer


@dataclass
class StopText:
    """One request's text stream with its stop strings held back until ruled out."""

    stops: tuple[str, ...]
    include: bool = False
    """Keep the stop string at the end of the text (vLLM's include_stop_str_in_output)."""
    held: str = ""
    """Text not sent yet: it may be the start of a stop string."""
    guard: int = 0
    """A match in `held` must end after this many of its characters (text of tokens that no
    stop string may end in, min_tokens)."""
    matched: str | None = None
    """The stop string that ended the text."""

    def push(self, text: str, *, checked: bool = True) -> str:
        """Add newly decoded text; return what is safe to send. Text held back is at most
        one character shorter than the longest stop string, so a stop string can never have
        begun in text already sent. `checked` False: no stop string may end in this text,
        though one may begin there."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.held += text
        if not checked:
            self.guard = len(self.held)
        hits = [(i, stop) for stop in self.stops if (i := self._find(stop)) >= 0]
        if hits:
            start, self.matched = min(hits, key=lambda hit: hit[0])
            end = start + len(self.matched) if self.include else start
            out, self.held = self.held[:end], ""
            return out
        cut = len(self.held) - (max(len(s) for s in self.stops) - 1)
        if cut <= 0:
            return ""
        out, self.held = self.held[:cut], self.held[cut:]
        self.guard = max(0, self.guard - cut)
        return out

    def _find(self, stop: str) -> int:
        """Where the first match of `stop` ending after the guard starts, or -1."""
        return self.held.find(stop, max(0, self.guard - len(stop) + 1))

    def flush(self) -> str:
        """At the end of the output: the held text, which no stop string completed."""
        out, self.held = self.held, ""
        return out


@dataclass
class OutputText:
    """A request's text as the client sees it, ending where the engine stops: stop strings
    cut it (none ending in the first min_tokens tokens, which the engine does not check), and
    a stop token id, like EOS, ends it without text of its own (both kept with vLLM's
    include_stop_str_in_output)."""

    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    num_tokens: int = 0
    stop_text: StopText = field(init=False)

    stop_token: int | None = None
    """The stop token id that ended the output."""

    def __post_init__(self) -> None:
        self.stop_text = StopText(self.params.stop, self.params.include_stop_str_in_output)

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended the output (vLLM's stop_reason); None
        for EOS, max_tokens or an output no stop ended."""
        return self.stop_text.matched if self.stop_token is None else self.stop_token

    def push(self, token_ids: Sequence[int]) -> str:
        """The text newly generated tokens make safe to send."""
        params = self.params
        done = self.num_tokens
        self.num_tokens += len(token_ids)
        ids = list(token_ids)
        if ids and ids[-1] in params.stop_token_ids and self.num_tokens >= params.min_tokens:
            self.stop_token = ids[-1]
            if not params.include_stop_str_in_output:
                ids.pop()
        unchecked = max(0, min(len(ids), params.min_tokens - done))
        text = ""
        if unchecked:
            text = self.stop_text.push(self.detokenizer.push(ids[:unchecked]), checked=False)
        return text + self.stop_text.push(self.detokenizer.push(ids[unchecked:]))

    def flush(self) -> str:
        """At the end of the output: what was held back. A character the output ends inside
        of (U+FFFD) ends no stop string, as the engine checks them."""
        text = self.detokenizer.flush()
        whole = text.rstrip(REPLACEMENT_CHAR)
        sent = self.stop_text.push(whole) + self.stop_text.push(text[len(whole) :], checked=False)
        return sent + self.stop_text.flush()
