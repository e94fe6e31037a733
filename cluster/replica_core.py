"""One replica's serving loop without Ray: engine, plan inbox, per-request streams.

The loop never waits for the controller: it runs the latest plan it received (fitted to the
engine's state first, since the plan was made from a lagging mirror) or, with none, decodes
every decoding request with the last plan's shape. Only with nothing to do does it sleep.
Requests and aborts reach the engine between steps; the step itself runs in a worker thread
so streams keep flowing. Each step is reported (fire-and-forget) through a callback.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace

from cluster.messages import AlreadyHeld, HeldRequest, ReplicaSnapshot, StepReport, StreamItem
from cluster.plans import SeqView, derive_plan, reconcile
from replica.batch import BatchOutcome, BatchPlan, FinishReason, PrefillChunk, RequestOutcome
from replica.engine import Engine
from replica.request import Request

log = logging.getLogger(__name__)

Report = Callable[[StepReport], None]
Clock = Callable[[], float]

ENDED_MEMORY = 1024
"""Ended request ids a replica remembers for its snapshots: enough to cover the requests that
end while the controller binds one (milliseconds), bounded so a long-lived replica stays small."""


@dataclass
class _Held:
    request: Request
    admitted: bool
    """Guaranteed now (the controller's planner may promote or demote it since its bind)."""
    promoted: bool = False
    """Bound best-effort, guaranteed since, and its client not told yet: the next item it
    streams says so (StreamItem.promoted)."""
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached: int | None = None
    """Prompt tokens its first prefill took from the prefix cache (None: not looked up yet;
    a lookup after a preemption finds its own blocks, not an earlier request's)."""

    def view(self) -> SeqView:
        return SeqView(
            num_known=self.request.prompt_len + len(self.output),
            num_computed=self.num_computed,
            num_generated=len(self.output),
        )


@dataclass
class _Lookups:
    """What the prefix cache was asked for the plan about to run: each request's known
    tokens, and how many of them it held."""

    plan: BatchPlan | None = None
    """The controller's plan as sent, run without the prefixes should they leave it short of
    blocks (`ReplicaCore._bare`)."""
    found: dict[str, tuple[int, int]] = field(default_factory=dict)
    first: set[str] = field(default_factory=set)
    """Requests whose first lookup this is: what it found is their prefix-cache hit."""

    @property
    def attached(self) -> list[str]:
        """Requests that began from a cached prefix."""
        return [rid for rid, (_, hits) in self.found.items() if hits]

    def counts(self, plan: BatchPlan) -> tuple[int, int]:
        """Tokens looked up and found for the requests the plan as run prefills (fitting it
        may drop one, whose miss is looked up again with its next plan)."""
        ran = {e.request_id for e in plan.entries}
        looked = [v for rid, v in self.found.items() if rid in ran]
        return sum(q for q, _ in looked), sum(h for _, h in looked)


@dataclass
class _Stream:
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    ended: bool = False
    read: bool = False
    """A client opened it (`ReplicaCore.stream`)."""


class ReplicaCore:
    """Serves the requests the controller binds here, with the plans it sends."""

    def __init__(
        self, engine: Engine, index: int, report: Report, *, clock: Clock = time.time
    ) -> None:
        self.engine = engine
        self.index = index
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self._report = report
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._streams: dict[str, _Stream] = {}
        self._aborts: dict[str, str] = {}
        """Requests to end before the next step, with why (`StreamItem.abort_reason`)."""
        self._released: set[str] = set()
        """Of `_aborts`, the requests the controller takes back to bind elsewhere."""
        self._added: list[str] = []
        self._ended: deque[str] = deque(maxlen=ENDED_MEMORY)
        """The last ids this incarnation ended, oldest first."""
        self._dropped: dict[str, None] = {}
        """The last ENDED_MEMORY ids whose stream went unread and was let go, oldest first (a
        dict: every add looks an id up in it): a late reader gets their end (abort), not a lost
        stream it would resume elsewhere, and a late add is refused."""
        self._inbox: BatchPlan | None = None
        self._bare: BatchPlan | None = None
        """A controller plan refused once the cached prefixes were attached for it, to run
        once without them."""
        self._last: BatchPlan | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"replica-{self.index}-steps")

    async def stop(self) -> None:
        """Finish the step in flight; open streams end as aborted."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        for rid in list(self._held):
            self._end(rid, FinishReason.ABORT)

    def add_request(self, request: Request, admitted: bool) -> None:
        """Hold a request; a ValueError (from the engine's checks) leaves nothing behind.

        The engine only records the request here (a dict insert, atomic under the GIL), so
        doing it while a step runs in the worker thread is safe; KV changes in steps only (its
        eviction order also between them, `_touch_added`)."""
        rid = request.request_id
        if rid in self._held or rid in self._streams or rid in self._dropped:
            raise AlreadyHeld(f"request {rid!r} is already held by this replica")
        self.engine.add_request(request)
        self._held[rid] = _Held(request, admitted)
        self._streams[rid] = _Stream()
        self._added.append(rid)
        self._wake.set()

    def abort(self, request_id: str, release: bool = False, reason: str = "") -> None:
        """End a request before the next step, freeing its KV; unknown ids are ignored. One
        that ended already lets its stream go if no one opened it. `release`: the controller
        binds it elsewhere, its stream ends as lost (its client resumes it there). `reason`:
        what its client is told, when the server ends it (not when the client left)."""
        if request_id not in self._held:
            self._drop_unread(request_id)
        elif request_id not in self._aborts:
            self._aborts[request_id] = reason
            if release:
                self._released.add(request_id)
            self._wake.set()

    def _drop_unread(self, request_id: str, gone: bool = True) -> None:
        """Let go of an ended request's stream no one opened (its client left while it was
        bound): kept, it would stay for the replica's life, as unread work. Unless `gone`
        (released: bound elsewhere), a late reader finds it lost, not ended."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.ended and not stream.read:
            del self._streams[request_id]
            if not gone:
                return
            self._dropped[request_id] = None
            if len(self._dropped) > ENDED_MEMORY:
                del self._dropped[next(iter(self._dropped))]

    def set_plan(self, plan: BatchPlan, regraded: Mapping[str, bool] | None = None) -> None:
        """The controller's next plan; replaces one not yet started. `regraded`: requests
        its planner guaranteed (True) or gave up on (False) since the last plan; ids this
        replica does not hold (ended, or not added yet) are ignored."""
        for rid, admitted in (regraded or {}).items():
            held = self._held.get(rid)
            if held is not None:
                held.promoted = held.promoted or (admitted and not held.admitted)
                held.admitted = admitted
        self._inbox = plan
        self._bare = None  # a newer plan replaces it too
        self._wake.set()

    def open_work(self) -> tuple[int, int]:
        """(Requests held, streams of ended requests not read to their end): a replica is
        stopped losing no client a token only at (0, 0)."""
        return len(self._held), sum(rid not in self._held for rid in self._streams)

    def snapshot(self) -> ReplicaSnapshot:
        """What the replica holds once its pending aborts apply: aborts take effect silently
        at the next step boundary, so a mirror rebuilt from a snapshot that still listed them
        would keep a request the replica never reports on again."""
        return ReplicaSnapshot(
            replica=self.index,
            incarnation=self.incarnation,
            seq=self.seq,
            requests=tuple(
                HeldRequest(h.request, h.admitted, tuple(h.output), h.num_computed)
                for rid, h in self._held.items()
                if rid not in self._aborts
            ),
            ended=(*self._ended, *(rid for rid in self._aborts if rid in self._held)),
            free_blocks=self.engine.num_free_blocks,
            num_blocks=self.engine.cache.num_blocks,
        )

    async def stream(self, request_id: str) -> AsyncIterator[StreamItem]:
        """The request's tokens as steps produce them; the last item has the finish reason.

        Leaving early aborts the request (the client went away)."""
        stream = self._streams.get(request_id)
        if stream is None:
            gone = request_id in self._dropped
            yield (
                StreamItem(finish_reason=str(FinishReason.ABORT)) if gone else StreamItem(lost=True)
            )
            return
        stream.read = True
        try:
            while True:
                item = await stream.queue.get()
                yield item
                if item.finish_reason is not None or item.lost:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.ended:
                self.abort(request_id)

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._apply_aborts()
            self._touch_added()
            plan, from_inbox, lookups = self._next_plan()
            if plan is None:
                await self._wake.wait()
                continue
            try:
                outcome = await asyncio.to_thread(self.engine.step, plan)
            except ValueError:
                # Refused before anything changed (e.g. KV is short): a derived plan waits for
                # the controller's next one; a refused controller plan falls back to deriving.
                # The prefixes attached for it are let go: the controller, which plans the
                # KV, does not know they are held.
                self._detach(lookups)
                if from_inbox and lookups.attached:
                    # The prefixes attached took more of the free blocks (cached ones are
                    # free until attached) than the controller's mirror planned: its picture
                    # of the cache differs from the cache. Resent with no report between, the
                    # plan was refused for good and the replica stalled: run it without them,
                    # and its report shows the credit missed.
                    self._bare = lookups.plan
                elif not from_inbox:
                    await self._wake.wait()
                continue
            except Exception:
                log.exception("replica %d: step failed; ending the requests it touched", self.index)
                self._fail(plan)
                continue
            self._after_step(plan, outcome, lookups)

    def _next_plan(self) -> tuple[BatchPlan | None, bool, _Lookups]:
        """The plan to run, whether it is the controller's, and the prefix-cache lookups
        made for it."""
        if self._bare is not None:
            plan, self._bare = reconcile(self._bare, self._views()), None
            if plan is not None:
                return plan, True, _Lookups()
        if self._inbox is not None:
            lookups = self._attach_prefixes(self._inbox)
            plan = reconcile(self._inbox, self._views())
            self._inbox = None
            if plan is not None:
                return plan, True, lookups
            self._detach(lookups)
        return derive_plan(self._last, self._views()), False, _Lookups()

    def _views(self) -> dict[str, SeqView]:
        return {rid: h.view() for rid, h in self._held.items()}

    def _attach_prefixes(self, plan: BatchPlan) -> _Lookups:
        """Start the requests the plan begins to prefill from their cached prefix (prefix
        caching): only now, so a request waiting for its turn pins no cached blocks, and
        before the plan is fitted, so the chunks cover the rest of the prompt only and the
        step reported is the step run. The controller learns of the hit from the report."""
        lookups = _Lookups(plan)
        for entry in plan.entries:
            held = self._held.get(entry.request_id)
            if not isinstance(entry, PrefillChunk) or held is None:
                continue
            if not self.engine.looks_up_prefix(entry.request_id):
                continue
            held.num_computed = self.engine.attach_prefix(entry.request_id)
            if held.cached is None and not held.output:
                held.cached = held.num_computed
                lookups.first.add(entry.request_id)
            lookups.found[entry.request_id] = (held.view().num_known, held.num_computed)
        return lookups

    def _detach(self, lookups: _Lookups) -> None:
        """Let go of prefixes attached for a plan that did not run; its requests' first
        lookups count with the plan that runs them (a request's lookup after a preemption
        finds its own blocks: its hit was counted at its first)."""
        for rid in lookups.attached:
            self.engine.preempt(rid)
            self._held[rid].num_computed = 0
        for rid in lookups.first:
            self._held[rid].cached = None

    def _after_step(self, plan: BatchPlan, outcome: BatchOutcome, lookups: _Lookups) -> None:
        now = self._clock()
        self.seq += 1
        if plan.entries:
            self._last = plan
        for rid in plan.preempt:
            if rid in self._held:
                self._held[rid].num_computed = 0
        for result in outcome.outcomes:
            held = self._held.get(result.request_id)
            if held is None:
                continue
            first = not held.output
            held.output.extend(result.new_token_ids)
            held.num_computed = result.num_computed_tokens
            tokens = tuple(result.new_token_ids)
            item = StreamItem(
                tokens,
                (now,) * len(tokens),
                abort_reason=result.abort_reason,
                logprobs=tuple(result.logprobs),
                prompt_logprobs=tuple(result.prompt_logprobs),
                cached_tokens=(held.cached or 0) if first and tokens else 0,
                promoted=held.promoted,
            )
            if result.finish_reason is not None:
                self._end(result.request_id, result.finish_reason, item)
            elif item.token_ids:
                held.promoted = False
                self._push(result.request_id, item)
        queries, hits = lookups.counts(plan)
        self._report(
            StepReport(
                self.index,
                self.incarnation,
                self.seq,
                plan,
                _lean(outcome),
                now,
                prefix_queries=queries,
                prefix_hits=hits,
            )
        )

    def _fail(self, plan: BatchPlan) -> None:
        """End the requests of a step that failed midway (their KV state is unknown). The
        step counts without a report: the controller sees the gap and rebuilds its mirror."""
        self.seq += 1
        failed = StreamItem(abort_reason="a step of the replica failed; its log says why")
        for rid in {*(e.request_id for e in plan.entries), *plan.preempt}:
            self._end(rid, FinishReason.ABORT, failed)

    def _touch_added(self) -> None:
        """Keep the cached prefixes of the requests added since the last step to be evicted
        last (Engine.touch_prefix), here between steps: a step in flight owns the cache."""
        added, self._added = self._added, []
        for rid in added:
            if rid in self._held:
                self.engine.touch_prefix(rid)

    def _apply_aborts(self) -> None:
        """End the aborted requests and report it as a step with no work: an abort may come
        from this side (the stream's reader went away) without the controller knowing, and
        its mirror must not keep a request the replica no longer holds."""
        aborts, self._aborts = self._aborts, {}
        released, self._released = self._released, set()
        ended = [rid for rid in aborts if rid in self._held]
        for rid in ended:
            why = StreamItem(abort_reason=aborts[rid])
            self._end(rid, FinishReason.ABORT, why, lost=rid in released)
            self._drop_unread(rid, gone=rid not in released)
        if ended:
            self.seq += 1
            outcome = BatchOutcome(
                outcomes=[RequestOutcome(rid, finish_reason=FinishReason.ABORT) for rid in ended],
                free_blocks=self.engine.num_free_blocks,
            )
            plan = BatchPlan(entries=())
            self._report(
                StepReport(self.index, self.incarnation, self.seq, plan, outcome, self._clock())
            )

    def _push(self, request_id: str, item: StreamItem) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def _end(
        self,
        request_id: str,
        reason: FinishReason,
        last: StreamItem | None = None,
        lost: bool = False,
    ) -> None:
        """Release the request's engine state and close its stream with `reason` (carried by
        the same item as the last tokens, so a client never holds tokens without the end),
        or as `lost`: no end, the client resumes the request elsewhere."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._ended.append(request_id)
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.ended = True
            last = last or StreamItem()
            end = replace(last, lost=True) if lost else replace(last, finish_reason=str(reason))
            stream.queue.put_nowait(end)


def _lean(outcome: BatchOutcome) -> BatchOutcome:
    """The outcome as the controller needs it: log-probabilities (up to 20 alternatives a
    token) go to the clients' streams only."""
    if not any(o.logprobs or o.prompt_logprobs for o in outcome.outcomes):
        return outcome
    lean = [replace(o, logprobs=[], prompt_logprobs=[]) for o in outcome.outcomes]
    return replace(outcome, outcomes=lean)
