"""Incremental detokenization never splits a character and adds up to the full decode."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import BadRequest
from router.tokenizer import REPLACEMENT_CHAR, TextCodec


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60), step=st.integers(min_value=1, max_value=4))
def test_deltas_rebuild_the_text_without_broken_characters(
    codec: TextCodec, text: str, step: int
) -> None:
    ids = codec.encode(text)
    detok = codec.detokenizer()
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert "".join(deltas) == codec.decode(ids)
    if REPLACEMENT_CHAR not in text:
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_truncated_character_is_flushed_as_replacement(codec: TextCodec) -> None:
    ids = codec.encode("😀")
    detok = codec.detokenizer()
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == REPLACEMENT_CHAR


def test_the_bytes_of_a_characters_pieces_join_into_it(codec: TextCodec) -> None:
    """A token's bytes (log-probabilities' `bytes`) are its own, where its text is U+FFFD."""
    ids = codec.encode("中文😀é")
    assert [codec.token_text(t) for t in ids].count(REPLACEMENT_CHAR) >= 4
    assert b"".join(codec.token_bytes(t) for t in ids).decode() == "中文😀é"
    assert codec.token_bytes(codec.eos_token_ids[0]) == b"<|endoftext|>"
    no_eos = dataclasses.replace(codec, eos_token_ids=())  # no grammar vocabulary to ask
    assert no_eos.byte_vocab is None and no_eos.token_bytes(ids[0]) == REPLACEMENT_CHAR.encode()


def test_eos_is_not_text(codec: TextCodec) -> None:
    detok = codec.detokenizer()
    eos = codec.tokenizer.token_to_id("<|endoftext|>")
    assert detok.push([*codec.encode("hi"), eos]) + detok.flush() == "hi"


def test_chat_without_template_is_a_bad_request(codec: TextCodec) -> None:
    bare = TextCodec(codec.tokenizer, None)
    with pytest.raises(BadRequest) as info:
        bare.render_chat([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"
