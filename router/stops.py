"""Stop strings in the text a client sees: cut right before the first one, even inside a
token, and never sent in part while streaming.

The engine stops generating at the token that completes a stop string (and counts it, as
vLLM does); only the text can end mid-token, so the cut is made here, on the detokenized text.
With min_tokens, the engine checks no stop string before the request's min_tokens-th token, so
a match here must end in text that came after the first min_tokens - 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopText:
    """One request's text stream with its stop strings held back until ruled out."""

    stops: tuple[str, ...]
    held: str = ""
    """Text not sent yet: it may be the start of a stop string."""
    guard: int = 0
    """A match in `held` must end after this many of its characters (text of tokens that no
    stop string may end in, min_tokens)."""
    stopped: bool = False

    def push(self, text: str, *, checked: bool = True) -> str:
        """Add newly decoded text; return what is safe to send. Text held back is at most
        one character shorter than the longest stop string, so a stop string can never have
        begun in text already sent. `checked` False: no stop string may end in this text,
        though one may begin there."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        if not checked:
            self.guard = len(self.held)
        hits = [i for i in map(self._find, self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
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
