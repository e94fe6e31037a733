"""HTTP client and open-loop runner against a small real OpenAI-style SSE server on 127.0.0.1.

The server (http.server in a thread) picks its behavior from the prompt text, so each test
sends one kind of request: a normal stream, refusals (429, 503), a server error, a stream the
server cuts, an endless stream the client must close at output_len, an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from loadgen.clients import HttpClient, Reply, SSEDecoder, slo_body
from loadgen.prompts import Prompt
from loadgen.records import RequestRecord, Verdict
from loadgen.run_load import run_open_loop
from loadgen.workloads import WorkloadRequest
from replica.request import SLO, Stage

pytestmark = pytest.mark.timeout(60)

CHUNK_GAP_S = 0.01


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def text_chunk(text: str) -> bytes:
    return sse({"object": "text_completion", "choices": [{"index": 0, "text": text}]})


FINAL = sse(
    {
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        "service_tier": "default",
        "slos_serve": {"verdict": "admitted", "replica": 1, "hops": 2},
    }
)


def closing(completion_tokens: int) -> bytes:
    """The final chunk, the usage chunk, [DONE]: how slos-serve ends a stream."""
    usage = sse({"choices": [], "usage": {"completion_tokens": completion_tokens}})
    return FINAL + usage + b"data: [DONE]\n\n"


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.received: dict[str, float] = {}
        self.disconnected = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.server.paths.append(self.path)
        mode = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        self.server.received[mode] = time.monotonic()
        if mode in ("429", "503", "500"):
            payload = json.dumps({"error": {"message": f"refused {mode}", "code": int(mode)}})
            self.send_response(int(mode))
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if mode == "headers":
            self.send_header("x-slos-serve-verdict", "best_effort")
            self.send_header("x-slos-serve-replica", "0")
            self.send_header("x-slos-serve-hops", "3")
        self.end_headers()
        try:
            self.stream(mode)
        except (BrokenPipeError, ConnectionResetError):
            self.server.disconnected.set()

    def stream(self, mode: str) -> None:
        def send(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()
            time.sleep(CHUNK_GAP_S)

        if mode in ("ok", "headers"):
            send(b": keep-alive comment\n\n")
            for text in ("a", "b c", "d"):
                send(text_chunk(text))
            send(closing(4))
        elif mode == "short-usage":
            for text in ("a", "b"):
                send(text_chunk(text))
            send(closing(3))
        elif mode == "cut":
            send(text_chunk("a"))
            send(text_chunk("b"))
        elif mode == "endless":
            for _ in range(2000):
                send(text_chunk("x"))
        elif mode == "error-event":
            send(text_chunk("a"))
            send(sse({"error": {"message": "replica lost", "code": 503}}) + b"data: [DONE]\n\n")
        elif mode == "garbage":
            send(text_chunk("a") + b"data: {not json\n\n")
        elif mode == "bogus-verdict":
            send(text_chunk("a") + FINAL.replace(b"admitted", b"maybe") + b"data: [DONE]\n\n")
        elif mode == "slow":
            time.sleep(0.6)
            send(text_chunk("a") + b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def workload_request(
    rid: str, output_len: int = 4, arrival_s: float = 0.0, **extra: Any
) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=rid,
        scenario="chatbot",
        slo_class="loose/loose",
        arrival_s=arrival_s,
        prompt_len=3,
        output_len=output_len,
        max_tokens=50,
        slo=SLO(1000.0, 100.0),
        zero_load_ttft_s=0.1,
        **extra,
    )


def words(text: str) -> int:
    return len(text.split())


def reply(server: Server, mode: str, output_len: int = 4) -> Reply:
    async def go() -> Reply:
        client = HttpClient(server.url, "demo", count_tokens=words, api_key="sk-x")
        start = time.monotonic()
        try:
            return await client.send(
                workload_request(mode, output_len),
                Prompt(mode, (1, 2, 3)),
                lambda: time.monotonic() - start,
            )
        finally:
            await client.aclose()

    return asyncio.run(go())


def send(server: Server, mode: str, output_len: int = 4) -> RequestRecord:
    return reply(server, mode, output_len).record


def test_sse_decoder_joins_data_lines_and_skips_comments() -> None:
    decoder = SSEDecoder()
    lines = [": ping", "event: message", "data: one", "data:two", "", "", "data: [DONE]", ""]
    events = [e for e in map(decoder.feed, lines) if e is not None]
    assert events == ["one\ntwo", "[DONE]"]


def test_stream_gives_token_times_and_the_final_report(server: Server) -> None:
    record = send(server, "ok", output_len=10)
    assert record.delivered == 4
    times = record.token_times_s
    assert times[1] == times[2] and times[0] < times[1] < times[3]
    assert times[0] - record.arrival_s >= CHUNK_GAP_S
    assert (record.verdict, record.replica, record.hops, record.error) == (
        Verdict.ADMITTED,
        "1",
        1,
        None,
    )
    body = server.bodies[-1]
    assert body["max_tokens"] == 50 and body["ignore_eos"] is True and body["stream"] is True
    assert body["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0} and body["model"] == "demo"


def test_the_reply_holds_the_output_text_as_it_came(server: Server) -> None:
    assert reply(server, "ok", output_len=10).text == "ab cd"
    assert reply(server, "endless", output_len=3).text == "xxx"
    assert reply(server, "429").text == ""


def test_a_prompt_of_messages_goes_to_the_chat_endpoint(server: Server) -> None:
    """Messages go as the chat endpoint's `messages`, everything else as for completions."""
    chat = Prompt("<rendered>", (1, 2), (("system", "be brief"), ("user", "ok")))

    async def go() -> Reply:
        client = HttpClient(server.url, "demo", count_tokens=words)
        try:
            return await client.send(workload_request("c", 10), chat, time.monotonic)
        finally:
            await client.aclose()

    got = asyncio.run(go())
    assert server.paths[-1] == "/v1/chat/completions" and got.text == "ab cd"
    body = server.bodies[-1]
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ok"},
    ]
    assert "prompt" not in body and body["max_tokens"] == 50 and body["ignore_eos"] is True
    send(server, "ok")
    assert server.paths[-1] == "/v1/completions" and server.bodies[-1]["prompt"] == "ok"


def test_usage_settles_the_token_count(server: Server) -> None:
    record = send(server, "short-usage", output_len=10)
    assert record.delivered == 3
    assert record.token_times_s[2] == record.token_times_s[1]


def test_client_closes_the_stream_at_output_len(server: Server) -> None:
    server.disconnected.clear()
    started = time.monotonic()
    record = send(server, "endless", output_len=5)
    assert record.delivered == 5 and record.complete
    assert record.verdict is Verdict.UNKNOWN and record.error is None
    assert server.disconnected.wait(5.0)
    assert time.monotonic() - started < 5.0


def test_headers_announce_the_verdict_of_a_closed_stream(server: Server) -> None:
    record = send(server, "headers", output_len=1)
    assert record.delivered == 1
    assert (record.verdict, record.replica, record.hops) == (Verdict.BEST_EFFORT, "0", 2)


@pytest.mark.parametrize("status", ["429", "503"])
def test_refusals_are_rejections_with_the_servers_message(server: Server, status: str) -> None:
    record = send(server, status)
    assert record.verdict is Verdict.REJECTED and record.delivered == 0
    assert record.error == f"HTTP {status}: refused {status}"


def test_server_error_is_unknown_with_the_message(server: Server) -> None:
    record = send(server, "500")
    assert record.verdict is Verdict.UNKNOWN and record.error == "HTTP 500: refused 500"


def test_stream_cut_by_the_server_is_incomplete(server: Server) -> None:
    record = send(server, "cut")
    assert record.delivered == 2 and not record.complete
    assert record.error is not None and "before [DONE]" in record.error


@pytest.mark.parametrize(
    ("mode", "error"),
    [("garbage", "SSE data is not a JSON object: '{not json'"), ("bogus-verdict", "'maybe'")],
)
def test_odd_replies_are_recorded_not_raised(server: Server, mode: str, error: str) -> None:
    record = send(server, mode, output_len=10)
    assert record.delivered == 1 and record.verdict is Verdict.UNKNOWN
    assert record.error is not None and error in record.error


def test_error_event_mid_stream_keeps_the_tokens(server: Server) -> None:
    record = send(server, "error-event")
    assert record.delivered == 1 and record.error == "replica lost"


def test_slo_body_sends_stages_only_when_present() -> None:
    slo = SLO(500.0, 20.0, (Stage(20.0, num_tokens=8, name="thinking"), Stage(40.0)))
    assert slo_body(SLO(500.0, 20.0)) == {"ttft_ms": 500.0, "tpot_ms": 20.0}
    assert slo_body(slo)["stages"] == [
        {"tpot_ms": 20.0, "num_tokens": 8, "name": "thinking"},
        {"tpot_ms": 40.0, "name": ""},
    ]


def test_a_temperature_goes_in_the_body_only_when_given() -> None:
    request = workload_request("r")
    prompt = Prompt("hello", (1,))
    assert "temperature" not in HttpClient("http://127.0.0.1:1", "demo").body(request, prompt)
    greedy = HttpClient("http://127.0.0.1:1", "demo", temperature=0.0)
    assert greedy.body(request, prompt)["temperature"] == 0.0


def test_open_loop_sends_on_time_and_chains_follow_ups(server: Server) -> None:
    """'slow' holds its stream 0.6 s; 'ok' (arrival 0.2 s) must not wait for it. The follow-up
    of 'ok' goes out after 'ok' finished, its prompt made from what 'ok' sent and got; the
    follow-up of a rejected round is not sent, nor one no prompt can be made for, nor what
    follows that."""
    workload = [
        workload_request("slow", output_len=1),
        workload_request("ok", arrival_s=0.2),
        workload_request("ok-next", arrival_s=0.2, follows="ok", delay_s=0.05),
        workload_request("429", arrival_s=0.25),
        workload_request("429-next", arrival_s=0.25, follows="429", delay_s=0.0),
        workload_request("slow-next", follows="slow", delay_s=0.0),
        workload_request("slow-last", follows="slow-next", delay_s=0.0),
    ]
    prompts = {r.request_id: Prompt(r.request_id, (1, 2, 3)) for r in workload if not r.follows}
    seen: list[str] = []
    continued: list[tuple[str, str, str, str]] = []

    def follow_up(
        request: WorkloadRequest, before: WorkloadRequest, prompt: Prompt, output: str
    ) -> Prompt:
        continued.append((request.request_id, before.request_id, prompt.text, output))
        if request.request_id == "slow-next":
            raise ValueError("no room")
        return Prompt("short-usage", (1, 2, 3))

    async def go() -> tuple[list[RequestRecord], float]:
        client = HttpClient(server.url, "demo", count_tokens=words)
        try:
            return await run_open_loop(
                client, workload, prompts, follow_up, lambda r: seen.append(r.request_id)
            )
        finally:
            await client.aclose()

    server.received.clear()
    records, lag = asyncio.run(go())
    by_id = {r.request_id: r for r in records}
    assert [r.request_id for r in records] == [r.request_id for r in workload]
    assert sorted(seen) == sorted(by_id) and lag < 0.1
    received = server.received
    assert 0.15 < received["ok"] - received["slow"] < 0.35
    assert received["short-usage"] > received["ok"] and "429-next" not in received
    assert by_id["ok-next"].arrival_s >= by_id["ok"].token_times_s[-1] + 0.05
    assert by_id["429-next"].verdict is Verdict.REJECTED
    assert by_id["429-next"].error == "not sent: 429 was rejected"
    assert by_id["slow"].delivered == 1
    assert continued == [("ok-next", "ok", "ok", "ab cd"), ("slow-next", "slow", "slow", "a")]
    assert by_id["slow-next"].verdict is Verdict.UNKNOWN
    assert by_id["slow-next"].error == "not sent: no prompt follows slow's: no room"
    assert by_id["slow-last"].error == "not sent: slow-next was not completed"
