"""Structured output on the replica: one request's grammar state, as token masks.

llguidance does the matching (a JSON schema, regex, choice list or Lark grammar, compiled by
the door into its grammar text). This module keeps one request's matcher in step with the
tokens the request has output, and gives the masks a step's rows need: a verify step's row i,
and a draft's i-th proposal, follow the tokens proposed before them, so the matcher is advanced
over those and rolled back after.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class Grammar:
    """One request's grammar, advanced over its output; `done` once the grammar is complete
    (nothing but the end may follow) or broken (a token it refused was forced on it)."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, grammar: str, output: Sequence[int] = ()
    ) -> None:
        """`output`: what the request already output (a resumed request's earlier tokens)."""
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        self.vocab = tokenizer.vocab_size
        if output and not self.matcher.consume_tokens(list(output)):
            raise ValueError("grammar: the resumed output does not follow it")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def broken(self) -> str:
        """Why the grammar cannot go on ("" while it can): a token it refused was forced on it
        (constraints left it none), or llguidance hit one of its limits."""
        return str(self.matcher.get_error())

    def accept(self, token: int) -> None:
        """Advance over a token the request output (one the grammar refuses breaks it)."""
        self.matcher.consume_token(token)

    def banned(self, proposal: Sequence[int], start: int, n: int) -> torch.Tensor:
        """[n, vocab] True where the grammar refuses a token, row i after the output and the
        first `start + i` proposed tokens (once complete, the grammar allows EOS alone). A row
        whose proposed tokens the grammar refuses is never reached (verification rejects the
        token that breaks it) and bans nothing."""
        rows = torch.zeros(n, self.vocab, dtype=torch.bool)
        consumed = self.matcher.try_consume_tokens(list(proposal[:start])) if start else 0
        try:
            for i in range(n):
                if consumed < start + i:
                    break
                allowed = bytearray(self.matcher.compute_logit_bias())
                rows[i] = torch.frombuffer(allowed, dtype=torch.uint8) == 0
                if start + i < len(proposal) and i < n - 1:
                    consumed += self.matcher.try_consume_tokens([proposal[start + i]])
        finally:  # a step that fails here goes on without drafts: the grammar must not move
            if consumed:
                self.matcher.rollback(consumed)
        return rows
