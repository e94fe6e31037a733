"""Prompt-lookup proposals (vLLM's `ngram` method): copy what followed the last n-gram before.

Nearly free (no model call) and strong on repetitive text such as code edits or quoting the
prompt. Longer n-grams are tried first because their continuations are more likely right.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the last n tokens."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            # Latest start first; the match must end before the final n-gram itself.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == pattern:
                    follow = start + n
                    return tokens[follow : follow + k]
        return []
