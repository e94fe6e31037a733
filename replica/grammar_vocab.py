"""A model's vocabulary as llguidance matches it, for the replica's grammars and the door's
check of them alike (torch-free, so the door does not load torch).

llguidance makes every added token that reads `<...>` special (a reasoner's `<think>` and
`</think>`, Qwen's `<tool_call>`, as well as EOS): no text matches it, only a Lark grammar that
names the token (`<think>`, `<[4096]>`). Yet it spells the text a grammar forces with the
model's tokenizer, which turns `<think>` into that token: the matcher then refused the token it
had forced, and the output aborted. Here the forced text is spelled without the added tokens
llguidance made special.

Text is text, then: a regex, a quoted Lark string or a JSON value reading `</think>` comes in
ordinary tokens, the marker only where a Lark grammar names it. The reasoning parser splits on
the markers' text, so it reads both spellings alike; but a thinking stage ends on the marker's
token id (`slo.stages[].until`), and the model learned the marker as the end of its thinking:
a JSON value that happens to read `</think>` must end neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
from tokenizers import Tokenizer


@dataclass(frozen=True)
class _TextTokenizer:
    """What llguidance's TokenizerWrapper reads: each token's bytes (special ones get its
    marker byte), and the encoder of the text it forces."""

    tokens: list[bytes]
    special_token_ids: list[int]
    eos_token_id: int
    encoder: Tokenizer
    bos_token_id: None = None

    def __call__(self, text: bytes) -> list[int]:
        """llguidance passes only whole UTF-8 characters."""
        return list(self.encoder.encode(text.decode(), add_special_tokens=False).ids)


def grammar_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The model's size (which may exceed the tokenizer's) and EOS ids (a ValueError without
    any). About 1.5 s at a 128k vocabulary (llguidance's own build, twice): built once per
    engine and door."""
    eos = list(eos_token_ids)
    own = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    special = [t for t in range(own.vocab_size) if own.is_special_token(t)]
    text = _TextTokenizer(
        [own.decode_bytes([t]) for t in range(own.vocab_size)],
        special,
        eos[0],
        _without_added(tokenizer, set(special)),
    )
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(text), n_vocab=vocab_size, eos_token=eos
    )


def _without_added(tokenizer: Tokenizer, special: set[int]) -> Tokenizer:
    """The tokenizer without the added tokens in `special`, untruncated: it spells their text
    with ordinary tokens, however long."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] not in special]
    spec["truncation"] = spec["padding"] = None
    return Tokenizer.from_str(json.dumps(spec))
