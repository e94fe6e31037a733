"""SSE framing and OpenAI chunk shapes, parsed back the way a client reads them."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.api import FinalRecord, Placement, StageVerdict, Verdict
from replica.batch import TokenLogprob
from router.errors import Rejected
from router.frontdoor import Finished, Output
from router.openai_format import (
    ChunkWriter,
    TokenIds,
    cluster_headers,
    error_body,
    full_response,
    placement_headers,
    sse_event,
)
from router.openai_schema import Echo, Endpoint
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tool_parsers import PARSERS
from router.tools import ToolCalling

RECORD = FinalRecord(
    request_id="r",
    verdict=Verdict.BEST_EFFORT,
    replica=1,
    hops=2,
    finish_reason="stop",
    num_prompt_tokens=3,
    num_output_tokens=2,
    stages=(StageVerdict("default", False, 1, 2),),
)


TOKENS = {1: "He", 2: "llo", 3: "é", 4: "</s>", 5: "é", 6: "\ufffd", 7: "\ufffd"}
"""Token id -> text, standing in for a tokenizer: 6 and 7 are the two bytes of "é"."""
PIECES = {6: b"\xc3", 7: b"\xa9"}


class Table:
    """The spelling of TOKENS."""

    def token_text(self, token_id: int) -> str:
        return TOKENS[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return PIECES.get(token_id, TOKENS[token_id].encode())


SPELLING = Table()


def outputs(texts: list[str], records: list[FinalRecord]) -> list[Output]:
    return [Output(t, (), (), r) for t, r in zip(texts, records, strict=True)]


def events(stream: bytes) -> list[str]:
    """Split an SSE byte stream into data payloads the way a client does."""
    assert stream.endswith(b"\n\n")
    out = []
    for block in stream.decode().split("\n\n")[:-1]:
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines)
        out.append("\n".join(line[len("data: ") :] for line in lines))
    return out


def test_sse_event_is_one_line_even_with_newlines() -> None:
    raw = sse_event({"text": "a\nb\r\n"})
    assert raw.count(b"\n") == 2
    assert json.loads(events(raw)[0]) == {"text": "a\nb\r\n"}


def test_chat_stream_shape() -> None:
    w = ChunkWriter(Endpoint.CHAT, "id1", 5, "demo", SPELLING)
    stream = w.text(0, "Hel") + w.text(0, "lo") + w.finish(0, Finished(RECORD))
    stream += w.done([Finished(RECORD)], 1, include_usage=True)
    data = events(stream)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "id1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"content": "Hel", "role": "assistant"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "lo"}
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["service_tier"] == "flex"
    assert chunks[2]["slos_serve"]["replica"] == 1 and chunks[2]["slos_serve"]["hops"] == 2
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_stream_without_usage() -> None:
    w = ChunkWriter(Endpoint.COMPLETIONS, "id2", 5, "demo", SPELLING)
    data = events(
        w.text(0, "x") + w.finish(0, Finished(RECORD)) + w.done([Finished(RECORD)], 1, False)
    )
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["x", ""]
    assert data[-1] == "[DONE]"


def test_the_stop_string_or_token_that_ended_a_choice_is_its_stop_reason() -> None:
    """vLLM's stop_reason, on the finish chunk and in the full response."""
    w = ChunkWriter(Endpoint.COMPLETIONS, "id4", 5, "demo", SPELLING)
    finish = json.loads(events(w.finish(0, Finished(RECORD, "\n\n")))[0])["choices"][0]
    assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", "\n\n")
    output = Output("hi", (), (), RECORD, 13)
    body = full_response(Endpoint.COMPLETIONS, "id5", 7, "demo", [output], 1, SPELLING)
    assert body["choices"][0]["stop_reason"] == 13


def test_full_response_and_headers() -> None:
    body = full_response(Endpoint.CHAT, "id3", 7, "demo", outputs(["hi"], [RECORD]), 1, SPELLING)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ]
    assert body["slos_serve"]["slo_attained"] is False
    assert body["slos_serve"]["stages"] == [
        {"name": "default", "attained": False, "late_tokens": 1, "tokens": 2}
    ]
    headers = cluster_headers(body["slos_serve"])
    assert headers["x-slos-serve-verdict"] == "best_effort"
    assert headers["x-slos-serve-replica"] == "1"
    assert headers["x-slos-serve-slo-attained"] == "false"


ADMITTED = replace(
    RECORD,
    verdict=Verdict.ADMITTED,
    replica=0,
    hops=1,
    migrations=1,
    num_cached_tokens=2,
    num_output_tokens=4,
    stages=(StageVerdict("default", True, 0, 4),),
)


def test_several_choices_each_say_what_the_cluster_did() -> None:
    """Two prompts x n = 2: the prompts (and their cached tokens) counted once each, every
    choice's verdict in it, and the response's the weakest over them."""
    records = [ADMITTED, RECORD, ADMITTED, ADMITTED]
    body = full_response(
        Endpoint.COMPLETIONS,
        "id5",
        7,
        "demo",
        outputs(list("abcd"), records),
        2,
        SPELLING,
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == list("abcd")
    assert [c["slos_serve"]["replica"] for c in body["choices"]] == [0, 1, 0, 0]
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 14,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert body["service_tier"] == "flex"
    summary = body["slos_serve"]
    assert summary == {
        "verdict": "best_effort",
        "replica": None,
        "hops": 2,
        "migrations": 3,
        "slo_attained": False,
        "stages": [{"name": "default", "attained": False, "late_tokens": 1, "tokens": 14}],
    }
    assert cluster_headers(summary) == {
        "x-slos-serve-verdict": "best_effort",
        "x-slos-serve-hops": "2",
        "x-slos-serve-slo-attained": "false",
    }
    same = full_response(
        Endpoint.CHAT, "id6", 7, "demo", outputs(["a", "b"], [ADMITTED] * 2), 2, SPELLING
    )
    assert same["slos_serve"]["replica"] == 0 and same["slos_serve"]["slo_attained"] is True
    assert same["usage"]["prompt_tokens"] == 3 and same["service_tier"] == "default"
    placed = [Placement(Verdict.ADMITTED, 1, 1), Placement(Verdict.ADMITTED, 1, 3)]
    assert placement_headers(placed) == {
        "x-slos-serve-verdict": "admitted",
        "x-slos-serve-hops": "3",
        "x-slos-serve-replica": "1",
    }
    assert placement_headers([None]) == {}


def test_chat_stream_of_several_choices() -> None:
    """Each choice's first delta carries the role; each ends with its own finish chunk."""
    w = ChunkWriter(Endpoint.CHAT, "id7", 5, "demo", SPELLING)
    stream = w.text(1, "b") + w.text(0, "a") + w.text(1, "c") + w.finish(1, Finished(RECORD))
    stream += w.finish(0, Finished(ADMITTED)) + w.done(
        [Finished(ADMITTED), Finished(RECORD)], 2, include_usage=True
    )
    chunks = [json.loads(d) for d in events(stream)[:-1]]
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [(c["index"], c["delta"].get("role")) for c in choices[:3]] == [
        (1, "assistant"),
        (0, "assistant"),
        (1, None),
    ]
    assert chunks[3]["slos_serve"]["verdict"] == "best_effort" and choices[3]["index"] == 1
    assert chunks[4]["slos_serve"]["verdict"] == "admitted" and choices[4]["index"] == 0
    assert chunks[5]["usage"]["prompt_tokens"] == 3 and chunks[5]["choices"] == []


LOGPROBS = (TokenLogprob(-0.5, ((1, -0.5), (3, -1.5))), TokenLogprob(-2.0, ((4, -0.1), (3, -2.5))))


def only_choice(endpoint: Endpoint, output: Output) -> dict[str, Any]:
    return full_response(endpoint, "id8", 7, "demo", [output], 1, SPELLING)["choices"][0]


def test_completion_logprobs_list_tokens_offsets_and_alternatives() -> None:
    """The sampled token joins its alternatives, as OpenAI's legacy form lists them; offsets
    run on across a stream's chunks."""
    choice = only_choice(Endpoint.COMPLETIONS, Output("Hello", (1, 2), LOGPROBS, RECORD))
    assert choice["logprobs"] == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"He": -0.5, "é": -1.5}, {"</s>": -0.1, "é": -2.5, "llo": -2.0}],
        "text_offset": [0, 2],
    }
    w = ChunkWriter(Endpoint.COMPLETIONS, "id9", 5, "demo", SPELLING)
    stream = w.text(0, "He", (1,), LOGPROBS[:1]) + w.text(0, "llo", (2,), LOGPROBS[1:])
    first, second = (json.loads(d)["choices"][0]["logprobs"] for d in events(stream))
    assert first["text_offset"] == [0] and second["text_offset"] == [2]
    without = json.loads(events(w.text(1, "x"))[0])["choices"][0]
    assert without["logprobs"] is None


def test_alternatives_that_decode_alike_keep_the_highest_and_infinities_are_floored() -> None:
    logprob = TokenLogprob(float("-inf"), ((5, -1.0), (3, -1.5), (2, float("-inf"))))
    choice = only_choice(Endpoint.COMPLETIONS, Output("He", (1,), (logprob,), RECORD))
    assert choice["logprobs"]["top_logprobs"] == [{"é": -1.0, "llo": -9999.0, "He": -9999.0}]
    assert choice["logprobs"]["token_logprobs"] == [-9999.0]
    json.dumps(choice, allow_nan=False)


def test_chat_logprobs_have_bytes_and_top_entries() -> None:
    logprobs = only_choice(Endpoint.CHAT, Output("éllo", (3, 2), LOGPROBS, RECORD))["logprobs"]
    content = logprobs["content"]
    assert content[0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "é", "logprob": -1.5, "bytes": [195, 169]},
        ],
    }
    assert [c["token"] for c in content] == ["é", "llo"]
    assert logprobs["refusal"] is None


def test_the_bytes_of_pieces_of_a_character_join_into_it() -> None:
    """OpenAI's `bytes` rebuilds what a token's text cannot: pieces of a character each
    show U+FFFD, their bytes make "é"; vLLM's return_tokens_as_token_ids names them by id."""
    values = (TokenLogprob(-0.5, ((6, -0.5),)), TokenLogprob(-0.1, ()))
    output = Output("é", (6, 7), values, RECORD)
    content = only_choice(Endpoint.CHAT, output)["logprobs"]["content"]
    assert [c["token"] for c in content] == ["\ufffd", "\ufffd"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "é"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xC3]
    by_id = full_response(Endpoint.CHAT, "id8", 7, "demo", [output], 1, TokenIds())
    named = by_id["choices"][0]["logprobs"]["content"]
    assert [(c["token"], bytes(c["bytes"])) for c in named] == [
        ("token_id:6", b"token_id:6"),
        ("token_id:7", b"token_id:7"),
    ]
    legacy = full_response(Endpoint.COMPLETIONS, "id8", 7, "demo", [output], 1, TokenIds())
    assert legacy["choices"][0]["logprobs"]["tokens"] == ["token_id:6", "token_id:7"]
    assert legacy["choices"][0]["logprobs"]["top_logprobs"][0] == {"token_id:6": -0.5}


def test_error_json_shape() -> None:
    body = error_body(Rejected("full", None, 2.0))
    assert body == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": 429}
    }
    w = ChunkWriter(Endpoint.CHAT, "id4", 5, "demo", SPELLING)
    data = events(w.error(Rejected("gone", None, 1.0)))
    assert json.loads(data[0])["error"]["message"] == "gone" and data[1] == "[DONE]"


def test_echo_leads_a_completion_with_its_prompt_and_its_log_probabilities() -> None:
    """lm-evaluation-harness reads a continuation's log-probability this way: the prompt's
    tokens first (the first without one), then the output's."""
    echo = Echo("He", (1,), logprobs=True)
    output = Output("llo", (2,), (TokenLogprob(-0.5, ((2, -0.5),)),), RECORD)
    body = full_response(Endpoint.COMPLETIONS, "id9", 7, "demo", [output], 1, SPELLING, [echo])
    choice = body["choices"][0]
    assert choice["text"] == "Hello"
    assert choice["logprobs"]["tokens"] == ["He", "llo"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5]
    assert choice["logprobs"]["top_logprobs"] == [None, {"llo": -0.5}]
    assert choice["logprobs"]["text_offset"] == [0, 2]
    two = Echo("HeHe", (1, 1), logprobs=True)
    both = replace(output, prompt_logprobs=(TokenLogprob(-3.0, ((2, -0.1),)),))
    body = full_response(Endpoint.COMPLETIONS, "id9", 7, "demo", [both], 1, SPELLING, [two])
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -0.5]
    bare = full_response(
        Endpoint.COMPLETIONS,
        "id9",
        7,
        "demo",
        [replace(output, logprobs=())],
        1,
        SPELLING,
        [Echo("He", (1,))],
    )
    assert bare["choices"][0]["text"] == "Hello" and bare["choices"][0]["logprobs"] is None


def test_a_prompt_only_choice_is_its_prompt_alone() -> None:
    echo = Echo("HeHe", (1, 1), logprobs=True, prompt_only=True)
    scored = replace(RECORD, num_output_tokens=0, finish_reason="length")  # as Generation ends it
    drawn = Output("", (), (), scored, None, (TokenLogprob(-3.0),))
    body = full_response(Endpoint.COMPLETIONS, "id9", 7, "demo", [drawn], 1, SPELLING, [echo])
    choice = body["choices"][0]
    assert choice["text"] == "HeHe" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0]
    assert body["usage"]["completion_tokens"] == 0


NAMED = ToolCalling({"type": "object"}, "lookup")
REQUIRED = ToolCalling({"type": "array"}, None)
CALLS = '[{"name": "lookup", "parameters": {"q": "a"}}, {"name": "now", "parameters": {}}]'
LENGTH = replace(RECORD, finish_reason="length")


def test_tool_calls_in_full_responses_validate_as_openai_clients_read_them() -> None:
    """A named call ends with stop (as OpenAI reports a forced call), "required"'s with
    tool_calls; a "required" output cut short stays text."""
    named = full_response(
        Endpoint.CHAT, "t1", 7, "demo", outputs(['{"q": 1}'], [RECORD]), 1, SPELLING, (), NAMED
    )
    ChatCompletion.model_validate(named)
    choice = named["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"q": 1}'}
    texts = [CALLS, CALLS[:20]]
    body = full_response(
        Endpoint.CHAT, "t2", 7, "demo", outputs(texts, [RECORD, LENGTH]), 2, SPELLING, (), REQUIRED
    )
    ChatCompletion.model_validate(body)
    made, cut = body["choices"]
    assert made["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in made["message"]["tool_calls"]] == ["lookup", "now"]
    assert cut["finish_reason"] == "length" and cut["message"] == {
        "role": "assistant",
        "content": CALLS[:20],
    }


def test_streamed_tool_calls_add_up_to_the_full_ones() -> None:
    """A named call streams its arguments (id and name first); "required"'s calls come whole
    at the end, each choice numbering its own from 0; logprobs still stream meanwhile."""
    w = ChunkWriter(Endpoint.CHAT, "t3", 5, "demo", SPELLING, NAMED)
    stream = w.text(0, '{"q"') + w.text(0, ": 1}") + w.finish(0, Finished(RECORD))
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in events(stream)]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls and first.tool_calls[0].id
    assert first.tool_calls[0].function and first.tool_calls[0].function.name == "lookup"
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in chunks
        if c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].function
    )
    assert arguments == '{"q": 1}' and chunks[-1].choices[0].finish_reason == "stop"
    w = ChunkWriter(Endpoint.CHAT, "t4", 5, "demo", SPELLING, REQUIRED)
    stream = w.text(1, CALLS[:10]) + w.text(0, CALLS[:30], (1,), LOGPROBS[:1])
    stream += w.text(0, CALLS[30:]) + w.text(1, CALLS[10:]) + w.finish(0, Finished(RECORD))
    stream += w.finish(1, Finished(RECORD)) + w.done([Finished(RECORD)] * 2, 2, include_usage=False)
    data = events(stream)
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert all(not c.choices[0].delta.content for c in chunks)
    assert any(c.choices[0].logprobs for c in chunks)
    for index in (0, 1):
        deltas = [
            t
            for c in chunks
            if c.choices[0].index == index
            for t in c.choices[0].delta.tool_calls or ()
        ]
        assert [(t.index, t.function.name if t.function else None) for t in deltas] == [
            (0, "lookup"),
            (1, "now"),
        ]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].index == index]
        assert finish[-1] == "tool_calls" and w.choices == {}


AUTO = ToolCalling(None, None, parser=PARSERS["hermes"])
HERMES_CALL = 'Checking.<tool_call>{"name": "lookup", "arguments": {"q": "a"}}</tool_call>'


def test_auto_calls_come_with_their_content_and_plain_text_stays_text() -> None:
    texts = [HERMES_CALL, "No tool is needed < here."]
    body = full_response(
        Endpoint.CHAT, "t5", 7, "demo", outputs(texts, [RECORD, RECORD]), 2, SPELLING, (), AUTO
    )
    ChatCompletion.model_validate(body)
    made, plain = body["choices"]
    assert made["finish_reason"] == "tool_calls" and made["message"]["content"] == "Checking."
    (call,) = made["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"q": "a"}'}
    assert plain["finish_reason"] == "stop"
    assert plain["message"] == {"role": "assistant", "content": "No tool is needed < here."}
    # A call the length cut before its closing tag is still one, as vLLM reads it.
    unclosed = HERMES_CALL.removesuffix("</tool_call>")
    body = full_response(
        Endpoint.CHAT, "t7", 7, "demo", outputs([unclosed], [LENGTH]), 1, SPELLING, (), AUTO
    )
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_auto_streams_content_until_a_call_may_start_then_the_calls_at_the_end() -> None:
    w = ChunkWriter(Endpoint.CHAT, "t6", 5, "demo", SPELLING, AUTO)
    pieces = ["Check", "ing.<to", "ol_call>", HERMES_CALL[len("Checking.<tool_call>") :]]
    stream = b"".join(w.text(0, p) for p in pieces) + w.finish(0, Finished(RECORD))
    pieces = ["Maybe <", "tool", "s later."]
    stream += b"".join(w.text(1, p) for p in pieces) + w.finish(1, Finished(RECORD))
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in events(stream)]
    for index, content, names, reason in (
        (0, "Checking.", ["lookup"], "tool_calls"),
        (1, "Maybe <tools later.", [], "stop"),
    ):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == content
        calls = [t for c in mine for t in c.delta.tool_calls or ()]
        assert [t.function.name for t in calls if t.function] == names
        assert all(t.id and t.index == 0 for t in calls)
        assert mine[-1].finish_reason == reason
    # Nothing past "Checking." went out as content before the call was whole.
    assert chunks[1].choices[0].delta.content == "ing."
    assert w.choices == {}


def test_llama3_streams_hold_an_output_that_may_be_calls_until_it_ends() -> None:
    llama = ToolCalling(None, None, parser=PARSERS["llama3_json"])
    w = ChunkWriter(Endpoint.CHAT, "t8", 5, "demo", SPELLING, llama)
    calls = ['{"name": "lookup", ', '"parameters": {"q": "a"}}']
    stream = b"".join(w.text(0, p) for p in calls) + w.finish(0, Finished(RECORD))
    stream += b"".join(w.text(1, p) for p in ["{not", " json"]) + w.finish(1, Finished(RECORD))
    stream += b"".join(w.text(2, p) for p in ["Hi", " {there}"]) + w.finish(2, Finished(RECORD))
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in events(stream)]
    for index, content, names, reason in (
        (0, "", ["lookup"], "tool_calls"),
        (1, "{not json", [], "stop"),
        (2, "Hi {there}", [], "stop"),
    ):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == content
        assert [t.function.name for c in mine for t in c.delta.tool_calls or () if t.function] == (
            names
        )
        assert mine[-1].finish_reason == reason
    # Plain text goes out as it comes once it cannot be a call.
    hi = [c.choices[0].delta.content for c in chunks if c.choices[0].index == 2]
    assert hi[:2] == ["Hi", " {there}"]


R1 = REASONING_PARSERS["deepseek_r1"]


def test_thinking_comes_apart_from_the_answer_whole_and_streamed() -> None:
    texts = ["<think>Two and two.</think>\n\nIt is 4.", "Still thinking", HERMES_CALL, "<think>"]
    thoughts = ["Two and two.", "Still thinking", None, None]  # empty thinking: null
    answers = ["\n\nIt is 4.", None, HERMES_CALL, None]  # all thinking: null content
    records = [RECORD, LENGTH, RECORD, LENGTH]
    # The third thinks nothing: a qwen3-style parser leaves an output without <think> alone.
    parsers = [R1, R1, REASONING_PARSERS["qwen3"], R1]
    for text, thought, answer, record, parser in zip(
        texts, thoughts, answers, records, parsers, strict=True
    ):
        body = full_response(
            Endpoint.CHAT, "r1", 7, "demo", outputs([text], [record]), 1, SPELLING, reasoning=parser
        )
        ChatCompletion.model_validate(body)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (thought, answer)
        w = ChunkWriter(Endpoint.CHAT, "r2", 5, "demo", SPELLING, reasoning=parser)
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # markers split over chunks
        stream = b"".join(w.text(0, p) for p in pieces) + w.finish(0, Finished(record))
        deltas = [json.loads(d)["choices"][0]["delta"] for d in events(stream)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (thought or "")
        assert "".join(d.get("content", "") for d in deltas) == (answer or "")
        assert all(d["content"] for d in deltas if "content" in d)  # no empty content
        assert not any("<" in d.get("reasoning_content", "") for d in deltas)
        assert w.choices == {}


def test_a_reasoning_model_thinks_then_calls_a_tool() -> None:
    text = "<think>The user wants a lookup.</think>" + HERMES_CALL
    body = full_response(
        Endpoint.CHAT, "r3", 7, "demo", outputs([text], [RECORD]), 1, SPELLING, (), AUTO, (), R1
    )
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants a lookup."
    assert choice["message"]["content"] == "Checking."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["lookup"]
    w = ChunkWriter(Endpoint.CHAT, "r4", 5, "demo", SPELLING, AUTO, R1)
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    stream = b"".join(w.text(0, p) for p in pieces) + w.finish(0, Finished(RECORD))
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in events(stream)]
    deltas = [json.loads(d)["choices"][0]["delta"] for d in events(stream)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants a lookup."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert [t.function.name for t in calls if t.function] == ["lookup"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_thinking_not_included_leaves_the_answer_alone_whole_and_streamed() -> None:
    """vLLM's `include_reasoning: false`: no reasoning_content, the thinking dropped."""
    hidden = replace(R1, include=False)
    text = "<think>Two and two.</think>It is 4."
    body = full_response(
        Endpoint.CHAT, "r1", 7, "demo", outputs([text], [RECORD]), 1, SPELLING, reasoning=hidden
    )
    ChatCompletion.model_validate(body)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is 4."}
    w = ChunkWriter(Endpoint.CHAT, "r2", 5, "demo", SPELLING, reasoning=hidden)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    stream = b"".join(w.text(0, p) for p in pieces) + w.finish(0, Finished(RECORD))
    deltas = [json.loads(d)["choices"][0]["delta"] for d in events(stream)]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


def test_usage_reports_the_thinking_tokens_whole_and_streamed() -> None:
    """OpenAI's `completion_tokens_details.reasoning_tokens`, summed over the choices, with a
    reasoning parser (0 is a count); without one, no details at all."""
    text = "<think>Two and two.</think>It is 4."
    thought = [Output(text, (), (), RECORD, None, (), 3), Output(text, (), (), RECORD, None, (), 0)]
    body = full_response(Endpoint.CHAT, "r1", 7, "demo", thought, 2, SPELLING, reasoning=R1)
    assert ChatCompletion.model_validate(body).usage.completion_tokens_details.reasoning_tokens == 3
    plain = full_response(Endpoint.CHAT, "r1", 7, "demo", outputs(["x"], [RECORD]), 1, SPELLING)
    assert "completion_tokens_details" not in plain["usage"]
    w = ChunkWriter(Endpoint.CHAT, "r2", 5, "demo", SPELLING, reasoning=R1)
    ends = [Finished(RECORD, None, 3), Finished(RECORD, None, 0)]
    last = json.loads(events(w.done(ends, 2, include_usage=True))[-2])
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    last = json.loads(events(w.done([Finished(RECORD)], 1, include_usage=True))[-2])
    assert "completion_tokens_details" not in last["usage"]
