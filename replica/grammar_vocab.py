"""A model's vocabulary as llguidance matches it, for the replica's grammars and the door's
check of them alike (torch-free, so the door does not load torch)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
from tokenizers import Tokenizer


def grammar_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The model's size (which may exceed the tokenizer's) and EOS ids (a ValueError without
    any). About a second at a 128k vocabulary: built once per engine and door."""
    return llguidance.LLTokenizer(
        tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )
