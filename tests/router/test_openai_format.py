"""SSE framing and OpenAI chunk shapes, parsed back the way a client reads them."""

from __future__ import annotations

import json

from cluster.api import FinalRecord, StageVerdict, Verdict
from router.errors import Rejected
from router.openai_format import ChunkWriter, cluster_headers, error_body, full_response, sse_event
from router.openai_schema import Endpoint

RECORD = FinalRecord(
    request_id="r",
    verdict=Verdict.BEST_EFFORT,
    replica=1,
    hops=2,
    finish_reason="stop",
    num_prompt_tokens=3,
    num_output_tokens=2,
    stages=(StageVerdict("default", False, 1),),
)


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
    w = ChunkWriter(Endpoint.CHAT, "id1", 5, "demo")
    stream = w.text("Hel") + w.text("lo") + w.finish(RECORD, include_usage=True)
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
    assert chunks[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_completion_stream_without_usage() -> None:
    w = ChunkWriter(Endpoint.COMPLETIONS, "id2", 5, "demo")
    data = events(w.text("x") + w.finish(RECORD, include_usage=False))
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["x", ""]
    assert data[-1] == "[DONE]"


def test_full_response_and_headers() -> None:
    body = full_response(Endpoint.CHAT, "id3", 7, "demo", "hi", RECORD)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["slos_serve"]["slo_attained"] is False
    assert body["slos_serve"]["stages"] == [
        {"name": "default", "attained": False, "late_tokens": 1}
    ]
    headers = cluster_headers(RECORD)
    assert headers["x-slos-serve-verdict"] == "best_effort"
    assert headers["x-slos-serve-replica"] == "1"
    assert headers["x-slos-serve-slo-attained"] == "false"


def test_error_json_shape() -> None:
    body = error_body(Rejected("full", None, 2.0))
    assert body == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": 429}
    }
    w = ChunkWriter(Endpoint.CHAT, "id4", 5, "demo")
    data = events(w.error(Rejected("gone", None, 1.0)))
    assert json.loads(data[0])["error"]["message"] == "gone" and data[1] == "[DONE]"
