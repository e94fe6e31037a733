"""Stop strings cut the client's text right before the first one, and a stream never sends a
part of one."""

from __future__ import annotations

import pytest

from router.stops import StopText


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
    assert text.stopped
    text = StopText(("ab",))
    assert text.push("xaba", checked=False) + text.push("b") == "xab"
    assert text.stopped
    text = StopText(("ab",))
    sent = text.push("abab", checked=False) + text.push("cd")
    assert sent + text.flush() == "ababcd" and not text.stopped
