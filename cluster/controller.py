"""ClusterController: the Ray actor that admits, routes and plans for every replica.

It owns a `ControlPlane` (virtual replicas + router) and does the I/O around it: a planning
tick every `tick_interval_ms` and at once when a request arrives (waiting for the period cost
tight-TTFT requests their deadline), binding admitted requests to their replica, sending each
replica its next plan after every step it reports, and watching replica health (a replica Ray
will not restart is replaced). Its state is a cache of the replicas' state: after a restart
(max_restarts) it rebuilds every mirror from the replicas' snapshots, while the replicas keep
decoding on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from cluster.api import ClusterStatus, Verdict
from cluster.autoscale import SCALE_PERIOD_S, Autoscaler, plan_resize
from cluster.config import BestEffortOrder, ClusterConfig, SchedulerKind
from cluster.control import Binding, ControlPlane, Decision
from cluster.leases import Leases
from cluster.logs import configure_logging
from cluster.messages import AlreadyHeld, ReplicaSnapshot, StepReport
from cluster.metrics import Metrics
from cluster.migration import resumed_request
from cluster.names import NAMESPACE, slot_occupants
from cluster.profile import cluster_profile
from cluster.routing import FirstHop, Router
from cluster.virtual_replica import ReportFit, SchedulerConfig, VirtualReplica
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget
from replica.planner.baseline_sizing import sarathi_token_budget, vllm_config
from replica.planner.config import (
    GoodspeedConfig,
    LapsConfig,
    OutputEstimateConfig,
    PlannerConfig,
    SpecConfig,
)
from replica.planner.sarathi import SarathiConfig
from replica.request import Request

log = logging.getLogger(__name__)

HEALTH_PERIOD_S = 0.5
HEALTH_TIMEOUT_S = 2.0
SLOW_CHECKS = 2
"""Health periods in a row in which a replica did not answer within HEALTH_TIMEOUT_S before
the health loop takes it for down: on a loaded machine one late answer (the controller's own
loop held up, as on 2 shared cores) is not a failure. A failed call (the actor restarting or
dead) takes it down at once."""
DRAIN_GRACE_S = 10.0
"""A draining replica that holds nothing stops once the front doors have pulled its streams
to the end, or this long after, should one never pull it."""
START_RETRY_S = 30.0
"""After a replica failed to start, the controller waits this long before it starts another."""
DEAD_CHECKS = 3
"""Health periods in a row in which a replica's health call failed as dead (Ray's
`ActorDiedError`) before it is taken for dead for good and stopped, for another to start in
its slot. Ray holds the calls to a replica it restarts until it is back, and fails those to
one it will not restart (its restart failed in `__init__`, or it was killed without restart)
at once; but a call in flight when a replica crashes fails so too, however Ray goes on."""
AHEAD_WAIT_S = 0.5
"""How long a report past a gap waits for the reports before it, before the mirror is rebuilt
from a snapshot: Ray does not keep an async actor's calls in order, so a replica's reports
may come out of order, while a report a failed step never sent leaves a gap for good."""
PLAN_RESEND_S = 0.25
"""A plan sent without a report back this long ago is considered lost."""
HAND_OFF_TIMEOUT_S = 5.0
"""How long a replica may take to accept a request before it is taken for down and the request
bound elsewhere: one that hangs (a wedged device, a stopped process) would hold the request,
and its client, for as long as it hangs. It holds the request if it wakes; `_drop_moved`
then ends it there."""
RESUME_WAIT_S = 120.0
"""How long a request that lost its replica waits for one to be up again (a restart reloads
the model: seconds here, longer for a large checkpoint) before the client is told."""
MAX_CONCURRENCY = 20_000
"""Concurrent calls the controller actor serves. Submits wait for their verdict and resumes
for a replica inside their call, so calls that wait must never starve the quick ones (lease
renewals, replica reports, aborts); Ray's default for an async actor is 1,000. (A separate
concurrency group for resumes would run them on another event loop, away from the state
they wait on.)"""


def planner_config(config: ClusterConfig) -> PlannerConfig:
    """Speculation as the planner sees it (fixed:k caps lengths at k, none disables them,
    goodspeed re-splits them; specserve and adaserve plan as slos, their replicas cut drafts
    short or verify them as trees), KV
    reserved from observed output lengths, as the simulator plans, and the best-effort tier's
    order."""
    estimate = OutputEstimateConfig()
    laps = LapsConfig() if config.best_effort_order is BestEffortOrder.LAPS else None
    if config.spec_policy == "none":
        return PlannerConfig(output_estimate=estimate, laps=laps)
    spec = SpecConfig(max_spec_tokens=config.spec_k) if config.spec_k else SpecConfig()
    goodspeed = GoodspeedConfig() if config.spec_policy == "goodspeed" else None
    return PlannerConfig(spec=spec, output_estimate=estimate, goodspeed=goodspeed, laps=laps)


def scheduler_config(config: ClusterConfig, perf: PerfModel, cache: CacheBudget) -> SchedulerConfig:
    """What plans each replica's steps. vllm batches the longest prefill the cache holds
    (prefills are not chunked); sarathi's token budget is the largest step the perf model
    fits in the tightest tier's TPOT."""
    if config.scheduler is SchedulerKind.VLLM:
        return vllm_config(cache.num_blocks * cache.block_size)
    if config.scheduler is SchedulerKind.SARATHI:
        tpot_s = min(t.tightest_tpot_ms for t in config.tiers) / 1e3
        return SarathiConfig(token_budget=sarathi_token_budget(perf, tpot_s))
    return planner_config(config)


def build_plane(config: ClusterConfig, metrics: Metrics | None = None) -> ControlPlane:
    perf = cluster_profile(config)
    cache = CacheBudget(config.num_kv_blocks)
    planner = scheduler_config(config, perf, cache)
    log.info("replicas plan with %s: %s", config.scheduler.value, planner)
    router = Router(
        first_hop=config.first_hop,
        route_limit=config.route_limit,
        backup_policy=config.backup_policy,
        retry_after_s=config.retry_after_s,
        prefix_imbalance=config.prefix_imbalance,
    )
    replicas = [
        VirtualReplica(
            i,
            perf,
            cache,
            planner,
            calibrate=config.calibrate,
            track_prefixes=config.first_hop is FirstHop.PREFIX,
            credit_prefixes=config.prefix_caching and config.credit_prefixes,
        )
        for i in range(config.slots)
    ]
    for vr in replicas[config.replicas :]:
        vr.alive = False
    return ControlPlane(replicas, router, metrics)


@dataclass
class _Rebuild:
    """A mirror being rebuilt from its replica's snapshot, and what happens meanwhile."""

    binds: dict[str, tuple[Request, bool]]
    """Every hand-off in flight since the snapshot was asked for: one may have begun and
    ended before the rebuild, its request still missing from the snapshot."""
    reports: list[StepReport] = field(default_factory=list)
    """Reports that came meanwhile (and those held past a gap before it), folded in after it
    (those past the snapshot may be the replica's last word on a request)."""


class ClusterController:
    """Submit, resume and abort requests; receive step reports; report status."""

    def __init__(
        self,
        config: ClusterConfig,
        replicas: Sequence[ActorHandle],
        groups: Sequence[PlacementGroup | None] = (),
        detached: bool = False,
    ) -> None:
        """`groups`: the replicas' placement groups (GPU replicas'). `detached`: the cluster
        outlives its launcher, so it stops itself once abandoned by every front door."""
        configure_logging()
        if len(replicas) != config.replicas:
            raise ValueError(f"config has {config.replicas} replicas, got {len(replicas)} handles")
        self.config = config
        empty = config.slots - config.replicas
        self.replicas: list[ActorHandle | None] = [*replicas, *[None] * empty]
        """Per slot (autoscale's maximum, else `replicas`): its replica, None when off."""
        self.groups: list[PlacementGroup | None] = [*groups, *[None] * (config.slots - len(groups))]
        self.detached = detached
        self.namespace = NAMESPACE if detached else None
        self.plane = build_plane(config)
        self.autoscaler = (
            Autoscaler(config.autoscale, config.replicas) if config.autoscale is not None else None
        )
        self._starting: dict[int, asyncio.Task[None]] = {}
        """Slots whose replica is being started (by the autoscaler, or in place of one dead
        for good)."""
        self._empty_since: dict[int, float] = {}
        """Draining replicas that hold nothing, since when."""
        self._start_failed = -math.inf
        """When a replica last failed to start (monotonic)."""
        self._start_error = ""
        """Why the last start failed, until a start succeeds: the operator's answer to a
        slot that stays empty."""
        self._died: dict[int, int] = {}
        """Per slot, the health checks in a row its replica failed as dead."""
        self._slow: dict[int, int] = {}
        """Per slot, the health loop's checks in a row its replica did not answer in time."""
        self._waiters: dict[str, asyncio.Future[Binding]] = {}
        self._binding: dict[int, dict[str, tuple[Request, bool]]] = {
            i: {} for i in range(config.slots)
        }
        """Requests being handed to each replica (request, admitted)."""
        self._rebuilds: dict[int, _Rebuild] = {}
        """Replicas whose mirror is being rebuilt (one rebuild at a time each)."""
        self._ahead: dict[int, dict[int, StepReport]] = {}
        """Per replica, reports past a gap, by step: folded once the gap fills."""
        self._aborted: set[str] = set()
        """Requests aborted while being handed to a replica: released once the hand-off ends."""
        self._plan_sent: dict[int, float] = {}
        self._ready: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None
        """Set by a request that waits for a verdict: the tick loop plans without waiting."""
        self._revived: asyncio.Event | None = None
        """Set (and replaced) when a replica comes back up: resumes waiting for one wake."""
        self._waiting_for_replica: dict[str, bool] = {}
        """Requests waiting for a replica to be up (a resume, or an arrival when none is):
        aborted or not."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.leases = Leases(
            config.door_lease_s,
            booted=time.monotonic(),
            restarted=ray.get_runtime_context().was_current_actor_reconstructed,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    async def cluster_config(self) -> ClusterConfig:
        return self.config

    async def placement_groups(self) -> list[PlacementGroup | None]:
        return self.groups

    async def attach(self, door: str, requests: Sequence[str] = ()) -> bool:
        """Take or renew a front door's lease over the requests it streams; False once the
        cluster is being stopped."""
        return self.leases.renew(door, requests, time.monotonic())

    async def release(self, door: str, handover: bool = False) -> bool:
        """A front door leaves, and its requests end with it. True when it was the last: the
        cluster is then closing (no door may attach) and the caller stops it. `handover`: it
        leaves the cluster to the next door (a Serve update), never closing it."""
        last = self.leases.release(door, time.monotonic(), handover=handover)
        self._end_orphans()
        if last:
            self._close()
        return last

    async def live_doors(self) -> int:
        """How many doors hold a lease that has not lapsed: a door of another config waits
        for none to be left (their streams drained) before stopping this cluster. Restarted
        less than a lease ago, it counts one it may not have heard from yet."""
        now = time.monotonic()
        return len(self.leases.live(now)) or int(self.leases.hearing(now))

    def _watch_leases(self) -> None:
        now = time.monotonic()
        for door in self.leases.expire(now):
            log.warning("front door %s stopped renewing its lease; its requests end", door)
        self._end_orphans()
        if self.detached and self.leases.abandoned(now):
            log.warning(
                "no front door for %.0f s: stopping the cluster", self.leases.abandoned_after_s
            )
            self._close()
            me = ray.get_runtime_context().current_actor
            kill_for_good([*(a for a in self.replicas if a is not None), me], self.groups)

    def _close(self) -> None:
        """The cluster is being stopped: no door may attach, and the replicas being started
        are stopped (by name: their groups may not be ours yet), since whoever stops the rest
        looks for them by name before such a start could end."""
        self.leases.closing = True
        for slot in list(self._starting):
            self._starting.pop(slot).cancel()
            self._stop_slot(slot)

    def _end_orphans(self) -> None:
        if not (self.leases.owners or self.leases.settling):
            return
        known = self.plane.request_ids() | set(self._waiters) | set(self._waiting_for_replica)
        known.update(rid for binding in self._binding.values() for rid in binding)
        orphans = self.leases.orphans(known)
        unclaimed = self.leases.unclaimed(known, time.monotonic())
        if unclaimed:
            log.warning("%d requests no front door claimed since the restart end", len(unclaimed))
        why = dict.fromkeys(unclaimed, "no front door claimed it after the controller restarted")
        why |= dict.fromkeys(orphans, "its front door stopped renewing its lease (door_lease_s)")
        for rid, reason in why.items():
            self._spawn(self.abort(rid, reason))

    async def ready(self) -> None:
        """Returns once every mirror is built from its replica's snapshot."""
        if self._ready is None:
            self._ready = asyncio.Event()
            self._spawn(self._boot())
        await self._ready.wait()

    async def _boot(self) -> None:
        if self.autoscaler is not None or self.detached:
            self._adopt()
        await asyncio.gather(*(self._sync(i) for i in self._up()))
        assert self._ready is not None
        self._ready.set()
        self._spawn(self._tick_loop())
        self._spawn(self._health_loop())
        if self.autoscaler is not None:
            self._spawn(self._scale_loop())

    def _up(self) -> list[int]:
        """Slots with a replica that has loaded its model (not off, not starting)."""
        return [i for i, a in enumerate(self.replicas) if a is not None and i not in self._starting]

    def _adopt(self) -> None:
        """Take the replicas running under the slots' names: after a restart, the autoscaler
        may have started and stopped some, and replicas dead for good may have been replaced,
        since the launch that gave this actor its list. (Only a detached cluster's outlive
        the controller that started them: Ray ends an actor with its owner; the launcher's
        own replicas are the launcher's.)"""
        grouped = self.config.num_gpus_per_replica > 0
        for i in range(self.config.slots):
            self.replicas[i], self.groups[i] = slot_occupants(i, self.namespace, grouped)
            if self.replicas[i] is None:
                self.plane.replicas[i].alive = False
                if self.groups[i] is not None:  # left by a start this actor's restart cut short
                    remove_placement_group(self.groups[i])
                    self.groups[i] = None
        if self.autoscaler is not None:
            self.autoscaler.target = self.autoscaler.config.bounded(len(self._up()))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requests -------------------------------------------------------------------------------

    async def submit(self, request: Request, door: str | None = None) -> Binding:
        """The request's verdict and replica (a retried submit of a request a replica holds
        gets where it runs, its verdict as the replica's mirror holds it now).
        `door`: the front door that streams it, whose lease keeps it alive."""
        await self.ready()
        rid = request.request_id
        if door is not None:
            self.leases.own(rid, door, time.monotonic())
        deadline = time.monotonic() + self.config.arrival_wait_s

        async def decide() -> Binding:
            return await self._decide(request, self.plane.submit(request, time.time()))

        return await self._when_a_replica_is_up(rid, deadline, decide)

    async def resume(
        self,
        original: Request,
        delivered: Sequence[int],
        from_replica: int,
        door: str | None = None,
    ) -> Binding:
        """Continue a request whose replica failed mid-stream, after `delivered` tokens. When
        every replica is down (Ray is restarting them), wait up to RESUME_WAIT_S for one
        rather than give the stream up, also when the replicas left go down before one takes
        it (a second failure)."""
        await self.ready()
        if door is not None:
            self.leases.own(original.request_id, door, time.monotonic())
        rid = original.request_id
        resumed = resumed_request(original, delivered)
        deadline = time.monotonic() + RESUME_WAIT_S
        migrated = False

        async def decide() -> Binding:
            nonlocal migrated
            if not migrated:  # once, when a replica is up to take it
                migrated = True
                self._binding[from_replica].pop(rid, None)
                self.plane.migrate(rid, from_replica)
            decision = self.plane.submit(resumed, time.time(), resumed=True)
            return await self._decide(original, decision)

        return await self._when_a_replica_is_up(rid, deadline, decide, from_replica)

    async def _when_a_replica_is_up(
        self,
        rid: str,
        deadline: float,
        decide: Callable[[], Awaitable[Binding]],
        failed: int | None = None,
    ) -> Binding:
        """`decide` once a replica is up, again while the replicas go down before one takes
        the request (verdict None), until `deadline` or the request's abort. `failed`: the
        replica the request's stream just lost, checked first when it is the only one up,
        since the health loop may not have seen it fail yet."""
        self._waiting_for_replica[rid] = False
        try:
            if failed is not None and not any(
                up for i, up in enumerate(self.plane.routable()) if i != failed
            ):
                await self._check(failed)
            while True:
                await self._until_a_replica_is_up(rid, deadline)
                if self._waiting_for_replica[rid]:
                    return Binding(rid, None, None, 0, "aborted while waiting for a replica")
                binding = await decide()
                if binding.verdict is not None or time.monotonic() >= deadline:
                    return binding
        finally:
            self._waiting_for_replica.pop(rid, None)

    def _wake_resumes(self) -> None:
        """A replica became routable, or a resume was aborted: resumes waiting for one look
        again."""
        if self._revived is not None:
            self._revived.set()
            self._revived = None

    async def _until_a_replica_is_up(self, request_id: str, deadline: float) -> None:
        """Wait for a routable replica, until `deadline` or the resumed request's abort."""
        while (
            not any(self.plane.routable())
            and not self._waiting_for_replica[request_id]
            and time.monotonic() < deadline
        ):
            if self._revived is None:
                self._revived = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._revived.wait(), deadline - time.monotonic())

    async def abort(self, request_id: str, reason: str = "") -> None:
        """`reason`: what the request's client is told (none when the client left)."""
        await self.ready()
        if request_id in self._waiting_for_replica:
            self._waiting_for_replica[request_id] = True
            self._wake_resumes()  # its wait for a replica ends now
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if any(request_id in binding for binding in self._binding.values()):
            self._aborted.add(request_id)
        replica = self.plane.abort(request_id)
        actor = None if replica is None else self.replicas[replica]
        if actor is not None:
            actor.abort.remote(request_id, reason)

    async def _decide(self, request: Request, decision: Decision | None) -> Binding:
        if decision is not None:
            binding = await self._bind(decision)
            if binding is not None:
                return binding
        if self._arrived is not None:
            self._arrived.set()
        waiter = self._waiters.get(request.request_id)
        if waiter is None:
            waiter = self._waiters[request.request_id] = asyncio.get_running_loop().create_future()
        return await asyncio.shield(waiter)

    async def _bind(self, decision: Decision) -> Binding | None:
        """Hand an accepted request to its replica; only then is the verdict final. None:
        the replica was down, the request waits for a verdict again (a later tick's)."""
        binding = decision.binding
        if binding.verdict not in (Verdict.ADMITTED, Verdict.BEST_EFFORT):
            return binding
        replica = binding.replica
        assert replica is not None
        request = decision.request
        rid = request.request_id
        admitted = binding.verdict is Verdict.ADMITTED
        self._handing(decision)
        added = False
        actor = self.replicas[replica]
        try:
            if actor is None:  # stopped by the autoscaler since the plane chose it
                raise RayActorError
            await _within(actor.add_request.remote(request, admitted), HAND_OFF_TIMEOUT_S)
            added = True
        except (RayActorError, TimeoutError) as error:
            self.plane.abort(rid)
            if self.replicas[replica] is actor:  # not a replica replaced meanwhile
                # Said once: the hand-offs waiting on a hung replica time out together.
                if isinstance(error, TimeoutError) and self.plane.replicas[replica].alive:
                    log.warning("replica %d did not take a request in time: down", replica)
                self.plane.mark_dead(replica)
            if self._left_in_hand_off(rid):  # nothing to retry
                return Binding(rid, None, None, binding.hops, "aborted during its hand-off")
            now = time.time()
            retry = self.plane.submit(request, now, resumed=decision.resumed, again=True)
            return None if retry is None else await self._bind(retry)
        except RayTaskError as exc:
            if not isinstance(exc.cause, AlreadyHeld):
                # Refused by the replica's own checks; counted under its verdict already.
                self.plane.abort(rid)
                self._aborted.discard(rid)
                return Binding(rid, Verdict.REJECTED, None, binding.hops, str(exc.cause))
            added = True  # a retried submit, or a controller restarted mid hand-off
        finally:
            self._binding[replica].pop(rid, None)
            if not added and replica in self._rebuilds:
                self._rebuilds[replica].binds.pop(rid, None)
        assert actor is not None  # it holds the request
        binding = replace(binding, actor=actor)
        for vr in self.plane.replicas:  # a copy a replica back from a hang took meanwhile
            if vr.index != replica and rid in vr.held:
                self._end_copy(vr.index, rid)
        if self._left_in_hand_off(rid):
            actor.abort.remote(rid)
            return binding
        # The mirror has the request since the plane accepted it, or since a rebuild during
        # the hand-off put it back (_sync); one missing now ended already, and stays out.
        self._send_plan(replica, time.time())
        return binding

    def _left_in_hand_off(self, request_id: str) -> bool:
        """Whether the request's client left while it was being handed to its replica (its
        abort is taken now)."""
        left = request_id in self._aborted
        self._aborted.discard(request_id)
        return left

    def _handing(self, decision: Decision) -> None:
        """Note an accepted request as being handed to its replica, from the moment the
        plane accepted it (its mirror plans it since): until the hand-off returns, no
        guarantee change of it goes to the replica (`take_regraded`), and a rebuild keeps it
        (`_keep_bound`)."""
        binding = decision.binding
        if binding.verdict not in (Verdict.ADMITTED, Verdict.BEST_EFFORT):
            return
        assert binding.replica is not None
        held = (decision.request, binding.verdict is Verdict.ADMITTED)
        self._binding[binding.replica][decision.request.request_id] = held
        if binding.replica in self._rebuilds:
            self._rebuilds[binding.replica].binds[decision.request.request_id] = held

    def _keep_bound(self, replica: int, request: Request, admitted: bool) -> None:
        """Put a request being bound back in a mirror just rebuilt without it: the snapshot
        was taken before its hand-off reached the replica."""
        vr = self.plane.replicas[replica]
        if not vr.alive or request.request_id in vr.held:
            return
        if admitted:
            vr.admit(request, time.time())
        else:
            vr.add_best_effort(request, time.time())

    async def _resolve(self, decision: Decision) -> None:
        binding = await self._bind(decision)
        if binding is None:
            return
        waiter = self._waiters.pop(decision.request.request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(binding)
        elif binding.replica is not None:
            # Nobody waits any more (the client went away): release the request.
            self.plane.abort(binding.request_id)
            actor = self.replicas[binding.replica]
            if actor is not None:
                actor.abort.remote(binding.request_id)

    # -- planning -------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        period = self.config.tick_interval_ms / 1e3
        arrived = self._arrived = asyncio.Event()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), period)
            arrived.clear()
            now = time.time()
            for decision in self.plane.tick(now):
                self._handing(decision)  # before any plan can name it, not when its task runs
                self._spawn(self._resolve(decision))
            self._rebalance(now)
            for vr in self.plane.replicas:
                sent = self._plan_sent.get(vr.index)
                idle = sent is None or now - sent > PLAN_RESEND_S
                if vr.alive and idle and vr.has_work():
                    self._send_plan(vr.index, now)

    def _rebalance(self, now: float) -> None:
        """Take back the waiting best-effort requests of a replica far busier than another
        (ControlPlane.rebalance); not those of a replica whose mirror is being rebuilt."""
        handing = {rid for binding in self._binding.values() for rid in binding}
        handing.update(rid for r in self._rebuilds for rid in self.plane.replicas[r].held)
        for rid, replica in self.plane.rebalance(now, handing):
            actor = self.replicas[replica]
            if actor is not None:
                actor.release.remote(rid)

    def _send_plan(self, replica: int, now: float) -> None:
        """Plan the replica's next step from its mirror; none while the mirror is being
        rebuilt (the rebuild plans when done), so no plan or guarantee change the replica
        takes after its snapshot is lost with the mirror it came from."""
        if replica in self._rebuilds:
            return
        vr = self.plane.replicas[replica]
        promoted = vr.num_promoted
        try:
            plan = vr.next_plan(now)
        except (ValueError, ArithmeticError):
            # The replica keeps decoding on its own; the next report or tick tries again.
            log.exception("planning replica %d failed", replica)
            self.plane.metrics.inc("planner_errors")
            return
        finally:
            self.plane.metrics.inc("promoted", vr.num_promoted - promoted)
        if plan is None:
            self._plan_sent.pop(replica, None)
            return
        actor = self.replicas[replica]
        if actor is None:
            return
        self._plan_sent[replica] = now
        actor.set_plan.remote(plan, vr.take_regraded(self._binding[replica]))

    async def report(self, report: StepReport) -> None:
        """A replica executed a step: count it, fold it in and send that replica its next
        plan. The replicas' work is counted as it arrives, whatever the mirror makes of it (a
        report the mirror must be rebuilt for, or one a snapshot already holds)."""
        await self.ready()
        if report.executed:
            self.plane.metrics.count_step(report)
        if report.replica in self._rebuilds:
            self._rebuilds[report.replica].reports.append(report)
        elif self.plane.replicas[report.replica].alive:
            self._fold(report)

    def _fold(self, report: StepReport) -> ReportFit:
        """Fold a report in, then the held reports it lets follow, and plan for the replica
        after the last of them."""
        replica = report.replica
        fit = self._fold_one(report)
        while fit is ReportFit.APPLIED:
            following = self._ahead.get(replica, {}).pop(self.plane.replicas[replica].seq + 1, None)
            if following is None:
                self._send_plan(replica, time.time())
                break
            fit = self._fold_one(following)
        return fit

    def _fold_one(self, report: StepReport) -> ReportFit:
        vr = self.plane.replicas[report.replica]
        demoted, dropped = vr.num_demoted, vr.preempted_tokens
        credited, missed = vr.credited_tokens, vr.credit_missed_tokens
        try:
            fit = vr.apply(report)
        except Exception:  # a mirror that cannot fold a report is rebuilt, never left wrong
            log.exception("folding a report of replica %d failed; resyncing", report.replica)
            fit = ReportFit.RESYNC
        if fit is ReportFit.AHEAD:
            self._hold(report)
        elif fit is ReportFit.RESYNC:
            self._spawn(self._sync(report.replica))
        elif fit is ReportFit.APPLIED:
            self.plane.metrics.inc("preempted", len(report.plan.preempt))
            self.plane.metrics.inc("preempted_tokens", vr.preempted_tokens - dropped)
            self.plane.metrics.inc("demoted", vr.num_demoted - demoted)
            self.plane.metrics.inc("prefix_credited", vr.credited_tokens - credited)
            self.plane.metrics.inc("prefix_credit_missed", vr.credit_missed_tokens - missed)
        return fit

    def _hold(self, report: StepReport) -> None:
        """Keep a report past a gap until the reports before it come; rebuild the mirror if
        they have not within AHEAD_WAIT_S."""
        self._ahead.setdefault(report.replica, {})[report.seq] = report
        self._spawn(self._await_gap(report))

    async def _await_gap(self, report: StepReport) -> None:
        await asyncio.sleep(AHEAD_WAIT_S)
        if self._ahead.get(report.replica, {}).get(report.seq) is report:
            await self._sync(report.replica)

    # -- health ---------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            due = time.monotonic() + HEALTH_PERIOD_S
            await asyncio.sleep(HEALTH_PERIOD_S)
            late = time.monotonic() - due
            if late > HEALTH_PERIOD_S:  # this loop was held up: so were the doors' renewals
                self.leases.excuse(late, time.monotonic())
            self._watch_leases()
            up = self._up()
            died = await asyncio.gather(*(self._check(i, patient=True) for i in up))
            for slot, dead in zip(up, died, strict=True):
                self._count_death(slot, dead)
            self._refill()

    async def _check(self, replica: int, patient: bool = False) -> bool:
        """Whether the replica's health call failed as a dead actor's (Ray's
        `ActorDiedError`); a replica found down is marked so, one found back rebuilt.
        `patient` (the health loop's periodic check): no answer in time takes it down only
        the SLOW_CHECKS-th time in a row."""
        vr = self.plane.replicas[replica]
        actor = self.replicas[replica]
        if actor is None:  # stopped by the autoscaler since the loop listed it
            return False
        try:
            incarnation = await _within(actor.health.remote(), HEALTH_TIMEOUT_S)
        except (RayActorError, TimeoutError) as error:
            if self.replicas[replica] is not actor:  # stopped, or another started, meanwhile
                return False
            if patient and isinstance(error, TimeoutError):
                self._slow[replica] = self._slow.get(replica, 0) + 1
                if self._slow[replica] < SLOW_CHECKS:
                    log.warning("replica %d did not answer its health check in time", replica)
                    return False
            if vr.alive:
                log.warning("replica %d is down; its requests resume elsewhere", replica)
                self.plane.mark_dead(replica)
            return isinstance(error, ActorDiedError)
        self._slow.pop(replica, None)
        was_down = not vr.alive
        if was_down or incarnation != vr.incarnation:
            await self._sync(replica)
            if was_down and vr.alive:  # not a replica just started: it was found down
                log.info("replica %d is back; it takes requests", replica)
        return False

    def _count_death(self, slot: int, dead: bool) -> None:
        """Free the slot of a replica dead for good (DEAD_CHECKS health periods in a row:
        only the health loop counts, not the checks resumes make at once), for another to
        start."""
        if not dead:
            self._died.pop(slot, None)
            return
        self._died[slot] = self._died.get(slot, 0) + 1
        if self._died[slot] < DEAD_CHECKS or self.leases.closing:
            return
        log.error("replica %d is dead for good (Ray will not restart it); stopping it", slot)
        self.plane.metrics.inc("dead")
        self._stop_slot(slot)

    def _refill(self) -> None:
        """Start a replica in each of a fixed-size cluster's slots left empty by one dead for
        good, or by a start that failed (retried after START_RETRY_S); an autoscaled
        cluster's autoscaler starts what its target needs."""
        if self.autoscaler is not None or self.leases.closing or self._retry_in() > 0:
            return
        for slot in range(self.config.replicas):
            if self.replicas[slot] is None and slot not in self._starting:
                log.info("starting replica %d", slot)
                self._begin_start(slot)

    async def _sync(self, replica: int) -> None:
        """Rebuild a mirror from its replica's snapshot (or mark the replica down)."""
        actor = self.replicas[replica]
        if replica in self._rebuilds or actor is None:
            return
        held = self._ahead.pop(replica, {}).values()
        rebuild = self._rebuilds[replica] = _Rebuild(dict(self._binding[replica]))
        restored = False
        try:
            snapshot = await _within(actor.snapshot.remote(), HEALTH_TIMEOUT_S)
            if self.replicas[replica] is not actor:  # the autoscaler stopped it meanwhile
                return
            was_down = not self.plane.replicas[replica].alive
            self.plane.restore(replica, snapshot, time.time())
            if was_down:
                self._drop_moved(replica, snapshot)
            self.plane.metrics.inc("mirror_rebuilds")
            self.plane.metrics.inc("demoted", self.plane.replicas[replica].num_demoted)
            # Held since before the snapshot: another incarnation's are the past.
            rebuild.reports += [r for r in held if r.incarnation == snapshot.incarnation]
            self._wake_resumes()
            ended = set(snapshot.ended)
            for request, admitted in rebuild.binds.values():
                if request.request_id not in ended:
                    self._keep_bound(replica, request, admitted)
            restored = True
        except (RayActorError, TimeoutError):
            if self.replicas[replica] is actor:  # not a replica stopped or replaced meanwhile
                self.plane.mark_dead(replica)
        finally:
            del self._rebuilds[replica]
        if not restored:
            return
        # Those the snapshot reflects are stale; the rest are applied in order, until one
        # calls for another rebuild (which folds in what follows it, and plans).
        for report in sorted(rebuild.reports, key=lambda r: r.seq):
            if self._fold(report) is ReportFit.RESYNC:
                return
        self._send_plan(replica, time.time())

    def _drop_moved(self, replica: int, snapshot: ReplicaSnapshot) -> None:
        """A replica back from down (it hung) may hold requests that went on elsewhere while
        it was away (a stream resumed, a hand-off to it timed out): it ends them, rather
        than compute them for no one. Those no other replica holds stay."""
        elsewhere = {
            rid for vr in self.plane.replicas if vr.index != replica and vr.alive for rid in vr.held
        }
        for held in snapshot.requests:
            if held.request.request_id in elsewhere:
                self._end_copy(replica, held.request.request_id)

    def _end_copy(self, replica: int, request_id: str) -> None:
        self.plane.replicas[replica].abort(request_id)
        actor = self.replicas[replica]
        if actor is not None:
            actor.abort.remote(request_id)

    # -- autoscaling ----------------------------------------------------------------------------

    async def _scale_loop(self) -> None:
        assert self.autoscaler is not None
        while True:
            await asyncio.sleep(SCALE_PERIOD_S)
            if self.leases.closing:  # the last front door stops the replicas it finds
                return
            try:
                target = self.autoscaler.observe(self.plane.scale_sample(time.time()))
                self._resize(target)
                await self._retire_drained()
            except Exception:  # one bad round must not end autoscaling
                log.exception("autoscaling round failed")

    def _resize(self, target: int) -> None:
        draining = self.plane.draining
        serving = [i for i in self._up() if i not in draining]
        loads = self.plane.loads()
        steps = plan_resize(
            target, serving, sorted(self._starting), sorted(draining), lambda i: loads[i]
        )
        for slot in steps.undrain:
            log.info("autoscaler: replica %d is needed again; it stops draining", slot)
            draining.discard(slot)
            self._empty_since.pop(slot, None)
            self._wake_resumes()
        if not steps.start and not self._starting:
            self._start_error = ""  # no replica wanted now: no start is failing
        for _ in range(steps.start if self._retry_in() <= 0 else 0):
            slot = next(
                i for i, a in enumerate(self.replicas) if a is None and i not in self._starting
            )
            log.info("autoscaler: starting replica %d (target %d)", slot, target)
            self._begin_start(slot)
        for slot in steps.cancel:
            log.info("autoscaler: replica %d is no longer needed; stopping it", slot)
            self._starting.pop(slot).cancel()
        for slot in steps.drain:
            log.info("autoscaler: draining replica %d (target %d)", slot, target)
            self.plane.drain(slot)

    def _retry_in(self) -> float:
        """Seconds until a replica may be started after one failed to start (<= 0: now)."""
        return self._start_failed + START_RETRY_S - time.monotonic()

    def _begin_start(self, slot: int) -> None:
        task = asyncio.create_task(self._start_replica(slot))
        self._starting[slot] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_replica(self, slot: int) -> None:
        """Start a replica in an empty slot; it takes requests once its mirror is built."""
        # Imported here: it loads torch and the engine, which only a controller that starts
        # replicas needs.
        from cluster.replica_launch import start_replica

        if self.leases.closing:
            self._starting.pop(slot, None)
            return
        try:
            actor, group = await start_replica(self.config, slot, self.namespace, self.detached)
            self.replicas[slot], self.groups[slot] = actor, group
            await actor.info.remote()
            del self._starting[slot]
            self._start_error = ""
            await self._sync(slot)
        except asyncio.CancelledError:
            self._stop_slot(slot)
            raise
        except Exception as exc:  # a replica that cannot start must not hold its slot
            log.exception(
                "starting replica %d failed; the next start in %.0f s", slot, START_RETRY_S
            )
            self.plane.metrics.inc("start_failed")
            self._start_error = f"replica {slot}: {type(exc).__name__}: {exc}"
            self._start_failed = time.monotonic()
            self._starting.pop(slot, None)
            self._stop_slot(slot)

    async def _retire_drained(self) -> None:
        """Stop the draining replicas that finished what they held and whose streams the
        front doors pulled to the end (or DRAIN_GRACE_S after, should one never pull it)."""
        now = time.monotonic()
        for slot in sorted(self.plane.draining):
            actor = self.replicas[slot]
            if actor is None:
                self.plane.draining.discard(slot)
                continue
            if self._owes(slot):
                self._empty_since.pop(slot, None)
                continue
            try:
                held, unread = await _within(actor.open_work.remote(), HEALTH_TIMEOUT_S)
            except RayActorError:
                held, unread = 0, 0  # gone: its clients resume their requests elsewhere
            except TimeoutError:
                continue
            if held:
                self._empty_since.pop(slot, None)
                continue
            since = self._empty_since.setdefault(slot, now)
            if unread and now - since < DRAIN_GRACE_S:
                continue
            changed = self.replicas[slot] is not actor or slot not in self.plane.draining
            if changed or self._owes(slot):  # while we asked
                continue
            log.info("autoscaler: replica %d drained; stopping it", slot)
            self._empty_since.pop(slot, None)
            self._stop_slot(slot)

    def _owes(self, slot: int) -> bool:
        """The controller knows of work on the slot: held, being bound, waiting, rebuilding."""
        vr = self.plane.replicas[slot]
        return bool(
            vr.held or self._binding[slot] or self.plane.num_pending(slot) or slot in self._rebuilds
        )

    def _stop_slot(self, slot: int) -> None:
        """Kill a slot's replica for good and free its placement group (by name too: one
        being started may not have been handed back yet); the slot takes nothing after."""
        actor, group = self.replicas[slot], self.groups[slot]
        self.replicas[slot] = self.groups[slot] = None
        self._died.pop(slot, None)
        self._slow.pop(slot, None)
        self.plane.draining.discard(slot)
        self.plane.mark_dead(slot)
        self._plan_sent.pop(slot, None)
        self._ahead.pop(slot, None)
        if actor is None or group is None:
            named = slot_occupants(slot, self.namespace, self.config.num_gpus_per_replica > 0)
            actor = named[0] if actor is None else actor
            group = named[1] if group is None else group
        kill_for_good([actor] if actor is not None else [], [group])

    # -- status ---------------------------------------------------------------------------------

    async def status(self) -> ClusterStatus:
        await self.ready()
        statuses = (
            replace(
                self.plane.replicas[i].status(self.plane.num_pending(i)),
                draining=i in self.plane.draining,
            )
            for i in self._up()
        )
        return ClusterStatus(
            model=self.config.model_name,
            replicas=tuple(statuses),
            counters=dict(self.plane.metrics.counters),
            scheduler=self.config.scheduler.value,
            target_replicas=self.autoscaler.target if self.autoscaler is not None else 0,
            starting=len(self._starting),
            start_error=self._start_error,
        )

    async def moves_from(self, replica: int) -> bool:
        """Whether a stream stalled on the replica should resume elsewhere (a hung replica's
        streams never end by themselves): the health loop takes it for down, and another
        replica is up to take the stream. With none, the stream waits for this one."""
        await self.ready()
        routable = self.plane.routable()
        others = any(up for i, up in enumerate(routable) if i != replica)
        return not self.plane.replicas[replica].alive and others

    async def replica_handles(self) -> list[ActorHandle | None]:
        """Per slot, the replica a front door may stream from and ask for the model's limits
        (None: off, starting, or draining to stop)."""
        await self.ready()
        gone = set(self._starting) | self.plane.draining
        return [a if i not in gone else None for i, a in enumerate(self.replicas)]

    async def metrics(self) -> dict[str, object]:
        return self.plane.metrics.snapshot()


def kill_for_good(actors: Sequence[ActorHandle], groups: Sequence[PlacementGroup | None]) -> None:
    """Kill a cluster's actors without restart and free its placement groups (GPU replicas')."""
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for group in groups:
        if group is not None:
            remove_placement_group(group)


async def _within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)
