"""The controller's mirror of a replica, driven by the perf-model executor (no Ray)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.messages import HeldRequest, ReplicaSnapshot, StepReport
from cluster.virtual_replica import ReportFit, SchedulerConfig, VirtualReplica
from replica.batch import BatchOutcome, BatchPlan, DecodeStep, PrefillChunk, RequestOutcome
from replica.perf_model import BatchShape, PerfModel
from replica.planner.base import CacheBudget
from replica.planner.config import PlannerConfig, SpecConfig
from replica.planner.executor import PerfExecutor
from replica.planner.sarathi import SarathiConfig
from replica.planner.slos import SlosScheduler
from replica.planner.specserve import SpecServeLengths
from replica.planner.vllm import VllmConfig
from replica.request import SLO, Request, SamplingParams, Tier
from tests.cluster.conftest import write_profile
from tests.replica.planner.test_slos import GPU_LIKE, check_admitted_while_a_batch_runs, workloads

CACHE = CacheBudget(num_blocks=256)
SCHEDULERS = pytest.mark.parametrize(
    "config",
    [None, VllmConfig(), SarathiConfig(token_budget=16)],
    ids=["slos", "vllm", "sarathi"],
)


@pytest.fixture
def perf(tmp_path: Path) -> PerfModel:
    return PerfModel.load(write_profile(tmp_path / "p.json", const=0.01, tokens=0.001))


def requests(n: int, arrival: float = 0.0) -> list[Request]:
    return [
        Request(
            f"r{i}",
            [1] * (8 + 4 * i),
            SamplingParams(max_tokens=6 + i),
            slo=SLO(ttft_ms=2000, tpot_ms=500),
            arrival_time=arrival,
        )
        for i in range(n)
    ]


def run_steps(
    vr: VirtualReplica, executor: PerfExecutor, now: float, max_steps: int
) -> tuple[float, int]:
    """Plan on the mirror, execute on the executor, report back; returns (now, steps)."""
    steps = 0
    while steps < max_steps:
        plan = vr.next_plan(now)
        if plan is None:
            break
        outcome, duration = executor.execute(plan, now)
        now += duration
        assert vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, outcome, now)) is (
            ReportFit.APPLIED
        )
        steps += 1
    return now, steps


def snapshot_of(
    executor: PerfExecutor, admitted: Container[str], incarnation: str, seq: int = 41
) -> ReplicaSnapshot:
    """What the replica holds after step `seq`, `admitted` the requests it holds guaranteed."""
    held = tuple(
        HeldRequest(s.request, s.request.request_id in admitted, tuple(s.output), s.computed)
        for s in executor.sequences.values()
        if not s.finished
    )
    return ReplicaSnapshot(0, incarnation, seq, held, 0, executor.cache.num_blocks)


@SCHEDULERS
def test_mirror_plans_every_admitted_request_to_completion(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    vr = VirtualReplica(0, perf, CACHE, config)
    executor = PerfExecutor(perf, CACHE)
    for r in requests(3):
        vr.admit(r, 0.0)
        executor.add(r)
    assert vr.load == 3
    _, steps = run_steps(vr, executor, 0.0, 500)
    assert steps > 0 and not vr.has_work() and not vr.held
    assert all(len(executor.output(f"r{i}")) == 6 + i for i in range(3))


@SCHEDULERS
def test_mirror_counts_the_kv_its_replica_preemptions_drop(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    """Two requests outgrow a two-block cache: the mirror counts what the replica drops.
    (Best-effort, so the slos planner holds no reservation for them and preempts too.)"""
    tight = CacheBudget(num_blocks=2)
    vr = VirtualReplica(0, perf, tight, config)
    executor = PerfExecutor(perf, tight)
    for rid in ("a", "b"):
        r = Request(rid, [1] * 14, SamplingParams(max_tokens=8), tier=Tier.BEST_EFFORT)
        vr.add_best_effort(r, 0.0)
        executor.add(r)
    run_steps(vr, executor, 0.0, 500)
    assert not vr.has_work()
    assert vr.preempted_tokens == executor.preempted_tokens > 0


def test_reports_out_of_sequence_are_ignored_held_back_or_force_a_resync(
    perf: PerfModel,
) -> None:
    vr = VirtualReplica(0, perf, CACHE)
    vr.incarnation = "a"
    plan, outcome = BatchPlan(()), BatchOutcome([])
    assert vr.apply(StepReport(0, "a", 1, plan, outcome, 0.0)) is ReportFit.APPLIED
    assert vr.apply(StepReport(0, "a", 1, plan, outcome, 0.0)) is ReportFit.STALE
    assert vr.apply(StepReport(0, "a", 3, plan, outcome, 0.0)) is ReportFit.AHEAD
    assert vr.apply(StepReport(0, "b", 2, plan, outcome, 0.0)) is ReportFit.RESYNC
    assert vr.seq == 1


@SCHEDULERS
def test_restored_mirror_continues_where_the_replica_is(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    """Rebuild mid-run from a snapshot: the executor (a strict referee) accepts every plan
    of the new mirror, and every request finishes with all its tokens."""
    vr = VirtualReplica(0, perf, CACHE, config)
    executor = PerfExecutor(perf, CACHE)
    reqs = requests(4)
    for r in reqs[:3]:
        vr.admit(r, 0.0)
        executor.add(r)
    best = Request("be", [2] * 5, SamplingParams(max_tokens=5), tier=Tier.BEST_EFFORT)
    vr.add_best_effort(best, 0.0)
    executor.add(best)
    now, _ = run_steps(vr, executor, 0.0, 4)
    assert any(s.output for s in executor.sequences.values())

    rebuilt = VirtualReplica(0, perf, CACHE, config)
    rebuilt.restore(snapshot_of(executor, vr.admitted, "x"), now)
    assert rebuilt.incarnation == "x" and rebuilt.seq == 41
    assert rebuilt.held.keys() == vr.held.keys()
    assert rebuilt.admitted == vr.admitted
    run_steps(rebuilt, executor, now, 500)
    assert not rebuilt.held
    for r in [*reqs[:3], best]:
        assert len(executor.output(r.request_id)) == r.sampling.max_tokens


def test_a_rebuilt_mirror_keeps_the_guarantees_its_replica_keeps(perf: PerfModel) -> None:
    """Rebuilt after their first token's deadline: a request whose tokens came (when, the
    snapshot does not say) keeps its guarantee, and so does one whose prompt is not done
    (its token may have come on time since the snapshot) until the replica's next report,
    which finds it late: the replica is told it lost the guarantee."""
    vr = VirtualReplica(0, perf, CACHE)
    slo = SLO(ttft_ms=200, tpot_ms=100)
    sampling = SamplingParams(max_tokens=50)
    going = Request("going", [1] * 8, sampling, slo=slo, arrival_time=0.0)
    stuck = Request("stuck", [1] * 8, sampling, slo=slo, arrival_time=0.0)
    held = (HeldRequest(going, True, (3, 3, 3), 10), HeldRequest(stuck, True, (), 0))
    vr.restore(ReplicaSnapshot(0, "x", 5, held, free_blocks=200, num_blocks=256), 0.45)
    assert vr.admitted == {"going", "stuck"} and vr.num_demoted == 0
    assert isinstance(vr.scheduler, SlosScheduler)
    assert set(vr.scheduler.admitted) == {"going", "stuck"}
    quiet = BatchOutcome(outcomes=[], free_blocks=200)
    assert vr.apply(StepReport(0, "x", 6, BatchPlan(()), quiet, 0.46)) is ReportFit.APPLIED
    assert vr.admitted == {"going"} and vr.take_regraded() == {"stuck": False}


@SCHEDULERS
def test_abort_and_reset_forget_requests(perf: PerfModel, config: SchedulerConfig | None) -> None:
    vr = VirtualReplica(0, perf, CACHE, config)
    a, b = requests(2)
    vr.admit(a, 0.0)
    vr.admit(b, 0.0)
    assert vr.abort("r0") and not vr.abort("r0")
    assert set(vr.held) == {"r1"}
    status = vr.status(waiting_for_verdict=2)
    assert status.admitted == 1 and status.waiting == 3
    vr.reset()
    assert not vr.held and not vr.has_work() and vr.next_plan(0.0) is None
    assert type(vr.scheduler) is type(VirtualReplica(0, perf, CACHE, config).scheduler)


def test_finished_request_leaves_the_mirror(perf: PerfModel) -> None:
    vr = VirtualReplica(0, perf, CACHE)
    (r,) = requests(1)
    vr.admit(r, 0.0)
    executor = PerfExecutor(perf, CACHE)
    executor.add(r)
    run_steps(vr, executor, 0.0, 1)
    assert "r0" in vr.held
    plan = vr.next_plan(1.0)
    assert plan is not None and isinstance(plan.entries[0], DecodeStep)
    run_steps(vr, executor, 1.0, 500)
    assert "r0" not in vr.held


def test_only_the_slos_planner_plans_admission(perf: PerfModel) -> None:
    assert VirtualReplica(0, perf, CACHE).plans_admission
    baseline = VirtualReplica(0, perf, CACHE, SarathiConfig())
    assert not baseline.plans_admission
    with pytest.raises(TypeError, match="baseline"):
        baseline.plan_admission(requests(1), 0.0)


def test_a_promotion_admits_the_request_and_is_sent_to_the_replica_once() -> None:
    # As in the planner's test of promotion: the DP's worst case fits one of the two
    # 520-token prompts before their deadline; once `a`'s prefill ran, `b` fits too.
    perf = PerfModel.synthetic({"tokens": 1e-4, "attn_tokens": 1e-7})
    vr = VirtualReplica(0, perf, CACHE, None)
    executor = PerfExecutor(perf, CACHE)
    a, b = (
        Request(rid, [1] * 520, SamplingParams(max_tokens=480), slo=SLO(200, 50)) for rid in "ab"
    )
    verdict = vr.plan_admission([a, b], 0.0)
    assert verdict.admitted == ("a",)
    vr.admit(a, 0.0)
    vr.add_best_effort(b, 0.0)
    executor.add(a)
    executor.add(b)
    now = 0.0
    while (plan := vr.next_plan(now)) is not None and not vr.num_promoted:
        outcome, duration = executor.execute(plan, now)
        now += duration
        vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, outcome, now))
    assert vr.num_promoted == 1 and vr.admitted == {"a", "b"}
    assert isinstance(vr.scheduler, SlosScheduler) and list(vr.scheduler.promoted) == ["b"]
    assert vr.take_regraded() == {"b": True} and vr.take_regraded() == {}
    assert not executor.sequences["b"].computed
    # Rebuilt from a snapshot the promotion did not reach, the mirror would promote `b`
    # again; from the replica's, told with the plan, it holds `b` admitted.
    told, untold = (snapshot_of(executor, grades, "same") for grades in (vr.admitted, {"a"}))
    for snapshot, promotions in ((untold, 1), (told, 0)):
        vr.restore(snapshot, now)
        vr.next_plan(now)
        assert vr.num_promoted == promotions and vr.admitted == {"a", "b"}


def first_token_late(perf: PerfModel) -> tuple[VirtualReplica, PerfExecutor]:
    """A mirror whose admitted request's first token came past its deadline (a replica far
    slower than its profile): the guarantee is given up."""
    vr = VirtualReplica(0, perf, CACHE)
    executor = PerfExecutor(perf, CACHE)
    request = tight("late")
    vr.admit(request, 0.0)
    executor.add(request)
    plan = vr.next_plan(0.0)
    assert plan is not None
    outcome, _ = executor.execute(plan, 0.0)
    vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, outcome, 3.0))
    assert vr.num_demoted == 1 and not vr.admitted
    return vr, executor


def test_a_demotion_is_sent_to_the_replica_unless_the_request_ended(perf: PerfModel) -> None:
    vr, _ = first_token_late(perf)
    assert vr.take_regraded() == {"late": False}
    vr, executor = first_token_late(perf)
    run_steps(vr, executor, 3.0, 100)
    assert not vr.held and vr.take_regraded() == {}


def run_slow(vr: VirtualReplica, executor: PerfExecutor, slowdown: float) -> None:
    """Like run_steps, but every step reports `slowdown` times the predicted seconds."""
    now = 0.0
    while (plan := vr.next_plan(now)) is not None:
        outcome, duration = executor.execute(plan, now)
        now += duration * slowdown
        measured = replace(outcome, target_s=outcome.target_s * slowdown)
        vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, measured, now))


def tight(request_id: str) -> Request:
    """Decodes fit its 15 ms TPOT at the profile's 11 ms step, not at twice that."""
    slo = SLO(ttft_ms=2000, tpot_ms=15)
    return Request(request_id, [1] * 8, SamplingParams(max_tokens=8), slo=slo, arrival_time=0.0)


def test_steps_slower_than_predicted_make_admission_conservative(perf: PerfModel) -> None:
    vr = VirtualReplica(0, perf, CACHE, calibrate=True)
    assert vr.plan_admission([tight("probe")], 0.0).is_admitted("probe")
    executor = PerfExecutor(perf, CACHE)
    for request in requests(3):
        vr.admit(request, 0.0)
        executor.add(request)
    run_slow(vr, executor, slowdown=2.0)
    assert vr.calibration and all(f == pytest.approx(2.0) for f in vr.calibration.values())
    assert vr.status().calibration == vr.calibration
    shape = BatchShape((1,), (8,))
    assert vr.perf is not None
    assert vr.perf.predict(shape) == pytest.approx(2 * perf.predict(shape))
    later = tight("probe")
    assert not vr.plan_admission([later], 0.0).is_admitted("probe")
    vr.reset()
    assert vr.calibration, "a rebuilt mirror keeps its replica's speed"


def test_steps_as_predicted_keep_every_factor_at_one(perf: PerfModel) -> None:
    """Replicas that run exactly the perf model's times (as the simulator's do)."""
    vr = VirtualReplica(0, perf, CACHE, calibrate=True)
    executor = PerfExecutor(perf, CACHE)
    for request in requests(3):
        vr.admit(request, 0.0)
        executor.add(request)
    run_steps(vr, executor, 0.0, 500)
    assert vr.calibration and set(vr.calibration.values()) == {1.0}


def test_calibration_prices_the_drafts_the_engine_verified(tmp_path: Path) -> None:
    """A SpecServe replica verifies fewer drafts than planned: timed exactly by the profile,
    its steps keep every factor at 1 (priced as planned they would look faster)."""
    perf = PerfModel.load(
        write_profile(tmp_path / "p.json", const=0.01, tokens=0.01, draft_steps=0)
    )
    planner = PlannerConfig(spec=SpecConfig())
    vr = VirtualReplica(0, perf, CACHE, planner, calibrate=True)

    def unsure(_rid: str, k: int) -> tuple[list[float], list[bool]]:
        return [0.95] + [0.05] * (k - 1), [True] * k

    executor = PerfExecutor(perf, CACHE, specserve=(SpecServeLengths(perf), unsure))
    for request in requests(3):
        # Tighter than a plain step: the planner speculates to keep up.
        request = replace(request, slo=SLO(ttft_ms=2000, tpot_ms=10))
        vr.admit(request, 0.0)
        executor.add(request)
    now, planned = 0.0, []
    while (plan := vr.next_plan(now)) is not None:
        planned += [e.num_spec_tokens for e in plan.entries if isinstance(e, DecodeStep)]
        outcome, duration = executor.execute(plan, now)
        now += duration
        vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, outcome, now))
    assert max(planned) > 1 and max(executor.drafted) == 1, "planned several, verified one"
    assert vr.calibration and set(vr.calibration.values()) == {1.0}


def test_calibration_off_and_abort_reports_observe_nothing(perf: PerfModel) -> None:
    off = VirtualReplica(0, perf, CACHE)
    assert off.perf is None and off.status().calibration == {}
    vr = VirtualReplica(0, perf, CACHE, calibrate=True)
    vr.admit(requests(1)[0], 0.0)
    vr.abort("r0")
    abort = BatchOutcome(outcomes=[], overhead_s=1.0)
    assert vr.apply(StepReport(0, "", 1, BatchPlan(entries=()), abort, 1.0)) is ReportFit.APPLIED
    assert vr.calibration == {}


@SCHEDULERS
def test_a_mirror_tracking_prefixes_pictures_what_its_replica_caches(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    """Prompts bound here, then what ended here (prompt and output), are pictured cached;
    a new incarnation starts with nothing cached, while a rebuild of the same one keeps
    them, also after the replica was marked dead for a missed health check."""
    vr = VirtualReplica(0, perf, CACHE, config, track_prefixes=True)
    executor = PerfExecutor(perf, CACHE)
    vr.restore(snapshot_of(executor, vr.admitted, "x"), 0.0)  # the mirror's first build, at boot
    first = Request("a", list(range(40)), SamplingParams(max_tokens=30), tier=Tier.BEST_EFFORT)
    vr.add_best_effort(first, 0.0)
    executor.add(first)

    def probe(tokens: list[int]) -> int:
        return vr.cached_prefix(Request("probe", tokens, SamplingParams(), tier=Tier.BEST_EFFORT))

    assert probe([*range(40), 7]) == 32 and probe([1, *range(40)]) == 0
    run_steps(vr, executor, 0.0, 500)
    history = [*range(40), *executor.output("a")]
    assert len(history) == 70 and probe([*history, 5]) == 64
    vr.restore(snapshot_of(executor, vr.admitted, "x"), 1.0)
    assert probe([*history, 5]) == 64
    vr.reset()  # marked dead
    vr.restore(snapshot_of(executor, vr.admitted, "x"), 1.5)
    assert probe([*history, 5]) == 64
    vr.restore(snapshot_of(executor, vr.admitted, "y"), 2.0)
    assert probe([*history, 5]) == 0
    assert VirtualReplica(0, perf, CACHE, config).cached_prefix(first) == 0


@SCHEDULERS
def test_a_request_its_client_stopped_leaves_the_history_the_mirror_saw(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    """A client that read what it wanted closes its stream: the replica keeps the request's
    computed blocks cached, so the mirror pictures its prompt and the output it saw (all but
    the last token) for routing and credit alike. One stopped before its first token leaves
    only the prompt bound for routing, and nothing computed."""
    vr = VirtualReplica(0, perf, CACHE, config, track_prefixes=True, credit_prefixes=True)
    executor = PerfExecutor(perf, CACHE)
    a = Request("a", list(range(40)), SamplingParams(max_tokens=60), tier=Tier.BEST_EFFORT)
    vr.add_best_effort(a, 0.0)
    executor.add(a)
    now = 0.0
    while len(executor.output("a")) < 30:
        now, _ = run_steps(vr, executor, now, 1)
    seen = vr.scheduler.queues.states["a"].output_token_ids
    assert 30 <= len(seen) < 60
    assert vr.abort("a") and not vr.abort("a")
    history = [*range(40), *seen]
    probe = Request("p", [*history, 5], SamplingParams(), tier=Tier.BEST_EFFORT)
    expected = (len(history) - 1) // 16 * 16
    assert vr.cached_prefix(probe) == vr.prefix_credit(probe) == expected > 48
    b = Request("b", list(range(200, 240)), SamplingParams(max_tokens=4), tier=Tier.BEST_EFFORT)
    vr.add_best_effort(b, now)
    assert vr.abort("b")
    again = replace(b, request_id="q", prompt_token_ids=[*b.prompt_token_ids, 1])
    assert vr.cached_prefix(again) == 32 and vr.prefix_credit(again) == 0


def test_the_computed_picture_follows_each_prefill_chunk_and_what_a_preemption_leaves(
    perf: PerfModel,
) -> None:
    """As the replica registers blocks: a chunk's computed prefix is pictured before the
    prompt's first token; a preempted request's computed blocks stay cached, so it is
    pictured again (here after the other prefills pushed it out of a 4-block picture)."""
    vr = VirtualReplica(0, perf, CacheBudget(num_blocks=4), credit_prefixes=True)
    vr.incarnation = "i"
    prompts = {
        rid: [base + i for i in range(40)] for rid, base in (("a", 0), ("b", 100), ("c", 200))
    }
    for rid, prompt in prompts.items():
        vr.admit(Request(rid, prompt, SamplingParams(max_tokens=4), slo=SLO(5000, 500)), 0.0)

    def probe(rid: str) -> int:
        return vr.prefix_credit(
            Request("p", [*prompts[rid], 7], SamplingParams(), slo=SLO(5000, 500))
        )

    def step(seq: int, plan: BatchPlan, computed: dict[str, int]) -> None:
        outcomes = [RequestOutcome(rid, [], num_computed_tokens=n) for rid, n in computed.items()]
        report = StepReport(0, "i", seq, plan, BatchOutcome(outcomes), float(seq))
        assert vr.apply(report) is ReportFit.APPLIED

    step(1, BatchPlan((PrefillChunk("a", 32),)), {"a": 32})
    assert probe("a") == 32 and probe("b") == 0
    step(2, BatchPlan((PrefillChunk("b", 32),)), {"b": 32})
    step(3, BatchPlan((PrefillChunk("c", 32),)), {"c": 32})
    assert (probe("a"), probe("b"), probe("c")) == (0, 32, 32)
    step(4, BatchPlan((), preempt=("a",)), {})
    assert probe("a") == 32


def test_calibration_prices_a_prefill_over_the_prefix_the_replica_had_cached() -> None:
    """The replica began the prompt from 32 cached tokens and prefilled the last 8, timed
    exactly by the profile: the mirror, which learns of the hit from this report, prices the
    chunk over that context (over none, the step would look slower than predicted)."""
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 0.001, "attn_tokens": 1e-4})
    vr = VirtualReplica(0, perf, CACHE, calibrate=True)
    vr.incarnation = "i"
    vr.admit(Request("r", list(range(40)), SamplingParams(max_tokens=4), slo=SLO(5000, 500)), 0.0)
    step_s = perf.predict(BatchShape((8,), (32,)))
    assert step_s > 1.1 * perf.predict(BatchShape((8,), (0,)))
    outcome = BatchOutcome([RequestOutcome("r", [7], num_computed_tokens=40)], target_s=step_s)
    plan = BatchPlan((PrefillChunk("r", 8),))
    assert vr.apply(StepReport(0, "i", 1, plan, outcome, 1.0)) is ReportFit.APPLIED
    assert vr.calibration and list(vr.calibration.values()) == [pytest.approx(1.0)]


@SCHEDULERS
def test_a_request_bound_after_its_prefix_was_computed_starts_from_it(
    perf: PerfModel, config: SchedulerConfig | None
) -> None:
    """With credit_prefixes every scheduler counts the prefix the mirror pictures computed
    (A's prompt once its first token was out, then its history) as done: B's first chunk
    feeds what follows it. This replica lost its cache (an executor without one), so the
    whole credit is counted missed, and B is still prefilled whole. A prompt bound but not
    yet computed, a request asking for prompt log-probabilities and a request restored from
    a snapshot are credited nothing."""
    vr = VirtualReplica(0, perf, CACHE, config, credit_prefixes=True)
    executor = PerfExecutor(perf, CACHE)
    shared = list(range(100, 148))
    a = Request("a", [*shared, 1], SamplingParams(max_tokens=3), tier=Tier.BEST_EFFORT)
    vr.add_best_effort(a, 0.0)
    executor.add(a)
    b = Request("b", [*shared, 2, 3], SamplingParams(max_tokens=3), tier=Tier.BEST_EFFORT)
    assert vr.prefix_credit(b) == 0, "A's prompt is bound, not computed"
    now = 0.0
    while not executor.output("a"):
        now, _ = run_steps(vr, executor, now, 1)
    assert vr.prefix_credit(b) == 48
    logprobs = replace(b, sampling=SamplingParams(max_tokens=3, prompt_logprobs=1))
    assert vr.prefix_credit(logprobs) == 0
    now, _ = run_steps(vr, executor, now, 100)
    vr.add_best_effort(b, now)
    executor.add(b)
    assert vr.credits == {"b": 48} and vr.credited_tokens == 0  # counted as its prefill begins
    plan = vr.next_plan(now)
    assert plan is not None and plan.entries[0] == PrefillChunk("b", 2)
    outcome, duration = executor.execute(plan, now)
    vr.apply(StepReport(0, vr.incarnation, vr.seq + 1, plan, outcome, now + duration))
    assert (vr.credited_tokens, vr.credit_missed_tokens) == (48, 48) and vr.credits == {}
    run_steps(vr, executor, now + duration, 200)
    assert executor.output("b") and not vr.has_work()
    c = replace(b, request_id="c")
    executor.add(c)
    vr.restore(snapshot_of(executor, vr.admitted, ""), now)
    assert vr.credits == {} and vr.scheduler.queues.states["c"].num_computed_tokens == 0
    assert vr.prefix_credit(c) == 48


@dataclass
class RebuiltMirror:
    """A replica's mirror as the controller drives it, rebuilt from the replica's snapshot
    after the steps in `rebuilds`. The replica holds each request with the grade it was bound
    with, changed as each plan brings the mirror's guarantee changes (`told`)."""

    vr: VirtualReplica
    replica: PerfExecutor
    rebuilds: set[int]
    changes: dict[str, bool] = field(default_factory=dict)
    told: dict[str, bool] = field(default_factory=dict)
    steps: int = 0

    def decide(self, request: Request, now: float) -> bool:
        rid = request.request_id
        admitted = request.slo is not None and self.vr.plan_admission([request], now).is_admitted(
            rid
        )
        if admitted:
            self.vr.admit(request, now)
        else:
            self.vr.add_best_effort(request, now)
        self.told[rid] = admitted
        return admitted

    def plan(self, now: float) -> BatchPlan | None:
        plan = self.vr.next_plan(now)
        if plan is not None:
            sent = self.vr.take_regraded()
            self.changes.update(sent)
            self.told.update(sent)
        return plan

    def report(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        vr = self.vr
        assert vr.apply(StepReport(0, "", vr.seq + 1, plan, outcome, now)) is ReportFit.APPLIED
        self.steps += 1
        if self.steps in self.rebuilds:
            self.changes.update(vr.take_regraded())  # lost with the mirror, yet checked
            held = {rid for rid, admitted in self.told.items() if admitted}
            vr.restore(snapshot_of(self.replica, held, "", vr.seq), now)

    def has_work(self) -> bool:
        return self.vr.has_work()

    def regraded(self) -> dict[str, bool]:
        return self.changes | self.vr.take_regraded()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.sets(st.integers(1, 30), max_size=4))
def test_property_a_mirror_rebuilt_mid_run_keeps_every_guarantee(
    workload: tuple[list[Request], int, int], spec: bool, rebuilds: set[int]
) -> None:
    """Rebuilt from its replica's snapshot at random steps of a controller-style run, the
    mirror plans every request to its end, each one guaranteed on time, none given up."""

    def mirror(cache: CacheBudget, config: PlannerConfig, replica: PerfExecutor) -> RebuiltMirror:
        return RebuiltMirror(VirtualReplica(0, GPU_LIKE, cache, config), replica, rebuilds)

    check_admitted_while_a_batch_runs(workload, spec, mirror)
