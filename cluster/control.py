"""The controller's decisions, without Ray: admission per replica, sequential routing, backup.

Requests wait at their current hop until the next planning pass (`tick`: the controller runs
one when a request arrives and every tick interval); in a pass every replica in index order runs
the DP over the requests waiting at it. A declined request moves to its next
hop, which is evaluated in the same tick when that replica comes later in the order (else in
the next tick). After `route_limit` hops the backup policy serves it best-effort or rejects
it. Replicas running a baseline scheduler (vllm, sarathi) plan no admission: a request is
admitted at its first hop when it is submitted, with no tick, hop or backup. The Ray actor
(cluster.controller), the simulator and the benchmark drive the same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.api import Verdict
from cluster.autoscale import ScaleSample
from cluster.messages import ReplicaSnapshot
from cluster.metrics import PLANNER_BUCKETS_S, Metrics
from cluster.routing import FirstHop, Router, RouteState, least_loaded
from cluster.virtual_replica import VirtualReplica
from replica.planner.admission import AdmissionResult
from replica.request import Request, Tier

log = logging.getLogger(__name__)

REBALANCE_GAP = 4
"""Requests a replica holds beyond the least loaded one before its waiting best-effort
requests are bound again elsewhere (`ControlPlane.rebalance`)."""

MOVED_MEMORY = 10_000
"""The last requests `rebalance` moved, never moved again (a request moved in was the first
to go back out: 16-27 of 443 moved twice or more in a burst, one 6 times)."""

MOVE_TIMEOUT_S = 10.0
"""A request taken back from its replica that no client resumed within this long (its door
died) no longer holds the next rebalance back."""


@dataclass(frozen=True)
class Binding:
    """Where a request goes. `verdict` None: no replica is up, the request was not started."""

    request_id: str
    verdict: Verdict | None
    replica: int | None
    hops: int
    reason: str = ""
    retry_after_s: float = 0.0
    actor: object | None = None
    """The replica's actor to stream from, set by the controller once the replica holds the
    request: a slot may hold another actor than the one a front door knew (the autoscaler's,
    one in place of a replica dead for good)."""


@dataclass(frozen=True)
class Decision:
    request: Request
    binding: Binding
    resumed: bool = False
    """The request was already streaming (never rejected; see `ControlPlane.resume`)."""


@dataclass
class _Pending:
    request: Request
    route: RouteState
    resumed: bool
    counts: bool = True
    """Its decision is counted: the request's first (not a resume, nor a hand-off again)."""


class ControlPlane:
    """Virtual replicas + router + the requests waiting for a verdict."""

    def __init__(
        self, replicas: Sequence[VirtualReplica], router: Router, metrics: Metrics | None = None
    ) -> None:
        if not replicas:
            raise ValueError("a cluster needs at least one replica")
        self.replicas = list(replicas)
        self.router = router
        self.metrics = metrics or Metrics()
        self._queues: list[list[_Pending]] = [[] for _ in self.replicas]
        self.draining: set[int] = set()
        """Replicas being scaled down: they finish what they hold and take nothing new."""
        self._moving: dict[str, float] = {}
        """Requests taken back by `rebalance`, not resumed yet: when each was."""
        self._moved: dict[str, None] = {}
        """The last MOVED_MEMORY requests `rebalance` took back, oldest first."""

    def alive(self) -> list[bool]:
        return [vr.alive for vr in self.replicas]

    def routable(self) -> list[bool]:
        """Replicas a request may be sent to: up, and not draining."""
        return [vr.alive and vr.index not in self.draining for vr in self.replicas]

    def loads(self) -> list[float]:
        return [vr.load for vr in self.replicas]

    def scale_sample(self, now: float) -> ScaleSample:
        """What the autoscaler reads: the verdicts so far and what the routable replicas hold
        (best-effort requests and those waiting for a verdict count as ongoing)."""
        counters = self.metrics.counters
        declined = counters.get("declined", 0)
        routable = [vr for vr, ok in zip(self.replicas, self.routable(), strict=True) if ok]
        return ScaleSample(
            now,
            counters.get("admitted", 0) + declined,
            declined,
            sum(len(vr.admitted) for vr in routable),
            sum(len(vr.held) + self.num_pending(vr.index) for vr in routable),
            len(routable),
        )

    def holder(self, request_id: str) -> int | None:
        """The replica bound to the request, if any."""
        for vr in self.replicas:
            if request_id in vr.held:
                return vr.index
        return None

    def is_pending(self, request_id: str) -> bool:
        return any(p.request.request_id == request_id for q in self._queues for p in q)

    def request_ids(self) -> set[str]:
        """Every request the plane knows: held by a replica or waiting for a verdict."""
        held = {rid for vr in self.replicas for rid in vr.held}
        return held | {p.request.request_id for q in self._queues for p in q}

    def num_pending(self, replica: int) -> int:
        return len(self._queues[replica])

    def _cached(self, request: Request, routable: list[bool]) -> list[int]:
        """The prompt's tokens each routable replica likely has cached (empty: the first hop
        does not route by them, and the mirrors keep no picture of the caches)."""
        if self.router.first_hop is not FirstHop.PREFIX:
            return []
        return [
            vr.cached_prefix(request) if ok else 0
            for vr, ok in zip(self.replicas, routable, strict=True)
        ]

    def submit(
        self, request: Request, now: float, *, resumed: bool = False, again: bool = False
    ) -> Decision | None:
        """Queue a request at its first hop; a Decision when the verdict needs no tick.
        `again`: decided before, its hand-off failed (its verdict was counted then)."""
        rid = request.request_id
        self._moving.pop(rid, None)
        held = self.holder(rid)
        if held is not None:
            vr = self.replicas[held]
            verdict = Verdict.ADMITTED if rid in vr.admitted else Verdict.BEST_EFFORT
            return Decision(request, Binding(rid, verdict, held, 1), resumed)
        if self.is_pending(rid):
            return None
        routable = self.routable()
        cached = self._cached(request, routable)
        if request.tier is Tier.BEST_EFFORT:
            first = self.router.best_effort_first(self.loads(), routable, cached)
        else:
            first = self.router.first(self.loads(), routable, cached)
        if first is None:
            return Decision(
                request,
                Binding(rid, None, None, 0, "no replica is up", self.router.retry_after_s),
                resumed,
            )
        pending = _Pending(request, RouteState([first]), resumed, counts=not (resumed or again))
        if request.tier is Tier.BEST_EFFORT:
            return self._serve_best_effort(pending, first, now)
        if not self.replicas[first].plans_admission:
            self.replicas[first].admit(request, now)
            return self._decided(pending, Verdict.ADMITTED, first)
        self._queues[first].append(pending)
        return None

    def rebalance(self, now: float, handing: set[str]) -> list[tuple[str, int]]:
        """Take back best-effort requests waiting for their first step (a prefix credited
        there included: the idle replica computes it again) at a replica that
        holds REBALANCE_GAP or more requests beyond the least loaded routable one, to be
        bound again: their clients resume them as after a replica failure, and a request
        best-effort by choice goes to the least loaded replica then (one declined may be
        admitted there). Else a replica that came up after a burst was bound (autoscaled,
        restarted, the first back after a failure) idles beside the backlog. The latest bound
        go first, and none twice; one round at a time, once the last one's requests were
        bound again (their load counted where they went). `handing`: requests still being
        handed to their replica, which could not let go of them. (request id, replica)
        pairs; the mirrors forget them now."""
        self._moving = {r: t for r, t in self._moving.items() if now - t < MOVE_TIMEOUT_S}
        routable = self.routable()
        if self._moving or not any(routable):
            return []
        loads = self.loads()
        waiting = {
            vr.index: [r for r in vr.unstarted_best_effort(handing) if r not in self._moved]
            for vr in self.replicas
            if vr.alive
        }
        moves: list[tuple[str, int]] = []
        while True:
            least = least_loaded(loads, routable)
            assert least is not None  # some replica is routable
            busiest = max(
                (i for i, rids in waiting.items() if rids and i != least),
                key=lambda i: (loads[i], -i),
                default=None,
            )
            if busiest is None or loads[busiest] - loads[least] < REBALANCE_GAP:
                break
            moves.append((waiting[busiest].pop(), busiest))
            loads[busiest] -= 1
            loads[least] += 1
        for rid, replica in moves:
            self.replicas[replica].abort(rid)
            self._moving[rid] = now
            self._moved[rid] = None
            if len(self._moved) > MOVED_MEMORY:
                del self._moved[next(iter(self._moved))]
        self.metrics.inc("rebalanced", len(moves))
        return moves

    def migrate(self, request_id: str, from_replica: int) -> None:
        """Let go of a request whose replica failed mid-stream; it is submitted again as
        `migration.resumed_request` continues it (`submit(..., resumed=True)`)."""
        self.replicas[from_replica].abort(request_id)
        self.metrics.inc("migrated")

    def tick(self, now: float) -> list[Decision]:
        """One planning round over every replica in index order."""
        decisions: list[Decision] = []
        routable = self.routable()
        for vr in self.replicas:
            batch, self._queues[vr.index] = self._queues[vr.index], []
            if not batch:
                continue
            declined = batch
            result = self._plan_admission(vr, batch, now) if routable[vr.index] else None
            if result is not None:
                declined = []
                for p in batch:
                    if result.is_admitted(p.request.request_id):
                        vr.admit(p.request, now)
                        decisions.append(self._decided(p, Verdict.ADMITTED, vr.index))
                    else:
                        declined.append(p)
            for p in declined:
                decision = self._route_on(p, now)
                if decision is not None:
                    decisions.append(decision)
        return decisions

    def _plan_admission(
        self, vr: VirtualReplica, batch: list[_Pending], now: float
    ) -> AdmissionResult | None:
        """The replica's verdict; None (decline all) when its planner fails, so one planner
        error costs those requests a hop, not the controller."""
        started = time.perf_counter()
        try:
            result = vr.plan_admission([p.request for p in batch], now)
        except (ValueError, ArithmeticError):
            log.exception("admission planning failed on replica %d; routing on", vr.index)
            self.metrics.inc("planner_errors")
            return None
        self.metrics.observe("planner_latency_s", time.perf_counter() - started, PLANNER_BUCKETS_S)
        return result

    def abort(self, request_id: str) -> int | None:
        """Forget a request wherever it is; the replica that held it, if any."""
        self._moving.pop(request_id, None)
        for queue in self._queues:
            queue[:] = [p for p in queue if p.request.request_id != request_id]
        for vr in self.replicas:
            if vr.abort(request_id):
                return vr.index
        return None

    def drain(self, replica: int) -> None:
        """Send the replica nothing new (the autoscaler stops it once it holds nothing); the
        requests waiting there for its verdict go to another first hop, the hop not counted
        as it never planned them (a drain must not show as declines)."""
        self.draining.add(replica)
        waiting, self._queues[replica] = self._queues[replica], []
        routable = self.routable()
        for p in waiting:
            earlier = RouteState(p.route.visited[:-1])
            nxt = self.router.next_hop(earlier, routable) if earlier.visited else None
            if nxt is None and not earlier.visited:
                nxt = self.router.first(self.loads(), routable, self._cached(p.request, routable))
            if nxt is None:  # nowhere else: declined at the next tick
                self._queues[replica].append(p)
                continue
            p.route.visited[-1] = nxt
            self._queues[nxt].append(p)

    def mark_dead(self, replica: int) -> None:
        """The replica is gone: forget what it held (its clients resume their requests) and
        route what waits at it onwards at the next tick."""
        vr = self.replicas[replica]
        vr.reset()
        vr.alive = False

    def restore(self, replica: int, snapshot: ReplicaSnapshot, now: float) -> None:
        vr = self.replicas[replica]
        vr.restore(snapshot, now)
        vr.alive = True

    def _route_on(self, p: _Pending, now: float) -> Decision | None:
        alive = self.routable()
        nxt = self.router.next_hop(p.route, alive)
        if nxt is not None:
            p.route.visited.append(nxt)
            self._queues[nxt].append(p)
            return None
        rid = p.request.request_id
        if not any(alive):  # its replica went down before deciding: no verdict, as at submit
            retry = self.router.retry_after_s
            binding = Binding(rid, None, None, p.route.hops, "no replica is up", retry)
            return Decision(p.request, binding, p.resumed)
        if p.counts:
            self.metrics.inc("declined")
        backup = self.router.backup(p.route, self.loads(), alive)
        target = backup.best_effort_replica
        if target is None and p.resumed:
            # A request already streaming is never rejected mid-way: it finishes best-effort.
            target = least_loaded(self.loads(), alive)
        if target is None:
            if p.counts:
                self.metrics.inc("rejected")
            return Decision(
                p.request,
                Binding(
                    rid, Verdict.REJECTED, None, p.route.hops, backup.reason, backup.retry_after_s
                ),
                p.resumed,
            )
        return self._serve_best_effort(p, target, now)

    def _serve_best_effort(self, p: _Pending, replica: int, now: float) -> Decision:
        self.replicas[replica].add_best_effort(p.request, now)
        return self._decided(p, Verdict.BEST_EFFORT, replica)

    def _decided(self, p: _Pending, verdict: Verdict, replica: int) -> Decision:
        """The request's binding; counted once per request (a resumed one counts as
        migrated, not as a second admission)."""
        hops = p.route.hops
        if p.counts:
            self.metrics.inc(str(verdict))
            if hops > 1:
                self.metrics.inc("routed")
        return Decision(p.request, Binding(p.request.request_id, verdict, replica, hops), p.resumed)
