"""A reasoning model's thinking apart from its answer, whole and as it streams."""

from __future__ import annotations

import itertools
from dataclasses import replace

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
    parser=st.sampled_from(
        [R1, QWEN3, replace(QWEN3, starts_open=True), replace(R1, include=False)]
    ),
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


PREFILLED = "<|user|>\nHow big is it?\n<|assistant|>\n<think>"
"""A Qwen3-Thinking-2507 generation prompt, or an assistant prefill `<think>` continued."""


@pytest.mark.parametrize(
    ("parser", "prompt", "text", "split"),
    [
        (QWEN3, PREFILLED, "Return the bytes.</think>\n 4", ("Return the bytes.", "\n 4")),
        (
            QWEN3,
            "<|user|>\nWhat does <think> do?\n<|assistant|>\n",
            "It opens.",
            (None, "It opens."),
        ),
        (QWEN3, "<|user|>\nHi\n<|assistant|>\n", "Hi</think>", (None, "Hi</think>")),
        (QWEN3, "<think>a</think>b<|user|>\nHi\n<|assistant|>\n", "Hi", (None, "Hi")),
        (R1, "<|assistant|>\n<think>\n\n</think>\n\n", "It is 4.", (None, "It is 4.")),
        (R1, "<think>a</think>b<|user|>\nHi\n<|assistant|>\n", "x</think>y", ("x", "y")),
        (R1, PREFILLED, "plan</think>answer", ("plan", "answer")),
    ],
)
def test_the_prompt_says_whether_the_output_starts_inside_thinking(
    parser: ReasoningParser, prompt: str, text: str, split: tuple[str | None, str]
) -> None:
    """A block the prompt leaves open (Qwen3-Thinking's templates open it; so does a prefill
    `<think>` continued) makes the output thinking until `</think>`; an empty block the
    prompt ends on (thinking switched off) makes it the answer; earlier turns' closed blocks
    leave the parser's own start, and so does a user's message quoting a marker."""
    for_prompt = parser.for_prompt(prompt)
    assert for_prompt.split(text) == split
    stream = ReasoningStream(for_prompt)
    pieces = [stream.feed(text[i : i + 2]) for i in range(0, len(text), 2)] + [stream.finish()]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == (
        split[0] or "",
        split[1],
    )


def test_a_prefill_that_leaves_a_block_open_continues_thinking() -> None:
    prompt = PREFILLED + "\nFirst,"
    assert QWEN3.for_prompt(prompt).split(" count.</think>4") == (None, " count.</think>4")
    prefilled = QWEN3.for_prompt(prompt, prefill="<think>\nFirst,")
    assert prefilled.split(" count.</think>4") == (" count.", "4")
    assert QWEN3.for_prompt(prompt, prefill="<think>a</think>b").starts_open is False


def test_thinking_not_included_is_dropped_whole_and_streamed() -> None:
    """vLLM's `include_reasoning: false`: only the answer goes out."""
    hidden = replace(QWEN3, include=False)
    assert hidden.split("<think>plan</think>answer") == (None, "answer")
    assert hidden.split("<think>cut off") == (None, "")
    stream = ReasoningStream(hidden)
    assert stream.feed("<think>pl") == ("", "")
    assert stream.feed("an</thi") == ("", "")
    assert stream.feed("nk>It is") == ("", "It is")
    assert stream.finish() == ("", "")


@pytest.mark.parametrize(
    ("parser", "pieces", "count"),
    [
        (R1, ["<think>", "plan", " it", "</think>", "answer"], 2),  # markers as their own tokens
        (R1, ["<", "think", ">pl", "an</", "think>", "x"], 2),  # markers over tokens, shared
        (R1, ["plan", "</think>", "answer"], 1),  # the template opened it
        (R1, ["still", " thinking"], 2),  # cut off while thinking: all of it
        (R1, ["</think>", "answer"], 0),
        (R1, ["a", "</think>", "b", "</think>"], 1),  # the answer may quote the marker
        (QWEN3, ["an", "swer"], 0),  # no thinking
        (QWEN3, ["<think>", "cut", " off"], 2),
        (R1, [], 0),
    ],
)
def test_the_thinking_tokens_are_those_between_the_markers(
    parser: ReasoningParser, pieces: list[str], count: int
) -> None:
    assert parser.thinking_tokens([p.encode() for p in pieces]) == count
    hidden = replace(parser, include=False)  # not shown is still generated, and counted
    assert hidden.thinking_tokens([p.encode() for p in pieces]) == count


def test_the_thinking_tokens_count_a_character_split_over_tokens_once_each() -> None:
    pieces = [b"<think>", "\u00e9".encode()[:1], "\u00e9".encode()[1:], b"</think>", b"ok"]
    assert R1.thinking_tokens(pieces) == 2
