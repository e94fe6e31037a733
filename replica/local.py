"""One replica in one process: a scheduler, an engine and a token stream per request.

The step loop owns the engine. New requests and aborts reach the engine and the scheduler only
between steps, on the event loop; the step itself runs in a worker thread, so the loop keeps
streaming tokens and accepting requests while the model computes. Time comes from an injected
clock (wall clock by default): the scheduler sees it as `now`, the streams as token times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from replica.batch import BatchOutcome, BatchPlan, FinishReason
from replica.engine import Engine
from replica.planner.base import CacheBudget, Scheduler
from replica.request import Request

Clock = Callable[[], float]


def cache_budget(engine: Engine) -> CacheBudget:
    """The budget a scheduler must plan within to match this engine's KV pool."""
    return CacheBudget(engine.cache.num_blocks, engine.cache.block_size)


@dataclass(frozen=True)
class RequestTimings:
    """When a request arrived and when each of its tokens came out (replica clock)."""

    arrival_time: float
    token_times: tuple[float, ...]
    finish_time: float

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.arrival_time


@dataclass(frozen=True)
class TokenChunk:
    """Tokens one step produced for a request; the last chunk carries the finish record."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Stream:
    request: Request
    queue: asyncio.Queue[TokenChunk | Exception] = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)
    closed: bool = False


class LocalReplica:
    """Serves concurrent `generate` calls from one engine under one scheduler.

    The scheduler must be built on `cache_budget(engine)` and hold no requests; both belong
    to the replica from `start()` to `stop()`.
    """

    def __init__(self, engine: Engine, scheduler: Scheduler, *, clock: Clock = time.monotonic):
        self.engine = engine
        self.scheduler = scheduler
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        self._pending: list[str] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the replica is already started")
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="local-replica-steps")

    async def stop(self) -> None:
        """Finish the step in flight, then end every open stream as aborted."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        task, self._task = self._task, None
        await task
        for request_id in list(self._streams):
            self._release(request_id)
            self._close(request_id, FinishReason.ABORT)

    async def generate(self, request: Request) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens as they are produced, then a finished chunk.

        The replica serves a copy stamped with its own arrival time. A request the engine or
        scheduler refuses raises its ValueError here and nowhere else. Leaving the iteration
        early aborts the request and frees its KV.
        """
        if self._task is None:
            raise RuntimeError("the replica is not started")
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already being served")
        stream = _Stream(replace(request, arrival_time=self._clock()))
        self._streams[request_id] = stream
        self._pending.append(request_id)
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.closed:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request (client gone): its stream closes as aborted, its KV is freed before
        the next step. Unknown or finished requests are ignored."""
        if request_id in self._streams and request_id not in self._aborts:
            self._aborts.append(request_id)
            self._wake.set()

    async def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._admit_pending()
                self._apply_aborts()
                plan = self.scheduler.schedule(self._clock())
                if plan is None:
                    await self._wake.wait()
                    continue
                await self._step(plan)
        except Exception as exc:
            for request_id in list(self._streams):
                self._close(request_id, exc)
            raise

    async def _step(self, plan: BatchPlan) -> None:
        try:
            outcome = await asyncio.to_thread(self.engine.step, plan)
        except Exception as exc:
            # A failed step ends the requests it touched (their KV state is unknown), not the
            # replica: the others keep being served.
            for request_id in [*(e.request_id for e in plan.entries), *plan.preempt]:
                self.scheduler.abort_request(request_id)
                self._release(request_id)
                self._close(request_id, exc)
            return
        now = self._clock()
        self.scheduler.update_from_outcome(plan, outcome, now)
        self._deliver(outcome, now)

    def _admit_pending(self) -> None:
        now = self._clock()
        pending, self._pending = self._pending, []
        for request_id in pending:
            request = self._streams[request_id].request
            try:
                self.engine.add_request(request)
            except ValueError as exc:
                self._close(request_id, exc)
                continue
            try:
                self.scheduler.add_request(request, now)
            except ValueError as exc:
                self.engine.abort(request_id)
                self._close(request_id, exc)

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            if request_id in self._streams:
                self.scheduler.abort_request(request_id)
                self._release(request_id)
                self._close(request_id, FinishReason.ABORT)

    def _deliver(self, outcome: BatchOutcome, now: float) -> None:
        for result in outcome.outcomes:
            stream = self._streams.get(result.request_id)
            if stream is None:
                continue
            tokens = tuple(result.new_token_ids)
            stream.token_times.extend([now] * len(tokens))
            if result.finish_reason is not None:
                self._release(result.request_id)
                self._close(result.request_id, result.finish_reason, tokens)
            elif tokens:
                stream.queue.put_nowait(TokenChunk(result.request_id, tokens))

    def _release(self, request_id: str) -> None:
        """Free the engine's KV and state for the request, if it holds any."""
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)

    def _close(
        self,
        request_id: str,
        end: FinishReason | Exception,
        tokens: tuple[int, ...] = (),
    ) -> None:
        """Send the stream's last item (finish record or error) and forget the stream."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.closed = True
        if isinstance(end, Exception):
            stream.queue.put_nowait(end)
            return
        timings = RequestTimings(
            arrival_time=stream.request.arrival_time,
            token_times=tuple(stream.token_times),
            finish_time=self._clock(),
        )
        stream.queue.put_nowait(TokenChunk(request_id, tokens, end, timings))
