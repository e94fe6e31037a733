"""Stop strings cut the client's text right before the first one, and a stream never sends a
part of one."""

from __future__ import annotations

import pytest

from replica.request import SamplingParams
from router.stops import OutputText, StopText
from router.tokenizer import TextCodec


def stream(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], str]:
    text = StopText(stops)
    sent = [text.push(piece) for piece in pieces]
    return sent, text.flush()


def test_the_text_ends_before_the_stop_even_inside_a_piece() -> None:
    sent, tail = stream(("m",), ["fro", "m . i", "mport"])
    assert "".join(sent) + tail == "fro"
    sent, tail = stream(("import",), ["from . ", "import os"])
    assert "".join(sent) + tail == "from . "


def test_a_stop_split_over_pieces_is_never_sent_in_part() -> None:
    sent, tail = stream(("os\nf",), ["from . import o", "s", "\n", "from"])
    assert sent == ["from . impor", "t", " ", ""]  # "os\nf" began after what was sent
    assert tail == ""


def test_the_earliest_of_several_stops_wins() -> None:
    sent, tail = stream(("cd", "b"), ["abcdef"])
    assert sent == ["a"] and tail == ""


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_text_without_a_stop_is_all_sent(stops: tuple[str, ...]) -> None:
    sent, tail = stream(stops, ["ab", "c", "z"])
    assert "".join(sent) + tail == "abcz"
    assert all(len(piece) <= 3 for piece in sent)


def test_no_stop_may_end_in_unchecked_text_but_one_may_begin_there() -> None:
    """min_tokens: the engine checks no stop string before its min_tokens-th token."""
    text = StopText(("ab",))
    assert text.push("xab", checked=False) + text.push("yab") == "xaby"
    assert text.matched == "ab"
    text = StopText(("ab",))
    assert text.push("xaba", checked=False) + text.push("b") == "xab"
    assert text.matched == "ab"
    text = StopText(("ab",))
    sent = text.push("abab", checked=False) + text.push("cd")
    assert sent + text.flush() == "ababcd" and text.matched is None


def output_text(codec: TextCodec, tokens: list[int], chunks: int, **sampling: object) -> str:
    """The text a client gets for `tokens` arriving in pieces of `chunks` tokens."""
    params = SamplingParams(max_tokens=64, **sampling)  # type: ignore[arg-type]
    text = OutputText(codec.detokenizer(), params)
    sent = [text.push(tokens[i : i + chunks]) for i in range(0, len(tokens), chunks)]
    return "".join(sent) + text.flush()


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_a_stop_token_ends_the_text_without_its_own(codec: TextCodec, chunks: int) -> None:
    tokens = codec.encode("def f(x):\n    return x")
    stop = tokens[-1]
    assert output_text(codec, tokens, chunks, stop_token_ids=(stop,)) == codec.decode(tokens[:-1])
    early = output_text(codec, tokens, chunks, stop_token_ids=(stop,), min_tokens=len(tokens) + 1)
    assert early == codec.decode(tokens), "before min_tokens a stop token id ends nothing"


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_no_stop_string_ends_in_the_first_min_tokens_tokens(codec: TextCodec, chunks: int) -> None:
    """As the engine checks them: a match ending in token min_tokens or before is ignored."""
    tokens = codec.encode("a_b_c_d_e")
    text = codec.decode(tokens)
    ends = [
        n
        for n in range(1, len(tokens) + 1)
        if codec.decode(tokens[:n]).count("_") > codec.decode(tokens[: n - 1]).count("_")
    ]
    assert len(ends) >= 2
    cut_at = [text.index("_"), text.index("_", text.index("_") + 1)]
    assert output_text(codec, tokens, chunks, stop=("_",)) == text[: cut_at[0]]
    assert (
        output_text(codec, tokens, chunks, stop=("_",), min_tokens=ends[0] - 1) == text[: cut_at[0]]
    )
    assert output_text(codec, tokens, chunks, stop=("_",), min_tokens=ends[0]) == text[: cut_at[1]]


def test_what_ended_the_text_is_its_stop_reason(codec: TextCodec) -> None:
    tokens = codec.encode("a_b_c")
    params = SamplingParams(max_tokens=64, stop=("c", "_b"))
    text = OutputText(codec.detokenizer(), params)
    assert text.push(tokens) + text.flush() == "a" and text.stop_reason == "_b"
    ended = OutputText(codec.detokenizer(), SamplingParams(stop_token_ids=(tokens[-1],)))
    ended.push(tokens)
    assert ended.stop_reason == tokens[-1]
    assert OutputText(codec.detokenizer(), SamplingParams()).stop_reason is None


def test_stops_kept_in_the_text_when_asked(codec: TextCodec) -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop string, or with the
    stop token's own text."""
    tokens = codec.encode("a_b_c")
    text = codec.decode(tokens)
    kept = output_text(codec, tokens, 2, stop=("_b",), include_stop_str_in_output=True)
    assert kept == text[: text.index("_b") + 2]
    by_token = output_text(
        codec, tokens, 2, stop_token_ids=(tokens[-1],), include_stop_str_in_output=True
    )
    assert by_token == text


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_a_character_the_output_ends_inside_of_ends_no_stop_string(
    codec: TextCodec, chunks: int
) -> None:
    """The engine checks stop strings on whole characters only, so the text cut by max_tokens
    inside a character (U+FFFD) keeps it, and a stop string holding U+FFFD never matches a
    piece of one (it used to end the text before the piece)."""
    tokens = codec.encode("中文😀é")
    pieces = [n for n in range(1, len(tokens)) if codec.decode(tokens[:n]).endswith("\ufffd")]
    assert pieces
    for n in pieces:
        whole = codec.decode(tokens[:n])
        for stop in ("\ufffd", whole[-2:]):
            params = SamplingParams(max_tokens=64, stop=(stop,))
            text = OutputText(codec.detokenizer(), params)
            sent = [text.push(tokens[i : min(i + chunks, n)]) for i in range(0, n, chunks)]
            assert "".join(sent) + text.flush() == whole and text.stop_reason is None, (n, stop)
