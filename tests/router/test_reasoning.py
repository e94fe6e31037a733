"""A reasoning model's thinking apart from its answer, whole and as it streams."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.reasoning import PARSERS, ReasoningParser, ReasoningStream, reasoning_parser

R1 = PARSERS["deepseek_r1"]
QWEN3 = PARSERS["qwen3"]


@pytest.mark.parametrize(
    ("parser", "text", "split"),
    [
        (R1, "<think>plan</think>answer", ("plan", "answer")),
        (R1, "plan</think>\n\nanswer", ("plan", "\n\nanswer")),  # the template opened it
        (R1, "still thinking", ("still thinking", "")),
        (R1, "</think>answer", ("", "answer")),
        (R1, "a</think>b</think>c", ("a", "b</think>c")),  # the answer may quote the marker
        (QWEN3, "<think>plan</think>answer", ("plan", "answer")),
        (QWEN3, "answer without thinking", (None, "answer without thinking")),
        (QWEN3, "answer</think>", (None, "answer</think>")),
        (QWEN3, "<think>cut off", ("cut off", "")),
        (QWEN3, "<thi", (None, "<thi")),  # a start it never completed is text
        (R1, "", ("", "")),
    ],
)
def test_a_whole_output_splits_at_the_markers(
    parser: ReasoningParser, text: str, split: tuple[str | None, str]
) -> None:
    assert parser.split(text) == split


@given(
    parser=st.sampled_from([R1, QWEN3]),
    parts=st.lists(st.sampled_from(["<", "<think>", "</", "think>", "</think>", "a", "b\n"])),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_any_streaming_of_an_output_splits_it_as_the_whole(
    parser: ReasoningParser, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    stream = ReasoningStream(parser)
    thought, content = "", ""
    for a, b in itertools.pairwise(points):
        more, rest = stream.feed(text[a:b])
        thought, content = thought + more, content + rest
    more, rest = stream.finish()
    whole = parser.split(text)
    assert (thought + more, content + rest) == (whole[0] or "", whole[1])


def test_a_marker_split_over_deltas_is_held_until_whole() -> None:
    stream = ReasoningStream(R1)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>step one</th") == ("step one", "")
    assert stream.feed("ink>The answer") == ("", "The answer")
    assert stream.feed(" is 4.") == ("", " is 4.")
    assert stream.finish() == ("", "")


def test_the_front_door_arg_names_a_parser_or_gives_markers() -> None:
    assert reasoning_parser(None) is None
    assert reasoning_parser("qwen3") is QWEN3
    custom = reasoning_parser({"start": "[think]", "end": "[/think]", "starts_open": False})
    assert custom == ReasoningParser("[think]", "[/think]", starts_open=False)
    assert reasoning_parser({"end": "###"}) == ReasoningParser("", "###", starts_open=True)
    with pytest.raises(ValueError, match="one of deepseek_r1, qwen3"):
        reasoning_parser("granite")
    with pytest.raises(ValueError, match="takes start, end and starts_open"):
        reasoning_parser({"stop": "x"})
    with pytest.raises(ValueError, match="end must be non-empty"):
        reasoning_parser({"start": "<think>"})
    with pytest.raises(ValueError, match="starts_open must be true or false"):
        reasoning_parser({"end": "x", "starts_open": "yes"})
