"""What both doors (HTTP and gRPC) do with a request, independent of the wire.

Authenticate, parse, submit to the cluster, wait for the cluster's first answer (so a rejection
or an empty cluster becomes a clean 429 / 503 before any byte of a stream is sent), then turn
token ids into text deltas and count the outcome once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cluster.api import (
    ClusterStatus,
    ClusterUnavailable,
    FinalRecord,
    Placement,
    TokenChunk,
    Verdict,
    stage_verdicts,
)
from replica.batch import TokenLogprob
from replica.request import Request
from router.auth import UNKNOWN_TENANT, ApiKeys
from router.errors import (
    BadRequest,
    InternalError,
    ModelNotFound,
    Rejected,
    Unauthorized,
    Unavailable,
)
from router.metrics import FrontDoorMetrics
from router.openai_schema import Endpoint, ParsedRequest, SchemaContext, parse_body
from router.reasoning import ReasoningParser
from router.stops import OutputText
from router.tokenizer import TextCodec

log = logging.getLogger(__name__)


class ClusterLike(Protocol):
    """The part of `cluster.ClusterHandle` the front door uses."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def submit(self, request: Request) -> AsyncIterator[TokenChunk | FinalRecord]: ...

    async def status(self) -> ClusterStatus: ...

    def abort(self, request_id: str) -> None: ...

    async def metrics_snapshot(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """With the first tokens, when asked for: one per prompt token after the first."""


@dataclass(frozen=True)
class Finished:
    record: FinalRecord
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the output (vLLM's stop_reason)."""
    reasoning_tokens: int | None = None
    """Of the output, the thinking's tokens (`ReasoningParser.thinking_tokens`); None when
    the request has no reasoning parser."""


@dataclass(frozen=True)
class Output:
    """A finished choice: its text, its tokens with their log-probabilities (when asked for),
    and what the cluster did with it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    record: FinalRecord
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    reasoning_tokens: int | None = None


class Generation:
    """One accepted request's output: `TextDelta`s, then exactly one `Finished`.

    Closing it before the end (client gone, deadline) aborts the request in the cluster.
    A `prompt_only` choice (echo with max_tokens 0) yields its prompt's log-probabilities
    and no output: the token the cluster drew to score the prompt is dropped, and the output
    ends before it (no tokens, late or not, in the stages either; finish reason length). The
    SLO's verdict stays: it judged when the prompt's scores came.
    """

    def __init__(
        self,
        door: FrontDoor,
        request: Request,
        slo_label: str,
        tenant: str,
        first: TokenChunk | FinalRecord,
        rest: AsyncIterator[TokenChunk | FinalRecord],
        prompt_only: bool = False,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.prompt_only = prompt_only
        self.reasoning = reasoning
        self.door = door
        self.request = request
        self.slo_label = slo_label
        self.tenant = tenant
        self.first = first
        self.rest = rest
        self.text = OutputText(door.codec.detokenizer(), request.sampling)
        self.finished = False
        self.token_ids: list[int] = []
        self.times: list[float] = []
        """The output tokens the client was given, and when each came."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def placement(self) -> Placement | None:
        """Where the cluster bound the request, known from its first item (sent to the
        client with the first token: headers, initial metadata)."""
        first = self.first
        if isinstance(first, TokenChunk):
            return first.placement
        if first.replica is None:
            return None
        return Placement(first.verdict, first.replica, first.hops)

    async def events(self) -> AsyncIterator[TextDelta | Finished]:
        item: TokenChunk | FinalRecord | None = self.first
        while item is not None:
            if isinstance(item, FinalRecord):
                tail = "" if self.prompt_only else self.text.flush()
                if tail:
                    yield TextDelta(tail, ())
                self.finished = True
                if self.prompt_only:
                    stages = tuple(replace(s, tokens=0, late_tokens=0) for s in item.stages)
                    item = replace(item, num_output_tokens=0, finish_reason="length", stages=stages)
                self.door.metrics.record_final(item, self.slo_label, self.tenant)
                stopped = item.finish_reason == "stop"
                yield Finished(item, self.text.stop_reason if stopped else None, self._thought())
                return
            self.door.metrics.record_tokens(
                self.slo_label, self.times[-1] if self.times else None, item.times
            )
            self.token_ids.extend(item.token_ids)
            self.times.extend(item.times)
            if self.prompt_only:
                yield TextDelta("", (), (), item.prompt_logprobs)
            else:
                text = self.text.push(item.token_ids)
                yield TextDelta(text, item.token_ids, item.logprobs, item.prompt_logprobs)
            try:
                item = await anext(self.rest, None)
            except ClusterUnavailable as exc:
                self._lose()
                raise Unavailable(str(exc) or "the request's replica was lost") from exc
            except Exception as exc:  # a fault of ours: the stream ends saying so, not silently
                log.exception("request %s failed", self.request_id)
                self._lose()
                raise InternalError.of(exc) from exc
        self._lose()
        raise InternalError(f"the cluster's stream of {self.request_id} ended without a result")

    def _thought(self) -> int | None:
        if self.reasoning is None:
            return None
        codec = self.door.codec
        return self.reasoning.thinking_tokens([codec.token_bytes(t) for t in self.token_ids])

    def _lose(self) -> None:
        """Count the request cut off by the server, not by its client."""
        self.finished = True
        cut = self._unfinished(math.inf)
        self.door.metrics.record_lost(cut, self.slo_label, self.tenant)

    async def collect(self) -> Output:
        """The whole output (for non-streamed responses)."""
        parts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] = []
        finished: Finished | None = None
        try:
            async for event in self.events():
                if isinstance(event, Finished):
                    finished = event
                else:
                    parts.append(event.text)
                    token_ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                    prompt_logprobs.extend(event.prompt_logprobs)
        finally:
            self.close()
        assert finished is not None  # events() ends with it or raises
        return Output(
            "".join(parts),
            tuple(token_ids),
            tuple(logprobs),
            finished.record,
            finished.stop_reason,
            tuple(prompt_logprobs),
            finished.reasoning_tokens,
        )

    def close(self, lost: bool = False) -> None:
        """Abort the request in the cluster unless it already finished: its client left, or
        (`lost`) the door gave it up, another choice of the request having failed."""
        if not self.finished:
            self.finished = True
            left = self._unfinished(self.door.clock())
            if lost:
                self.door.metrics.record_lost(left, self.slo_label, self.tenant)
            elif left is not None:
                self.door.metrics.record_cancelled(left, self.slo_label, self.tenant)
            self.door.cluster.abort(self.request_id)

    def _unfinished(self, cut_at: float) -> FinalRecord | None:
        """What the client got of a request that will not finish, its stages judged as at
        `cut_at` (`stage_verdicts`) once it was given a token (not a choice the door closes
        itself, its first chunk unread); None before the cluster's first answer."""
        placement = self.placement
        if placement is None:
            return None
        request = self.request
        return FinalRecord(
            request.request_id,
            placement.verdict,
            placement.replica,
            placement.hops,
            arrival_time=request.arrival_time,
            first_token_time=self.times[0] if self.times else None,
            num_prompt_tokens=request.prompt_len,
            num_output_tokens=0 if self.prompt_only else len(self.token_ids),
            stages=stage_verdicts(request, self.token_ids, self.times, cut_at)
            if self.times
            else (),
        )


async def interleaved(
    generations: Sequence[Generation],
) -> AsyncGenerator[tuple[int, TextDelta | Finished]]:
    """The events of several generations as each comes, tagged with the generation's index.
    An error in one ends the whole (the caller closes the others)."""
    streams = [g.events() for g in generations]
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, event
    finally:
        for future in pending:
            future.cancel()


class FrontDoor:
    """The shared request path behind the HTTP and gRPC servers."""

    def __init__(
        self,
        cluster: ClusterLike,
        codec: TextCodec,
        schema: SchemaContext,
        keys: ApiKeys,
        metrics: FrontDoorMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cluster = cluster
        self.codec = codec
        self.schema = schema
        self.keys = keys
        self.metrics = metrics
        self.clock = clock

    @property
    def model_name(self) -> str:
        return self.schema.model_name

    def authenticate(self, authorization: str | None) -> str:
        try:
            return self.keys.authenticate(authorization)
        except Unauthorized:
            self.metrics.reject(UNKNOWN_TENANT, "unauthorized")
            raise

    def parse(
        self, endpoint: Endpoint, body: object, headers: Mapping[str, str], tenant: str
    ) -> ParsedRequest:
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        try:
            return parse_body(
                endpoint,
                body,
                headers,
                self.schema,
                self.codec,
                request_id=f"{prefix}-{uuid.uuid4().hex}",
                arrival_time=self.clock(),
            )
        except BadRequest:
            self.metrics.reject(tenant, "bad_request")
            raise
        except ModelNotFound:
            self.metrics.reject(tenant, "not_found")
            raise

    async def start(self, parsed: ParsedRequest, tenant: str) -> tuple[Generation, ...]:
        """Submit every choice and wait for each one's first item: a token, or a rejection.

        All or nothing: if one choice is rejected or cannot be placed, the others are
        aborted once they have answered (an admitted choice's first token comes within its
        TTFT) and the request fails as that choice did."""
        only = [echo.prompt_only for echo in parsed.echo] or [False] * len(parsed.requests)
        if len(parsed.requests) == 1:
            try:
                one = await self._start_one(parsed.requests[0], parsed, tenant, only[0])
            except asyncio.CancelledError:  # the client left before the cluster answered
                self.metrics.record_cancelled(None, parsed.slo_label, tenant)
                raise
            return (one,)
        tasks = [
            asyncio.create_task(self._start_one(r, parsed, tenant, prompt_only))
            for r, prompt_only in zip(parsed.requests, only, strict=True)
        ]
        try:  # every choice's first answer, so that each one's verdict is counted
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client left: gather cancelled the choices
            await asyncio.wait(tasks)  # still starting; close those that started
            for task in tasks:  # each choice counted once: unanswered, or by its close
                if task.cancelled():
                    self.metrics.record_cancelled(None, parsed.slo_label, tenant)
                elif task.exception() is None:
                    task.result().close()
            raise
        started = tuple(o for o in outcomes if isinstance(o, Generation))
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            for generation in started:
                generation.close(lost=True)
            raise failure
        return started

    async def _start_one(
        self, request: Request, parsed: ParsedRequest, tenant: str, prompt_only: bool
    ) -> Generation:
        stream = self.cluster.submit(request)
        try:
            first = await anext(stream)
        except ClusterUnavailable as exc:
            self.metrics.reject(tenant, "unavailable")
            raise Unavailable(
                str(exc) or "no replica is up", retry_after_s=exc.retry_after_s
            ) from exc
        except ValueError as exc:  # the cluster's own checks: what a replica's KV cache holds
            self.metrics.reject(tenant, "bad_request")
            raise BadRequest(str(exc), "max_tokens") from exc
        except StopAsyncIteration as exc:
            raise RuntimeError(f"cluster stream of {request.request_id} was empty") from exc
        except asyncio.CancelledError:  # the client left; start counts it (and choices never run)
            self.cluster.abort(request.request_id)
            raise
        if isinstance(first, FinalRecord) and first.verdict is Verdict.REJECTED:
            self.metrics.record_final(first, parsed.slo_label, tenant)
            raise Rejected(
                first.reason or "rejected by the backup policy", None, first.retry_after_s
            )
        return Generation(
            self, request, parsed.slo_label, tenant, first, stream, prompt_only, parsed.reasoning
        )

    async def status(self) -> ClusterStatus:
        try:
            return await self.cluster.status()
        except ClusterUnavailable as exc:
            raise Unavailable(str(exc) or "the cluster does not answer") from exc

    async def metrics_text(self) -> bytes:
        """Prometheus exposition, with the cluster snapshot taken now."""
        try:
            status = await self.cluster.status()
            snapshot = await self.cluster.metrics_snapshot()
        except ClusterUnavailable:
            self.metrics.refresh(None, {})
        else:
            self.metrics.refresh(status, snapshot)
        return self.metrics.exposition()
