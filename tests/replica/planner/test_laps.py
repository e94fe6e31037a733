"""LAPS-SD's order inside the best-effort tier."""

from __future__ import annotations

import pytest

from replica.batch import BatchOutcome, BatchPlan, DecodeStep, PrefillChunk, RequestOutcome
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget, RequestState
from replica.planner.config import LapsConfig, PlannerConfig
from replica.planner.executor import PerfExecutor, run_workload
from replica.planner.laps import LapsOrder
from replica.planner.slos import SlosScheduler
from replica.request import SLO, Request, SamplingParams, Tier


def flex(rid: str, max_tokens: int = 64, arrival: float = 0.0) -> Request:
    return Request(
        rid,
        [1] * 8,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tier=Tier.BEST_EFFORT,
        arrival_time=arrival,
    )


def state(rid: str, computed: int = 0, produced: int = 0) -> RequestState:
    return RequestState(flex(rid), [5] * produced, computed)


def step(
    order: LapsOrder,
    now: float,
    seconds: float,
    drafts: dict[str, tuple[int, int]],
    draft_s: float = 0.0,
) -> None:
    """One step of `seconds` target time in which each request drafted and accepted as given."""
    plan = BatchPlan(tuple(DecodeStep(rid, k) for rid, (k, _) in drafts.items()))
    outcomes = [
        RequestOutcome(rid, [1] * (a + 1), 0, num_draft_tokens=k, num_accepted_tokens=a)
        for rid, (k, a) in drafts.items()
    ]
    order.observe(plan, BatchOutcome(outcomes, draft_s=draft_s, target_s=seconds), now)


def test_levels_grow_geometrically_with_attained_service_and_waiting_lifts_them() -> None:
    order = LapsOrder(LapsConfig(num_levels=3, first_level_s=1.0, growth=4.0, aging_s=10.0))
    a = state("a")
    assert order.level(a, 0.0) == 0
    step(order, 0.9, 0.9, {"a": (0, 0)})
    assert order.level(a, 0.9) == 0
    step(order, 1.0, 0.1, {"a": (0, 0)})
    assert order.level(a, 1.0) == 1
    step(order, 4.0, 3.0, {"a": (0, 0)})
    assert order.level(a, 4.0) == 2
    step(order, 100.0, 96.0, {"a": (0, 0)})
    assert order.level(a, 100.0) == 2, "K levels: the last has no end"
    assert order.level(a, 109.9) == 2
    assert order.level(a, 110.0) == 1
    assert order.level(a, 130.0) == 0
    order.forget("a")
    assert order.level(a, 100.0) == 0


def test_a_prediction_waits_for_a_stable_acceptance_rate() -> None:
    order = LapsOrder(LapsConfig(window=3, stable_spread=0.1))
    a = state("a")
    # Cumulative rates 0.25, 0.5, 0.58: spread 0.33, not yet stable.
    for now, drafted in ((1.0, (4, 1)), (2.0, (4, 3)), (3.0, (4, 3))):
        step(order, now, 0.02, {"a": drafted}, draft_s=0.004)
        assert order.predicted_s(a, lambda _: 100) is None
    # Then 0.625, 0.65: the window holds 0.583, 0.625, 0.65 (spread 0.067).
    step(order, 4.0, 0.02, {"a": (4, 3)}, draft_s=0.004)
    assert order.predicted_s(a, lambda _: 100) is None
    step(order, 5.0, 0.02, {"a": (4, 3)}, draft_s=0.004)
    acceptance = (7 / 12 + 10 / 16 + 13 / 20) / 3
    # T = L (n T_ssm + T_llm) / (n A + 1) with n = 4, T_ssm = 4 ms / 4 drafts, T_llm = 20 ms.
    expected = 100 * (4 * 0.001 + 0.02) / (4 * acceptance + 1)
    assert order.predicted_s(a, lambda _: 100) == pytest.approx(expected)


def test_a_request_that_never_drafts_is_predicted_from_its_steps_alone() -> None:
    order = LapsOrder(LapsConfig(window=2))
    a = state("a")
    step(order, 1.0, 0.05, {"a": (0, 0)})
    assert order.predicted_s(a, lambda _: 10) is None
    step(order, 2.0, 0.05, {"a": (0, 0)})
    assert order.predicted_s(a, lambda _: 10) == pytest.approx(0.5)


def test_order_runs_predictable_holders_to_completion_then_levels_then_arrival() -> None:
    order = LapsOrder(LapsConfig(first_level_s=1.0, window=2, aging_s=100.0))
    # "long" and "short" have run two steps (predictable) and hold KV; "served" has one step
    # of 2 s (level 1, unpredictable); "new" and "newer" have had none (level 0).
    for now in (1.0, 2.0):
        step(order, now, 0.3, {"long": (0, 0), "short": (0, 0)})
    step(order, 2.0, 2.0, {"served": (0, 0)})
    states = [
        state("newer"),
        state("served", computed=20, produced=1),
        state("long", computed=20, produced=2),
        state("new"),
        state("short", computed=20, produced=2),
    ]
    remaining = {"long": 50, "short": 5, "served": 1, "new": 30, "newer": 30}
    ordered = order.order(states, lambda s: remaining[s.request_id], 2.0)
    assert [s.request_id for s in ordered] == ["short", "long", "newer", "new", "served"]


def test_without_a_prediction_least_attained_service_serves_short_requests_first() -> None:
    # One best-effort request per batch: a long request starts first, four short ones arrive
    # just after. Oldest first they wait for all of it; LAPS-SD (no request predictable:
    # the window is longer than any output) moves the long one down a level once it has had
    # a step's worth of service, and the short ones finish first.
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 1e-4})
    requests = [flex("long", 40)] + [flex(f"s{i}", 3, arrival=0.001) for i in range(4)]

    def finish_times(laps: LapsConfig | None) -> dict[str, float]:
        config = PlannerConfig(max_best_effort_requests=1, laps=laps)
        executor = PerfExecutor(perf, CacheBudget(num_blocks=64))
        run_workload(SlosScheduler(perf, CacheBudget(num_blocks=64), config), executor, requests)
        return {r.request_id: executor.token_times[r.request_id][-1] for r in requests}

    fcfs = finish_times(None)
    laps = finish_times(LapsConfig(first_level_s=0.01, window=1000))
    assert max(fcfs[f"s{i}"] for i in range(4)) > fcfs["long"]
    assert max(laps[f"s{i}"] for i in range(4)) < laps["long"]
    assert sum(laps.values()) < sum(fcfs.values())
    # Work-conserving: the last token comes out at the same time either way.
    assert max(laps.values()) == pytest.approx(max(fcfs.values()))


def test_best_effort_requests_that_can_still_be_on_time_keep_going_first() -> None:
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "requests": 4e-3})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256), PlannerConfig(laps=LapsConfig()))
    hopeful = Request(
        "hopeful",
        [1] * 100,
        SamplingParams(max_tokens=8, ignore_eos=True),
        SLO(ttft_ms=1000.0, tpot_ms=1.0),
        tier=Tier.SLO,
        arrival_time=0.05,
    )
    sched.add_best_effort(flex("flex"), 0.0)
    sched.add_best_effort(hopeful, 0.05)
    plan = sched.schedule(0.1)
    assert plan is not None and plan.entries[0].request_id == "hopeful"


def test_late_best_effort_requests_go_oldest_first_whenever_they_joined() -> None:
    """A request admitted on arrival that gave its guarantee up joins the tier after the
    ones that came later: it still goes before them (FCFS), not after every one of them."""
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "requests": 4e-3})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256), PlannerConfig())
    sched.add_best_effort(flex("young", arrival=1.0), 1.0)
    sched.add_best_effort(flex("old", arrival=0.0), 1.5)
    plan = sched.schedule(2.0)
    assert plan is not None and [e.request_id for e in plan.entries][:2] == ["old", "young"]


def test_the_scheduler_forgets_finished_and_aborted_requests() -> None:
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 1e-4})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=64), PlannerConfig(laps=LapsConfig()))
    executor = PerfExecutor(perf, CacheBudget(num_blocks=64))
    run_workload(sched, executor, [flex("a", 3), flex("b", 5)])
    assert sched.laps is not None and not sched.laps._service
    sched.add_best_effort(flex("c", 5), 1.0)
    plan = sched.schedule(1.0)
    assert plan is not None and isinstance(plan.entries[0], PrefillChunk)
    executor.add(flex("c", 5))
    outcome, duration = executor.execute(plan, 1.0)
    sched.update_from_outcome(plan, outcome, 1.0 + duration)
    assert "c" in sched.laps._service
    sched.abort_request("c")
    assert not sched.laps._service


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_levels": 0}, "laps.num_levels"),
        ({"window": 1.5}, "laps.window"),
        ({"first_level_s": 0}, "laps.first_level_s"),
        ({"aging_s": float("inf")}, "laps.aging_s"),
        ({"stable_spread": 0.0}, "laps.stable_spread"),
        ({"growth": 1.0}, "laps.growth"),
        ({"num_levels": 100, "growth": 1e6}, "laps.num_levels=100 with laps.growth"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LapsConfig(**kwargs)
    with pytest.raises(ValueError, match="laps must be a LapsConfig"):
        PlannerConfig(laps={"window": 2})  # type: ignore[arg-type]
