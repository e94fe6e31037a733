"""Load-generator clients: one request in, one RequestRecord out, over HTTP, gRPC or in-process.

Every client sends the workload's `max_tokens` with ignore_eos and the request's SLO, stamps the
arrival when it sends, stamps each token when it reaches the client (on the run's clock), and
closes the stream once `output_len` tokens arrived (unless output_len is max_tokens: then the
server ends it): the request ends there as if the model had emitted EOS, and closing makes the
server abort it and free its memory.

`send` returns a Reply: the record, and the output's text as it arrived (the SSE chunks' text,
the gRPC chunks' text, the in-process token ids decoded), which a session's next round sends
back as its history (loadgen.run_load).

What the server decided (verdict, replica, hops) is announced up front, with the first token:
slos-serve's HTTP headers `x-slos-serve-verdict`, `-replica`, `-hops`, the same keys as gRPC
initial metadata (the SDK's first `Chunk.placement`), the first in-process `TokenChunk`'s
placement. The final report (the last SSE chunk's `slos_serve` object, the `Result`, the
`FinalRecord`) then settles it. A server that announces nothing (another OpenAI server) leaves
a stream the client closed at output_len `unknown`. Refusals are known at once: HTTP 429/503,
gRPC RESOURCE_EXHAUSTED / UNAVAILABLE and the cluster's rejected FinalRecord become `rejected`
with the server's message.

HTTP token counting. OpenAI SSE chunks carry text, not token ids, so the HTTP client counts
each chunk's tokens by re-encoding its text with the model's tokenizer (`count_tokens`; without
one, a chunk is one token, as in vLLM's benchmark) and, when the stream ends with a `usage`
block, settles the total on the server's count: missing tokens are stamped at the last chunk,
extra ones dropped from the end. gRPC and in-process chunks carry token ids: exact counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar, cast

import grpc
import httpx

from cluster.api import ClusterUnavailable, FinalRecord, TokenChunk
from loadgen.prompts import Prompt
from loadgen.records import RequestRecord, Verdict
from loadgen.workloads import WorkloadRequest
from replica.request import SLO, Request
from router.client import AsyncClient, Chunk, ClientError, Result
from router.wire import HEADER_HOPS, HEADER_REPLICA, HEADER_VERDICT

Clock = Callable[[], float]
"""Seconds on the run's clock (monotonic, 0 at the run's start)."""
TokenCounter = Callable[[str], int]
"""Tokens in a piece of output text."""
REJECT_STATUS = (429, 503)
REJECT_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
DEFAULT_TIMEOUT_S = 120.0
T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    """What one request got: its record, and its output as text (what a session's next round
    sends back)."""

    record: RequestRecord
    text: str


class LoadClient(Protocol):
    """What the open-loop runner needs from a client."""

    async def send(self, request: WorkloadRequest, prompt: Prompt, clock: Clock) -> Reply: ...

    async def aclose(self) -> None: ...


@dataclass
class Outcome:
    """What one client saw of one request, turned into a RequestRecord at the end."""

    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)
    verdict: Verdict = Verdict.UNKNOWN
    replica: str | None = None
    server_hops: int | None = None
    """Replicas the server tried, the final one included (the cluster's count)."""
    error: str | None = None
    text: list[str] = field(default_factory=list)
    """The output's text as it came (HTTP's and gRPC's chunks carry it)."""
    token_ids: list[int] = field(default_factory=list)
    """The output's token ids as they came (gRPC's and in-process chunks carry them; the
    in-process client decodes them)."""

    def add_tokens(self, count: int, at: float) -> None:
        self.token_times_s.extend([at] * count)

    def report(self, verdict: object, replica: object, hops: object) -> None:
        """The server's report (final chunk, Result, FinalRecord or headers); a verdict this
        client cannot take is kept as the error, not raised, so one odd reply ends no run."""
        known = {v.value for v in Verdict} - {Verdict.REJECTED.value}
        if verdict not in known:
            self.error = f"server reported verdict {verdict!r}"
            return
        self.verdict = Verdict(str(verdict))
        self.replica = None if replica is None else str(replica)
        if isinstance(hops, int) and not isinstance(hops, bool):
            self.server_hops = hops

    def should_close(self, request: WorkloadRequest) -> bool:
        """output_len tokens arrived and the server would go on (at max_tokens it stops by
        itself, and reading on gets its final report)."""
        return request.output_len <= len(self.token_times_s) and (
            request.output_len < request.max_tokens
        )

    def reject(self, message: str) -> None:
        self.verdict = Verdict.REJECTED
        self.error = message
        self.token_times_s.clear()

    def record(self, request: WorkloadRequest) -> RequestRecord:
        return RequestRecord.for_request(
            request,
            verdict=self.verdict,
            token_times_s=self.token_times_s,
            arrival_s=self.arrival_s,
            replica=self.replica,
            hops=max(0, (self.server_hops or 1) - 1),
            error=self.error,
        )


async def _bounded(outcome: Outcome, timeout_s: float, body: Awaitable[None]) -> None:
    """Await a request's coroutine with a deadline; a timeout is recorded, not raised."""
    try:
        async with asyncio.timeout(timeout_s):
            await body
    except TimeoutError:
        outcome.error = f"timed out after {timeout_s:g} s"


def _positive_timeout(timeout_s: float) -> float:
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
    return timeout_s


def slo_body(slo: SLO) -> dict[str, Any]:
    """The `slo` body field of slos-serve's OpenAI schema (stages only when there are any)."""
    body: dict[str, Any] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
    if slo.stages:
        body["stages"] = [
            {
                k: v
                for k, v in (
                    ("tpot_ms", s.tpot_ms),
                    ("num_tokens", s.num_tokens),
                    ("ttft_ms", s.ttft_ms),
                    ("name", s.name),
                    ("end_token_ids", list(s.end_token_ids) or None),
                )
                if v is not None
            }
            for s in slo.stages
        ]
    return body


class SSEDecoder:
    """Server-sent events from lines: each event's data lines joined with newlines.

    Comment lines (':') and fields other than data are skipped; a blank line ends an event.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The event's data when `line` completes one, else None."""
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


def _error_message(text: str) -> str:
    """The OpenAI error JSON's message, else the raw body (shortened)."""
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return text[:500]


def _one_token_per_chunk(text: str) -> int:
    return 1


class HttpClient:
    """Any OpenAI-compatible server's streamed /v1/completions, or /v1/chat/completions for a
    prompt made of messages (slos-serve, vLLM, Ray Serve LLM).

    `send_slo=False` leaves out the `slo` body field, for servers that refuse unknown fields.
    `temperature` None sends none: the server's default (the API's is 1).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        count_tokens: TokenCounter | None = None,
        send_slo: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        temperature: float | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"target must be an http:// or https:// URL, got {base_url!r}")
        if not model:
            raise ValueError("model must be a non-empty string")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.count_tokens = count_tokens or _one_token_per_chunk
        self.send_slo = send_slo
        self.timeout_s = _positive_timeout(timeout_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    def url(self, prompt: Prompt) -> str:
        """/v1/chat/completions for a prompt made of messages, else /v1/completions."""
        return self.base_url + ("/v1/chat/completions" if prompt.messages else "/v1/completions")

    def body(self, request: WorkloadRequest, prompt: Prompt) -> dict[str, Any]:
        text: dict[str, Any] = (
            {"messages": [{"role": role, "content": content} for role, content in prompt.messages]}
            if prompt.messages
            else {"prompt": prompt.text}
        )
        body: dict[str, Any] = {
            "model": self.model,
            **text,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.send_slo:
            body["slo"] = slo_body(request.judged_slo)  # the demo model never ends a stage
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    async def send(self, request: WorkloadRequest, prompt: Prompt, clock: Clock) -> Reply:
        body = self.body(request, prompt)
        outcome = Outcome(clock())
        stream = self._stream(self.url(prompt), body, request, outcome, clock)
        try:
            await _bounded(outcome, self.timeout_s, stream)
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        return Reply(outcome.record(request), "".join(outcome.text))

    async def _stream(
        self,
        url: str,
        body: dict[str, Any],
        request: WorkloadRequest,
        outcome: Outcome,
        clock: Clock,
    ) -> None:
        async with self.http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                message = _error_message((await response.aread()).decode(errors="replace"))
                text = f"HTTP {response.status_code}: {message}"
                if response.status_code in REJECT_STATUS:
                    outcome.reject(text)
                else:
                    outcome.error = text
                return
            verdict = response.headers.get(HEADER_VERDICT)
            if verdict is not None:
                hops = response.headers.get(HEADER_HOPS, "")
                outcome.report(
                    verdict,
                    response.headers.get(HEADER_REPLICA),
                    int(hops) if hops.isdigit() else None,
                )
            await self._read_events(response.aiter_lines(), request, outcome, clock)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _read_events(
        self,
        lines: AsyncIterator[str],
        request: WorkloadRequest,
        outcome: Outcome,
        clock: Clock,
    ) -> None:
        decoder = SSEDecoder()
        usage: int | None = None
        async for line in lines:
            data = decoder.feed(line)
            if data is None:
                continue
            if data == "[DONE]":
                if isinstance(usage, int):
                    _settle(outcome.token_times_s, usage)
                return
            now = clock()
            try:
                chunk = json.loads(data)
            except ValueError:
                chunk = None
            if not isinstance(chunk, dict):
                outcome.error = f"SSE data is not a JSON object: {data[:200]!r}"
                return
            if "error" in chunk:
                outcome.error = _error_message(data)
                return
            text = "".join(_choice_text(c) for c in chunk.get("choices") or ())
            if text:
                outcome.add_tokens(max(1, self.count_tokens(text)), now)
                outcome.text.append(text)
            info = chunk.get("slos_serve")
            if isinstance(info, dict) and "verdict" in info:
                outcome.report(info["verdict"], info.get("replica"), info.get("hops"))
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"].get("completion_tokens")
            if outcome.should_close(request):
                return
        outcome.error = f"stream ended before [DONE] after {len(outcome.token_times_s)} tokens"


def _choice_text(choice: object) -> str:
    """A completions choice's text, or a chat chunk's delta content ("" for anything else)."""
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")
    delta = choice.get("delta")
    if text is None and isinstance(delta, dict):
        text = delta.get("content")
    return text if isinstance(text, str) else ""


def _settle(times: list[float], total: int) -> None:
    """Make the count the server's: stamp missing tokens at the last chunk, drop extras."""
    if len(times) > total:
        del times[total:]
    elif times and len(times) < total:
        times.extend([times[-1]] * (total - len(times)))


async def _read_chunks(
    stream: AsyncIterator[T],
    final: Callable[[T], bool],
    request: WorkloadRequest,
    outcome: Outcome,
    clock: Clock,
) -> None:
    """Chunks of token ids until the final report or the time to close. `final` sees every
    item first (to take a placement or the report) and says whether it was the final one.
    Leaving early closes the stream, which cancels the call or aborts the request."""
    async with aclosing(cast(AsyncGenerator[T, None], stream)):
        async for item in stream:
            if final(item):
                return
            token_ids = getattr(item, "token_ids", ())
            if token_ids:
                outcome.add_tokens(len(token_ids), clock())
                outcome.token_ids.extend(token_ids)
                outcome.text.append(getattr(item, "text", ""))
            if outcome.should_close(request):
                return


class GrpcClient:
    """slos-serve's gRPC door through the async SDK (router.client.AsyncClient); `temperature`
    None sends none (the server's default)."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        model: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        temperature: float | None = None,
    ) -> None:
        self.timeout_s = _positive_timeout(timeout_s)
        self.model = model
        self.temperature = temperature
        self.sdk = AsyncClient(target, api_key=api_key, timeout_s=timeout_s)

    async def send(self, request: WorkloadRequest, prompt: Prompt, clock: Clock) -> Reply:
        outcome = Outcome(clock())
        try:
            await _bounded(outcome, self.timeout_s, self._stream(request, prompt, outcome, clock))
        except ClientError as exc:
            text = f"{exc.code.name}: {exc.details}"
            if exc.code in REJECT_CODES and not outcome.token_times_s:
                outcome.reject(text)
            else:
                outcome.error = text
        return Reply(outcome.record(request), "".join(outcome.text))

    async def _stream(
        self, request: WorkloadRequest, prompt: Prompt, outcome: Outcome, clock: Clock
    ) -> None:
        stream = self.sdk.generate(
            None if prompt.messages else prompt.text,
            messages=prompt.messages or None,
            max_tokens=request.max_tokens,
            slo=request.judged_slo,
            ignore_eos=True,
            model=self.model,
            temperature=self.temperature,
        )

        def final(item: Chunk | Result) -> bool:
            if isinstance(item, Result):
                outcome.report(item.verdict, item.replica, item.hops)
            elif item.placement is not None:
                p = item.placement
                outcome.report(p.verdict.value, p.replica, p.hops)
            return isinstance(item, Result)

        await _read_chunks(stream, final, request, outcome, clock)

    async def aclose(self) -> None:
        await self.sdk.close()


class Submits(Protocol):
    """The part of cluster.ClusterHandle the in-process client uses."""

    def submit(self, request: Request) -> AsyncIterator[TokenChunk | FinalRecord]: ...


class InProcessClient:
    """A cluster handle (cluster.ClusterHandle) in this process, on the loop that launched it.

    Request ids get a per-client suffix, so repeated runs never reuse an id the cluster saw.
    The cluster speaks token ids; `decode` turns an output into text (the model's tokenizer).
    """

    def __init__(
        self,
        handle: Submits,
        decode: Callable[[list[int]], str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.handle = handle
        self.decode = decode
        self.timeout_s = _positive_timeout(timeout_s)
        self.tag = uuid.uuid4().hex[:8]

    async def send(self, request: WorkloadRequest, prompt: Prompt, clock: Clock) -> Reply:
        outcome = Outcome(clock())
        cluster_request = replace(
            request.to_request(prompt.token_ids, arrival_time=time.time()),
            request_id=f"{request.request_id}@{self.tag}",
        )
        try:
            await _bounded(
                outcome,
                self.timeout_s,
                self._stream(cluster_request, request, outcome, clock),
            )
        except ClusterUnavailable as exc:
            outcome.reject(f"unavailable: {exc}")
        except ValueError as exc:
            outcome.error = f"invalid request: {exc}"
        return Reply(outcome.record(request), self.decode(outcome.token_ids))

    async def _stream(
        self, cluster_request: Request, request: WorkloadRequest, outcome: Outcome, clock: Clock
    ) -> None:
        def final(item: TokenChunk | FinalRecord) -> bool:
            if not isinstance(item, FinalRecord):
                if item.placement is not None:
                    p = item.placement
                    outcome.report(p.verdict.value, p.replica, p.hops)
                return False
            if item.verdict.value == Verdict.REJECTED.value:
                outcome.reject(item.reason or "rejected")
            else:
                outcome.report(item.verdict.value, item.replica, item.hops)
            return True

        await _read_chunks(self.handle.submit(cluster_request), final, request, outcome, clock)

    async def aclose(self) -> None:
        """The handle belongs to whoever launched it; nothing to close here."""
