"""Stop strings in the text a client sees: cut right before the first one, even inside a
token, and never sent in part while streaming.

The engine stops generating at the token that completes a stop string (and counts it, as
vLLM does); only the text can end mid-token, so the cut is made here, on the detokenized text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopText:
    """One request's text stream with its stop strings held back until ruled out."""

    stops: tuple[str, ...]
    held: str = ""
    """Text not sent yet: it may be the start of a stop string."""
    stopped: bool = False

    def push(self, text: str) -> str:
        """Add newly decoded text; return what is safe to send. Text held back is at most
        one character shorter than the longest stop string, so a stop string can never have
        begun in text already sent."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
            return out
        cut = len(self.held) - (max(len(s) for s in self.stops) - 1)
        if cut <= 0:
            return ""
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def flush(self) -> str:
        """At the end of the output: the held text, which no stop string completed."""
        out, self.held = self.held, ""
        return out
