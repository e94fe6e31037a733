"""The controller's bookkeeping around a hand-off, against a real replica loop in this process:
calls that cross the Ray boundary there are held back here, so the races they allow run in a
fixed order."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from cluster import controller as controller_module
from cluster import handle as handle_module
from cluster.api import FinalRecord, TokenChunk, Verdict
from cluster.autoscale import AutoscaleConfig
from cluster.config import ClusterConfig
from cluster.control import Binding
from cluster.controller import ClusterController
from cluster.handle import ClusterHandle
from cluster.messages import ReplicaSnapshot, StepReport, StreamItem
from cluster.replica_core import ReplicaCore
from replica.batch import BatchOutcome, BatchPlan, DecodeStep
from replica.engine import Engine
from replica.planner.slos import SlosScheduler
from replica.request import SLO, Request, SamplingParams

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 64


class _Method:
    """`.remote(...)` as on an actor handle: the call runs as a task of this event loop, which
    a caller that stops waiting (a timeout) does not cancel, as Ray does not."""

    def __init__(self, call: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self._call = call

    def remote(self, *args: Any) -> Awaitable[Any]:
        return asyncio.shield(asyncio.ensure_future(self._call(*args)))


class LocalReplica:
    """The replica actor's methods the controller calls, on a real ReplicaCore. Gates hold
    back an add's reply (the request is added at once, as the actor does), a snapshot's
    reply (taken at once), and plans (dropped while closed, as if lost in transit)."""

    def __init__(self, core: ReplicaCore) -> None:
        self.core = core
        self.add_reply = _open()
        self.snapshot_reply = _open()
        self.plans = _open()
        self.snapshots: list[ReplicaSnapshot] = []
        self.failed_adds = 0
        """Adds to fail as a dead actor's calls do, before the request reaches the core."""
        self.down = False
        """Whether health checks fail, as a dead actor's do."""
        self.dead_checks = 0
        """Health checks to fail as Ray fails the calls to an actor it will not restart."""
        self.slow_checks = 0
        """Health checks to answer a second late (the replica or the controller held up)."""
        self.awake = _open()
        """Cleared: the replica hangs (a stopped process); its calls wait until it is set."""
        self.add_request = _Method(self._add_request)
        self.abort = _Method(self._abort)
        self.set_plan = _Method(self._set_plan)
        self.snapshot = _Method(self._snapshot)
        self.health = _Method(self._health)
        self.info = _Method(self._info)
        self.stream = _Streaming(core)

    async def _add_request(self, request: Request, admitted: bool) -> None:
        await self.awake.wait()
        if self.failed_adds or self.down:
            self.failed_adds = max(0, self.failed_adds - 1)
            raise RayActorError
        self.core.start()
        try:
            self.core.add_request(request, admitted)
        except ValueError as exc:  # as Ray raises an actor method's error at the caller
            raise RayTaskError("add_request", "traceback", exc).as_instanceof_cause() from exc
        await self.add_reply.wait()

    async def _abort(self, request_id: str, reason: str = "") -> None:
        self.core.abort(request_id, reason=reason)

    async def _set_plan(self, plan: BatchPlan, regraded: dict[str, bool] | None = None) -> None:
        if self.plans.is_set():
            self.core.start()
            self.core.set_plan(plan, regraded)

    async def _snapshot(self) -> ReplicaSnapshot:
        snapshot = self.core.snapshot()
        self.snapshots.append(snapshot)
        await self.snapshot_reply.wait()
        return snapshot

    async def _health(self) -> str:
        await self.awake.wait()
        if self.slow_checks:
            self.slow_checks -= 1
            await asyncio.sleep(1.0)
        if self.dead_checks:
            self.dead_checks -= 1
            raise ActorDiedError
        if self.down:
            raise RayActorError
        return self.core.incarnation

    async def _info(self) -> tuple[int, int]:
        return self.core.engine.max_model_len, self.core.engine.target.vocab_size


class _Streaming:
    """`stream.options(num_returns="streaming").remote(rid)` as on the replica actor: the
    request's stream items, each behind an awaitable (Ray's object refs)."""

    def __init__(self, core: ReplicaCore) -> None:
        self.core = core

    def options(self, **_: Any) -> _Streaming:
        return self

    async def remote(self, request_id: str) -> AsyncIterator[Awaitable[StreamItem]]:
        async for item in self.core.stream(request_id):
            ready: asyncio.Future[StreamItem] = asyncio.get_running_loop().create_future()
            ready.set_result(item)
            yield ready


def _open() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


@pytest.fixture(scope="module")
def engine(target_dir: Path) -> Engine:
    return Engine.from_dirs(target_dir, num_blocks=NUM_BLOCKS)


@pytest.fixture
def config(target_dir: Path, profile_path: Path, monkeypatch: pytest.MonkeyPatch) -> ClusterConfig:
    """One replica; the controller runs outside an actor, so it is told it was not restarted.
    A report past a gap waits 50 ms, not AHEAD_WAIT_S, for those before it."""
    monkeypatch.setattr(
        controller_module.ray,
        "get_runtime_context",
        lambda: SimpleNamespace(was_current_actor_reconstructed=False),
    )
    monkeypatch.setattr(controller_module, "AHEAD_WAIT_S", 0.05)
    return ClusterConfig(
        model=str(target_dir),
        profile=str(profile_path),
        replicas=1,
        num_kv_blocks=NUM_BLOCKS,
        spec_policy="none",
    )


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The actors the controller kills for good, recorded instead (there is no Ray here)."""
    actors: list[object] = []
    monkeypatch.setattr(controller_module, "kill_for_good", lambda a, _: actors.extend(a))
    return actors


def reporting(engine: Engine, reports: list[ClusterController]) -> LocalReplica:
    """A replica on `engine` whose reports the controller in `reports` folds in as they come
    (put there once built: a controller takes its replicas when it is made)."""
    core = ReplicaCore(engine, 0, lambda r: asyncio.ensure_future(reports[0].report(r)))
    return LocalReplica(core)


def start(engine: Engine, config: ClusterConfig) -> tuple[ClusterController, LocalReplica]:
    """A controller and its replica on the running loop, reports folded in as they come."""
    reports: list[ClusterController] = []
    replica = reporting(engine, reports)
    controller = ClusterController(config, [replica])
    reports.append(controller)
    return controller, replica


def request(rid: str, max_tokens: int) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    return Request(rid, [11, 200, 31, 400, 9], sampling, SLO(3000, 500), arrival_time=time.time())


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


async def finish(replica: LocalReplica, rid: str) -> str | None:
    """Read the request's stream on the replica to its end: its finish reason."""

    def reached() -> bool:
        snapshot = replica.core.snapshot()
        return rid in snapshot.ended or any(h.request.request_id == rid for h in snapshot.requests)

    await until(reached, f"{rid} reached the replica")
    items = [item async for item in replica.core.stream(rid)]
    return items[-1].finish_reason


def gap(replica: LocalReplica) -> StepReport:
    """A report from well past the mirror's step, whose gap no report fills: the controller
    rebuilds the mirror once AHEAD_WAIT_S has passed."""
    outcome = BatchOutcome(outcomes=[], free_blocks=NUM_BLOCKS)
    return StepReport(0, replica.core.incarnation, replica.core.seq + 5, BatchPlan(()), outcome, 0)


async def ended_while_bound(
    engine: Engine, config: ClusterConfig, rid: str
) -> tuple[ClusterController, LocalReplica, asyncio.Task[Binding]]:
    """A request the replica ran to its end while the reply to its add is held back."""
    controller, replica = start(engine, config)
    await controller.ready()
    replica.add_reply.clear()
    submit = asyncio.create_task(controller.submit(request(rid, 4)))
    assert await finish(replica, rid) == "length"
    return controller, replica, submit


def holds_nothing(controller: ClusterController) -> bool:
    vr = controller.plane.replicas[0]
    return not vr.held and not vr.scheduler.has_unfinished()


def test_a_request_that_ends_before_its_hand_off_returns_leaves_no_trace(
    engine: Engine, config: ClusterConfig
) -> None:
    """The replica may run a request to its end (the controller plans it from the moment the
    plane accepts it) before the add's reply is back; the mirror must not take it back then,
    or the replica looks busy for good."""

    async def run() -> None:
        controller, replica, submit = await ended_while_bound(engine, config, "quick")
        await until(lambda: "quick" not in controller.plane.replicas[0].held, "the end folded")
        replica.add_reply.set()
        assert (await submit).verdict is Verdict.ADMITTED
        assert holds_nothing(controller)
        status = (await controller.status()).replicas[0]
        assert (status.running, status.admitted, status.kv_usage) == (0, 0, 0.0)
        await replica.core.stop()

    asyncio.run(run())


def test_a_rebuild_leaves_out_a_request_being_bound_that_already_ended(
    engine: Engine, config: ClusterConfig
) -> None:
    async def run() -> None:
        controller, replica, submit = await ended_while_bound(engine, config, "ended")
        mirror = controller.plane.replicas[0].scheduler
        await controller.report(gap(replica))
        await until(lambda: controller.plane.replicas[0].scheduler is not mirror, "a rebuild")
        assert "ended" in replica.snapshots[-1].ended
        replica.add_reply.set()
        assert (await submit).verdict is Verdict.ADMITTED
        assert holds_nothing(controller)
        await replica.core.stop()

    asyncio.run(run())


def test_a_rebuild_from_a_snapshot_older_than_a_hand_off_keeps_the_request(
    engine: Engine, config: ClusterConfig
) -> None:
    """The snapshot is taken before the add reaches the replica and lands after the hand-off
    returned: the request is put back in the mirror, which plans it to its end."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.snapshot_reply.clear()
        replica.plans.clear()
        await controller.report(gap(replica))
        await until(lambda: len(replica.snapshots) == 2, "a snapshot is taken")
        binding = await controller.submit(request("late", 6))
        assert binding.verdict is Verdict.ADMITTED
        assert not replica.snapshots[-1].requests
        replica.plans.set()
        replica.snapshot_reply.set()
        assert await asyncio.wait_for(finish(replica, "late"), 20) == "length"
        await until(lambda: holds_nothing(controller), "the mirror folded the end")
        await replica.core.stop()

    asyncio.run(run())


def test_a_report_that_comes_during_a_rebuild_is_folded_in_after_it(
    engine: Engine, config: ClusterConfig
) -> None:
    """A request the replica ends while the controller waits for its snapshot (taken before
    the end): the end's report is the replica's last word on it, so it must not be dropped,
    or the rebuilt mirror keeps the request for good."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.plans.clear()  # the request waits for its prefill: the replica runs no step
        await controller.submit(request("gone", 6))
        replica.snapshot_reply.clear()
        mirror = controller.plane.replicas[0].scheduler
        await controller.report(gap(replica))
        await until(lambda: len(replica.snapshots) == 2, "a snapshot is taken")
        assert [h.request.request_id for h in replica.snapshots[-1].requests] == ["gone"]
        replica.core.abort("gone")  # its client went away
        await until(lambda: "gone" in replica.core.snapshot().ended, "the replica ended it")
        replica.snapshot_reply.set()
        await until(lambda: controller.plane.replicas[0].scheduler is not mirror, "a rebuild")
        await until(lambda: holds_nothing(controller), "the end folded in")
        await replica.core.stop()

    asyncio.run(run())


def test_a_report_of_another_incarnation_during_a_rebuild_calls_for_another(
    engine: Engine, config: ClusterConfig
) -> None:
    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.snapshot_reply.clear()
        await controller.report(gap(replica))
        await until(lambda: len(replica.snapshots) == 2, "a snapshot is taken")
        stranger = dataclasses.replace(gap(replica), incarnation="restarted", seq=1)
        await controller.report(stranger)
        replica.snapshot_reply.set()
        await until(lambda: len(replica.snapshots) == 3, "a second rebuild")
        await replica.core.stop()

    asyncio.run(run())


def test_the_replicas_steps_count_also_when_the_mirror_is_rebuilt_for_them(
    engine: Engine, config: ClusterConfig
) -> None:
    """The replicas' work is counted as it arrives: the step of a report the mirror is
    rebuilt for, and of a stale one (the snapshot holds it), count as any other; every
    rebuild is counted, the first build at start included."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        counters = controller.plane.metrics.counters
        assert counters["mirror_rebuilds"] == 1
        steps, busy = counters.get("steps", 0), counters.get("busy_us", 0)
        replica.snapshot_reply.clear()
        worked = dataclasses.replace(
            gap(replica),
            plan=BatchPlan((DecodeStep("elsewhere"),)),
            outcome=BatchOutcome(outcomes=[], target_s=0.25, free_blocks=NUM_BLOCKS),
        )
        await controller.report(worked)
        await until(lambda: len(replica.snapshots) == 2, "a snapshot is taken")
        await controller.report(dataclasses.replace(worked, seq=replica.core.seq))
        assert counters["steps"] == steps + 2 and counters["busy_us"] == busy + 500_000
        replica.snapshot_reply.set()
        await until(lambda: counters["mirror_rebuilds"] == 2, "the rebuild")
        assert counters["steps"] == steps + 2
        await replica.core.stop()

    asyncio.run(run())


def test_a_resume_handed_to_a_replica_found_down_waits_for_it_to_come_back(
    engine: Engine, config: ClusterConfig
) -> None:
    """The replica a resumed request is handed to fails the hand-off (it died since the
    controller last saw it): the resume waits for a replica to be up again, here the same one
    back at the next health check, rather than end with "no replica is up"."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.failed_adds = 1
        original = request("moved", 8)
        binding = await asyncio.wait_for(controller.resume(original, [7, 7], 0), 20)
        assert replica.failed_adds == 0  # the first hand-off failed
        assert binding.verdict in (Verdict.ADMITTED, Verdict.BEST_EFFORT)
        assert await asyncio.wait_for(finish(replica, "moved"), 20) == "length"
        assert controller.plane.metrics.counters["migrated"] == 1
        await replica.core.stop()

    asyncio.run(run())


def test_a_resume_aborted_while_it_waits_for_a_replica_ends_at_once(
    engine: Engine, config: ClusterConfig
) -> None:
    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.down = True
        resume = asyncio.create_task(controller.resume(request("gone", 8), [7], 0))
        await until(lambda: not controller.plane.replicas[0].alive, "the replica is seen down")
        await asyncio.sleep(0.05)
        assert not resume.done()  # waiting for a replica
        await controller.abort("gone")
        binding = await asyncio.wait_for(resume, 5)
        assert binding.verdict is None and binding.reason == "aborted while waiting for a replica"
        replica.down = False
        await replica.core.stop()

    asyncio.run(run())


def test_a_retried_submit_gets_the_binding_and_leaves_the_request_where_it_runs(
    engine: Engine, config: ClusterConfig
) -> None:
    """The replica refuses a second add of a request it holds (AlreadyHeld), which the
    controller takes as handed over: the refusal had aborted the request in the mirror, which
    lost it, and rejected the retry. The binding names the replica's actor (a front door's
    list of actors may hold another one in that slot)."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        r = request("again", 200)
        first = await controller.submit(r)
        assert first.actor is replica
        rejected = controller.plane.metrics.counters.get("rejected", 0)
        assert await controller.submit(r) == first
        assert "again" in controller.plane.replicas[0].held
        assert "again" in {h.request.request_id for h in replica.core.snapshot().requests}
        assert controller.plane.metrics.counters.get("rejected", 0) == rejected
        await replica.core.stop()

    asyncio.run(run())


def test_a_request_the_replica_holds_before_its_hand_off_is_not_rejected(
    engine: Engine, config: ClusterConfig
) -> None:
    """A controller restarted during a hand-off: the replica took the request from the one
    before, after its snapshot for the new one's mirror, which then hands it over again."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        r = request("early", 200)
        replica.core.add_request(r, True)
        binding = await controller.submit(r)
        assert binding.verdict is Verdict.ADMITTED
        assert "early" in controller.plane.replicas[0].held
        assert "early" in {h.request.request_id for h in replica.core.snapshot().requests}
        assert not controller.plane.metrics.counters.get("rejected", 0)
        await replica.core.stop()

    asyncio.run(run())


def test_the_promotions_of_a_replan_are_counted_also_when_the_planning_fails(
    engine: Engine, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        vr = controller.plane.replicas[0]
        counters = controller.plane.metrics.counters

        def promoting(fail: bool) -> Callable[[float], BatchPlan | None]:
            def next_plan(now: float) -> BatchPlan | None:
                assert isinstance(vr.scheduler, SlosScheduler)
                vr.scheduler.num_promoted += 1
                if fail:
                    raise ValueError("the batch could not be formed")
                return None

            return next_plan

        for fail in (False, True):
            monkeypatch.setattr(vr, "next_plan", promoting(fail))
            controller._send_plan(0, time.time())
        assert counters["promoted"] == 2 and counters["planner_errors"] == 1
        await replica.core.stop()

    asyncio.run(run())


def test_a_guarantee_given_up_reaches_the_replica_with_the_next_plan(
    engine: Engine, config: ClusterConfig
) -> None:
    """A request admitted half a second before its first token's deadline, whose plans are
    lost until the deadline passed: its late first token costs it the guarantee, and the
    replica's snapshot, which a rebuilt mirror starts from, holds it best-effort."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.plans.clear()
        late = dataclasses.replace(request("late", 400), arrival_time=time.time() - 2.5)
        assert (await controller.submit(late)).verdict is Verdict.ADMITTED
        assert [h.admitted for h in replica.core.snapshot().requests] == [True]
        await asyncio.sleep(0.6)
        replica.plans.set()  # the tick loop sends the plan again
        await until(
            lambda: [h.admitted for h in replica.core.snapshot().requests] == [False],
            "the replica holds the request best-effort",
        )
        assert controller.plane.replicas[0].num_demoted == 1
        await replica.core.stop()

    asyncio.run(run())


def test_a_guarantee_change_waits_for_its_requests_hand_off(
    engine: Engine, config: ClusterConfig
) -> None:
    """The mirror plans a request from the moment the plane accepts it, so it may give up
    (or grant) a guarantee before the replica has the request: a plan sent then could reach
    a replica that does not know the id yet, which ignores it. The change waits for the
    hand-off to return, and goes with the plan sent after it."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        vr = controller.plane.replicas[0]
        replica.plans.clear()
        replica.add_reply.clear()
        late = dataclasses.replace(request("late", 400), arrival_time=time.time() - 2.5)
        submit = asyncio.ensure_future(controller.submit(late))
        await until(lambda: "late" in controller._binding[0], "the hand-off began")
        await asyncio.sleep(0.6)
        replica.plans.set()
        await until(lambda: vr.num_demoted == 1, "the late first token was folded")
        assert vr.regraded == {"late": False}
        assert [h.admitted for h in replica.core.snapshot().requests] == [True]
        replica.add_reply.set()
        assert (await submit).verdict is Verdict.ADMITTED
        assert not vr.regraded
        assert [h.admitted for h in replica.core.snapshot().requests] == [False]
        await replica.core.stop()

    asyncio.run(run())


def test_a_front_door_announces_a_promoted_request_as_admitted(
    engine: Engine, config: ClusterConfig
) -> None:
    """A tight request declined while another tight one decodes waits best-effort; once
    that one's stream closes, the next replan guarantees it and the replica, told with the
    plan, marks its first token: the client's first chunk and record say admitted.

    Plans are dropped from its arrival until the close is folded, or leftovers would serve
    it first (the running request is ahead of its deadlines), and replans come on arrivals
    only until then, on the planner's timer after."""
    tight = SLO(ttft_ms=1500, tpot_ms=100)  # the profile fits one such decoder, not two

    def arriving(rid: str, prompt: list[int], max_tokens: int) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), tight)

    async def run() -> tuple[TokenChunk | FinalRecord, FinalRecord, dict[str, int]]:
        controller, replica = start(engine, config)
        await controller.ready()
        vr = controller.plane.replicas[0]
        assert isinstance(vr.scheduler, SlosScheduler)
        invocation = vr.scheduler.invocation
        planned = invocation.config
        invocation.config = dataclasses.replace(planned, interval_s=60.0)
        door = SimpleNamespace(submit=_Method(controller.submit), abort=_Method(controller.abort))
        handle = ClusterHandle(
            config, door, [replica], engine.max_model_len, engine.target.vocab_size
        )
        running = handle.submit(arriving("running", [11, 200, 31], 400))
        assert isinstance(await anext(running), TokenChunk)
        replica.plans.clear()
        deferred = handle.submit(arriving("deferred", [12, 13], 8))
        first = asyncio.ensure_future(anext(deferred))
        await until(lambda: "deferred" in vr.held, "the deferred request is bound")
        assert "deferred" not in vr.admitted
        await running.aclose()
        await until(
            lambda: (
                [h.request.request_id for h in replica.core.snapshot().requests] == ["deferred"]
            ),
            "the replica ended the running request",
        )
        await until(lambda: "running" not in vr.held, "the mirror let it go")
        invocation.config = planned
        replica.plans.set()
        head = await asyncio.wait_for(first, 20)
        *_, record = [item async for item in deferred]
        await replica.core.stop()
        return head, record, controller.plane.metrics.counters

    head, record, counters = asyncio.run(run())
    assert isinstance(head, TokenChunk) and head.placement is not None
    assert head.placement.verdict is Verdict.ADMITTED
    assert isinstance(record, FinalRecord) and record.verdict is Verdict.ADMITTED
    assert record.slo_attained and counters["promoted"] == 1


def test_reports_out_of_order_are_folded_in_order_and_a_gap_that_stays_rebuilds(
    engine: Engine, config: ClusterConfig
) -> None:
    """Ray may run an async actor's calls out of order: a report past a gap waits for the
    one before it, and both are folded in order without a rebuild. A gap no report fills
    (a failed step sends none) rebuilds the mirror once AHEAD_WAIT_S has passed."""

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        vr = controller.plane.replicas[0]
        counters = controller.plane.metrics.counters
        base = vr.seq
        quiet = BatchOutcome(outcomes=[], free_blocks=NUM_BLOCKS)

        def report(seq: int) -> StepReport:
            return StepReport(0, replica.core.incarnation, seq, BatchPlan(()), quiet, 0.0)

        await controller.report(report(base + 2))
        assert vr.seq == base
        await controller.report(report(base + 1))
        assert vr.seq == base + 2 and counters["mirror_rebuilds"] == 1
        await controller.report(report(base + 4))
        await asyncio.sleep(0.02)
        assert vr.seq == base + 2 and counters["mirror_rebuilds"] == 1
        await until(lambda: counters["mirror_rebuilds"] == 2, "a rebuild")
        await replica.core.stop()

    asyncio.run(run())


@pytest.mark.parametrize("scaled", [False, True], ids=["fixed", "autoscaled"])
def test_a_replica_dead_for_good_is_replaced_and_its_request_resumes_on_the_new_one(
    engine: Engine,
    target_dir: Path,
    config: ClusterConfig,
    monkeypatch: pytest.MonkeyPatch,
    killed: list[object],
    scaled: bool,
) -> None:
    """Calls failing as dead (Ray's `ActorDiedError`) DEAD_CHECKS health checks in a row:
    Ray will not restart the replica (its restart failed in `__init__`, or it was killed
    without restart), so the controller kills it for good and starts another in its slot (an
    autoscaled cluster's autoscaler does, for its target); a start that fails is tried again
    START_RETRY_S later. Fewer dead checks in a row (a call in flight when a replica crashed
    and Ray restarted it) replace nothing."""
    if scaled:
        config = dataclasses.replace(config, autoscale=AutoscaleConfig(max_replicas=1))
    monkeypatch.setattr(controller_module, "HEALTH_PERIOD_S", 0.02)
    monkeypatch.setattr(controller_module, "SCALE_PERIOD_S", 0.02)
    monkeypatch.setattr(controller_module, "START_RETRY_S", 0.2)
    starts: list[LocalReplica | None] = []
    started_at: list[float] = []

    async def run() -> None:
        controller, replica = start(engine, config)
        adopted = (replica, None) if scaled else (None, None)  # by name, until it is killed
        monkeypatch.setattr(
            controller_module, "slot_occupants", lambda *_: (None, None) if killed else adopted
        )

        async def start_replica(*_: object) -> tuple[LocalReplica, None]:
            started_at.append(time.monotonic())
            if not starts:  # the first start fails
                starts.append(None)
                raise RuntimeError("no resources")
            new = reporting(Engine.from_dirs(target_dir, num_blocks=NUM_BLOCKS), [controller])
            starts.append(new)
            return new, None

        monkeypatch.setattr("cluster.replica_launch.start_replica", start_replica)
        await controller.ready()
        for _ in range(2):  # each time, fewer in a row than it takes
            replica.dead_checks = controller_module.DEAD_CHECKS - 1
            await until(lambda: replica.dead_checks == 0, "the dead checks ran")
            await asyncio.sleep(0.2)
            assert not killed and not starts and controller.plane.replicas[0].alive
        replica.dead_checks = 10**6
        await until(lambda: killed == [replica], "the dead replica was stopped")
        counters = controller.plane.metrics.counters
        await until(lambda: counters.get("start_failed") == 1, "the first start failed")
        assert (await controller.status()).start_error == "replica 0: RuntimeError: no resources"
        await until(lambda: len(starts) == 2, "a second start, once the first failed")
        assert started_at[1] - started_at[0] >= controller_module.START_RETRY_S
        new = starts[1]
        assert new is not None
        await until(lambda: controller.replicas[0] is new, "the new replica took the slot")
        await until(lambda: controller.plane.replicas[0].alive, "the new replica's mirror")
        assert (await controller.status()).start_error == ""
        assert counters["start_failed"] == 1
        binding = await asyncio.wait_for(controller.resume(request("moved", 8), [7], 0), 20)
        assert binding.replica == 0 and binding.actor is new
        assert await asyncio.wait_for(finish(new, "moved"), 20) == "length"
        assert killed == [replica] and controller.plane.metrics.counters["dead"] == 1
        await replica.core.stop()
        await new.core.stop()

    asyncio.run(run())


def test_the_checks_resumes_make_at_once_do_not_count_toward_dead_for_good(
    engine: Engine, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch, killed: list[object]
) -> None:
    """Every resume checks the failed replica when no other is up; five at once used to
    count five dead checks in an instant, so a crash Ray restarts could be taken for dead for
    good. Only the health loop counts, once a period."""
    monkeypatch.setattr(controller_module, "HEALTH_PERIOD_S", 60.0)

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.dead_checks = 10
        rids = [f"moved-{i}" for i in range(5)]
        resumes = [asyncio.create_task(controller.resume(request(r, 8), [7], 0)) for r in rids]
        await until(lambda: replica.dead_checks == 5, "each resume checked the replica")
        await asyncio.sleep(0.05)
        assert not killed and "dead" not in controller.plane.metrics.counters
        assert controller.replicas[0] is replica
        for rid in rids:
            await controller.abort(rid)
        await asyncio.wait_for(asyncio.gather(*resumes), 5)
        await replica.core.stop()

    asyncio.run(run())


def test_a_restarted_detached_controller_takes_the_replica_running_under_the_slots_name(
    engine: Engine, target_dir: Path, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A detached cluster's replacement outlives the controller that started it: a restarted
    controller, given the launcher's list, takes the replica named for the slot instead."""

    async def run() -> None:
        reports: list[ClusterController] = []
        named = reporting(Engine.from_dirs(target_dir, num_blocks=NUM_BLOCKS), reports)
        launched = LocalReplica(ReplicaCore(engine, 0, lambda r: None))
        monkeypatch.setattr(controller_module, "slot_occupants", lambda *_: (named, None))
        controller = ClusterController(config, [launched], detached=True)
        reports.append(controller)
        await controller.ready()
        assert controller.replicas[0] is named and named.snapshots and not launched.snapshots
        binding = await controller.submit(request("here", 4))
        assert binding.actor is named
        assert await asyncio.wait_for(finish(named, "here"), 20) == "length"
        await named.core.stop()

    asyncio.run(run())


@pytest.mark.usefixtures("killed")
def test_a_start_in_flight_when_the_last_door_leaves_is_stopped(
    engine: Engine, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last door stops the replicas it finds by name; one a start would name after that
    must not outlive the cluster, so the door's leaving cancels the starts in flight."""
    monkeypatch.setattr(controller_module, "HEALTH_PERIOD_S", 0.02)
    monkeypatch.setattr(controller_module, "slot_occupants", lambda *_: (None, None))
    began = asyncio.Event()
    ended: list[str] = []

    async def start_replica(*_: object) -> tuple[LocalReplica, None]:
        began.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.append("cancelled")
        raise AssertionError("unreachable")

    monkeypatch.setattr("cluster.replica_launch.start_replica", start_replica)

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        assert await controller.attach("door")
        replica.dead_checks = 10**6
        await asyncio.wait_for(began.wait(), 10)
        assert 0 in controller._starting
        assert await controller.release("door")
        await until(lambda: ended == ["cancelled"], "the start was cancelled")
        assert not controller._starting and controller.replicas[0] is None
        await asyncio.sleep(0.1)
        assert not controller._starting  # and no other start
        await replica.core.stop()

    asyncio.run(run())


def test_a_replica_late_to_answer_its_health_check_is_down_only_when_late_twice_in_a_row(
    engine: Engine, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine one late answer is no failure: the replica stays routable and its
    mirror untouched. SLOW_CHECKS late answers in a row take it down, and it is rebuilt once
    it answers again."""
    monkeypatch.setattr(controller_module, "HEALTH_PERIOD_S", 0.02)
    monkeypatch.setattr(controller_module, "HEALTH_TIMEOUT_S", 0.1)

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        counters = controller.plane.metrics.counters
        vr = controller.plane.replicas[0]
        rebuilt = counters["mirror_rebuilds"]
        downs = []
        mark_dead = controller.plane.mark_dead
        monkeypatch.setattr(
            controller.plane, "mark_dead", lambda i: (downs.append(i), mark_dead(i))
        )
        replica.slow_checks = controller_module.SLOW_CHECKS - 1
        await until(lambda: replica.slow_checks == 0, "the late checks ran")
        await asyncio.sleep(0.3)
        assert vr.alive and not downs and counters["mirror_rebuilds"] == rebuilt
        replica.slow_checks = controller_module.SLOW_CHECKS
        await until(lambda: downs == [0], "the replica taken for down")
        await until(lambda: counters["mirror_rebuilds"] == rebuilt + 1, "its mirror rebuilt")
        assert vr.alive
        await replica.core.stop()

    asyncio.run(run())


@pytest.fixture(scope="module")
def second_engine(target_dir: Path) -> Engine:
    return Engine.from_dirs(target_dir, num_blocks=NUM_BLOCKS)


def start_two(
    engines: tuple[Engine, Engine], config: ClusterConfig
) -> tuple[ClusterController, LocalReplica, LocalReplica]:
    reports: list[ClusterController] = []

    def replica(index: int) -> LocalReplica:
        report = lambda r: asyncio.ensure_future(reports[0].report(r))  # noqa: E731
        return LocalReplica(ReplicaCore(engines[index], index, report))

    first, second = replica(0), replica(1)
    controller = ClusterController(dataclasses.replace(config, replicas=2), [first, second])
    reports.append(controller)
    return controller, first, second


def test_a_request_a_hung_replica_does_not_take_is_bound_elsewhere_and_dropped_there(
    engine: Engine,
    second_engine: Engine,
    config: ClusterConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica that hung just before a hand-off held its request, and the client, for as
    long as it hung (20-40 s live). The hand-off now times out: the request goes to the other
    replica, and the hung one, once back, ends the copy it took (and the log says it is back:
    it said only that it was down)."""
    monkeypatch.setattr(controller_module, "HAND_OFF_TIMEOUT_S", 0.2)

    async def run() -> None:
        controller, hung, other = start_two((engine, second_engine), config)
        await controller.ready()
        hung.awake.clear()
        # Long enough that the copy cannot end by itself before the health loop sees the
        # replica back (it ended first once, on a loaded machine, at 64 tokens).
        binding = await asyncio.wait_for(controller.submit(request("bound", 600)), 10)
        assert binding.replica == 1 and binding.verdict in (Verdict.ADMITTED, Verdict.BEST_EFFORT)
        hung.awake.set()  # takes the request it was handed, as Ray delivers the call now
        assert await asyncio.wait_for(finish(hung, "bound"), 20) == "abort"
        assert await asyncio.wait_for(finish(other, "bound"), 40) == "length"
        assert controller.plane.replicas[0].alive
        assert "replica 0 is back; it takes requests" in caplog.text
        await hung.core.stop()
        await other.core.stop()

    asyncio.run(run())


def test_a_hand_off_that_times_out_on_the_only_replica_waits_for_it(
    engine: Engine,
    config: ClusterConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With no other replica the requests wait for this one, and keep the copies it took.
    The log says once that it did not take them (it said so once per hand-off)."""
    monkeypatch.setattr(controller_module, "HAND_OFF_TIMEOUT_S", 0.2)

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        replica.awake.clear()
        rids = ["waits", "waits-too", "waits-three"]
        submits = [asyncio.create_task(controller.submit(request(rid, 8))) for rid in rids]
        await asyncio.sleep(0.5)  # the hand-offs timed out; they wait for a replica
        assert not any(s.done() for s in submits) and not controller.plane.replicas[0].alive
        replica.awake.set()
        for submit in submits:
            binding = await asyncio.wait_for(submit, 10)
            assert binding.replica == 0
            assert binding.verdict in (Verdict.ADMITTED, Verdict.BEST_EFFORT)
        for rid in rids:
            assert await asyncio.wait_for(finish(replica, rid), 20) == "length"
        assert caplog.text.count("replica 0 did not take a request in time") == 1
        assert "replica 0 is back; it takes requests" in caplog.text
        await replica.core.stop()

    asyncio.run(run())


def test_a_stalled_stream_moves_only_from_a_replica_down_with_another_up(
    engine: Engine, second_engine: Engine, config: ClusterConfig
) -> None:
    async def run() -> None:
        controller, first, second = start_two((engine, second_engine), config)
        await controller.ready()
        assert not await controller.moves_from(0)  # up
        controller.plane.mark_dead(0)
        assert await controller.moves_from(0)
        controller.plane.mark_dead(1)
        assert not await controller.moves_from(0)  # nowhere to go: it waits for replica 0
        await first.core.stop()
        await second.core.stop()

    asyncio.run(run())


def test_streams_stalled_on_one_replica_ask_the_controller_once_between_them(
    engine: Engine, second_engine: Engine, config: ClusterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stalled stream asked for itself every STALL_CHECK_S: 1,000 best-effort streams
    queued for their first token made 333 controller calls a second. Now those on one
    replica share one answer for MOVE_ANSWER_S; a stream that stops waiting leaves it to the
    others, and a later question is asked again."""
    monkeypatch.setattr(handle_module, "MOVE_ANSWER_S", 0.2)

    async def run() -> None:
        controller, first, second = start_two((engine, second_engine), config)
        await controller.ready()
        asked: list[int] = []

        async def moves_from(replica: int) -> bool:
            asked.append(replica)
            await asyncio.sleep(0.05)
            return await controller.moves_from(replica)

        door = SimpleNamespace(moves_from=_Method(moves_from))
        handle = ClusterHandle(config, door, [first, second], 64, 64)
        on = [Binding(f"r{i}", Verdict.BEST_EFFORT, i % 2, 1) for i in range(40)]
        left = asyncio.ensure_future(handle._moves(on[0]))
        await asyncio.sleep(0)
        left.cancel()
        assert await asyncio.gather(*(handle._moves(b) for b in on)) == [False] * 40
        assert sorted(asked) == [0, 1]
        controller.plane.mark_dead(0)
        assert await handle._moves(on[0]) is False  # the answer of a moment ago
        await asyncio.sleep(0.2)
        assert await handle._moves(on[0]) is True
        assert sorted(asked) == [0, 0, 1]
        await first.core.stop()
        await second.core.stop()

    asyncio.run(run())


def test_prefix_credits_are_counted_as_the_prefills_begin(
    target_dir: Path, config: ClusterConfig
) -> None:
    """Agent QA saw prefix_credited_tokens pass the cache's hits (731,760 against 719,232):
    a credit was counted at each bind, and a request moved or aborted before its prefill
    dropped its credit there uncounted. Counted as the prefill begins, the credited tokens
    less the missed ones are tokens the replica found cached."""

    engine = Engine.from_dirs(target_dir, num_blocks=NUM_BLOCKS, prefix_caching=True)

    async def run() -> None:
        controller, replica = start(engine, config)
        await controller.ready()
        shared = list(range(100, 164))
        ask = lambda rid, tail: Request(  # noqa: E731
            rid, [*shared, *tail], SamplingParams(max_tokens=2), SLO(30_000, 5_000)
        )
        await controller.submit(ask("first", [1]))
        assert await finish(replica, "first") == "length"
        vr = controller.plane.replicas[0]
        await until(lambda: "first" not in vr.held, "the mirror folded its end")
        replica.plans.clear()  # bound, but no plan reaches the replica: no prefill begins
        await controller.submit(ask("withdrawn", [2]))
        credit = vr.credits["withdrawn"]
        assert credit > 0
        await controller.abort("withdrawn")
        replica.plans.set()
        await controller.submit(ask("second", [3]))
        assert await finish(replica, "second") == "length"
        await until(lambda: "second" not in vr.held, "the mirror folded its end")
        counters = controller.plane.metrics.counters
        assert counters.get("prefix_credited", 0) == credit
        found = counters["prefix_credited"] - counters.get("prefix_credit_missed", 0)
        assert 0 < found <= counters["prefix_cache_hits"]
        await replica.core.stop()

    asyncio.run(run())
