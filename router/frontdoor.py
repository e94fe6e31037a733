"""What both doors (HTTP and gRPC) do with a request, independent of the wire.

Authenticate, parse, submit to the cluster, wait for the cluster's first answer (so a rejection
or an empty cluster becomes a clean 429 / 503 before any byte of a stream is sent), then turn
token ids into text deltas and count the outcome once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.api import (
    ClusterStatus,
    ClusterUnavailable,
    FinalRecord,
    Placement,
    TokenChunk,
    Verdict,
)
from replica.request import Request
from router.auth import ApiKeys
from router.errors import BadRequest, ModelNotFound, Rejected, Unauthorized, Unavailable
from router.metrics import FrontDoorMetrics
from router.openai_schema import Endpoint, ParsedRequest, SchemaContext, parse_body
from router.stops import StopText
from router.tokenizer import IncrementalDetokenizer, TextCodec


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


@dataclass(frozen=True)
class Finished:
    record: FinalRecord


class Generation:
    """One accepted request's output: `TextDelta`s, then exactly one `Finished`.

    Closing it before the end (client gone, deadline) aborts the request in the cluster.
    """

    def __init__(
        self,
        door: FrontDoor,
        parsed: ParsedRequest,
        tenant: str,
        first: TokenChunk | FinalRecord,
        rest: AsyncIterator[TokenChunk | FinalRecord],
    ) -> None:
        self.door = door
        self.parsed = parsed
        self.tenant = tenant
        self.first = first
        self.rest = rest
        self.detokenizer: IncrementalDetokenizer = door.codec.detokenizer()
        self.stop_text = StopText(parsed.request.sampling.stop)
        self.finished = False
        self.last_token_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.parsed.request.request_id

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
                tail = self.stop_text.push(self.detokenizer.flush()) + self.stop_text.flush()
                if tail:
                    yield TextDelta(tail, ())
                self.finished = True
                self.door.metrics.record_final(item, self.parsed.slo_label, self.tenant)
                yield Finished(item)
                return
            self.last_token_time = self.door.metrics.record_tokens(
                self.parsed.slo_label, self.last_token_time, item.times
            )
            text = self.stop_text.push(self.detokenizer.push(item.token_ids))
            yield TextDelta(text, item.token_ids)
            try:
                item = await anext(self.rest, None)
            except ClusterUnavailable as exc:
                self.finished = True
                raise Unavailable(str(exc) or "the request's replica was lost") from exc
        raise RuntimeError(f"cluster stream of {self.request_id} ended without a FinalRecord")

    async def collect(self) -> tuple[str, FinalRecord]:
        """The whole output text and the final record (for non-streamed responses)."""
        parts: list[str] = []
        record: FinalRecord | None = None
        try:
            async for event in self.events():
                if isinstance(event, Finished):
                    record = event.record
                else:
                    parts.append(event.text)
        finally:
            self.close()
        if record is None:
            raise RuntimeError(f"cluster stream of {self.request_id} ended without a FinalRecord")
        return "".join(parts), record

    def close(self) -> None:
        """Abort the request in the cluster unless it already finished."""
        if not self.finished:
            self.finished = True
            placement = self.placement
            if placement is not None:
                self.door.metrics.record_cancelled(placement.verdict, self.tenant)
            self.door.cluster.abort(self.request_id)


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
            self.metrics.reject("unknown", "unauthorized")
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

    async def start(self, parsed: ParsedRequest, tenant: str) -> Generation:
        """Submit and wait for the cluster's first item: a token, or a rejection."""
        stream = self.cluster.submit(parsed.request)
        try:
            first = await anext(stream)
        except ClusterUnavailable as exc:
            self.metrics.reject(tenant, "unavailable")
            raise Unavailable(str(exc) or "no replica is up") from exc
        except StopAsyncIteration as exc:
            raise RuntimeError(f"cluster stream of {parsed.request.request_id} was empty") from exc
        except asyncio.CancelledError:
            self.cluster.abort(parsed.request.request_id)
            raise
        if isinstance(first, FinalRecord) and first.verdict is Verdict.REJECTED:
            self.metrics.record_final(first, parsed.slo_label, tenant)
            raise Rejected(
                first.reason or "rejected by the backup policy", None, first.retry_after_s
            )
        return Generation(self, parsed, tenant, first, stream)

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
