"""GOODSPEED's split of a step's drafts across its requests."""

from __future__ import annotations

import pytest

from replica.batch import BatchOutcome, BatchPlan, DecodeStep, PrefillChunk, RequestOutcome
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget
from replica.planner.budget import AcceptanceEstimate
from replica.planner.config import GoodspeedConfig, LapsConfig, PlannerConfig, SpecConfig
from replica.planner.executor import PerfExecutor
from replica.planner.goodspeed import GoodspeedSplit
from replica.planner.slos import SlosScheduler
from replica.request import SLO, Request, SamplingParams

PLENTY = {"a": 100, "b": 100, "c": 100}
ONE_TIER = {"a": 0.05, "b": 0.05, "c": 0.05}


def splitter(prior: float = 0.6, **config: float) -> GoodspeedSplit:
    return GoodspeedSplit(GoodspeedConfig(**config), AcceptanceEstimate(SpecConfig(4, prior)))


def decodes(*drafts: tuple[str, int]) -> BatchPlan:
    return BatchPlan(tuple(DecodeStep(rid, k) for rid, k in drafts))


def drafts_of(plan: BatchPlan) -> dict[str, int]:
    return {e.request_id: e.num_spec_tokens for e in plan.entries if isinstance(e, DecodeStep)}


def verify(split: GoodspeedSplit, plan: BatchPlan, accepted: dict[str, int]) -> None:
    outcomes = [
        RequestOutcome(
            rid,
            [1] * (accepted[rid] + 1),
            0,
            num_draft_tokens=k,
            num_accepted_tokens=accepted[rid],
        )
        for rid, k in drafts_of(plan).items()
    ]
    split.observe(plan, BatchOutcome(outcomes))


def set_sources(split: GoodspeedSplit, values: dict[str, tuple[float, float]]) -> None:
    for rid, (acceptance, goodput) in values.items():
        source = split._source(rid)
        source.acceptance, source.goodput = acceptance, goodput


def test_drafts_go_one_at_a_time_to_the_largest_marginal_gain() -> None:
    split = splitter()
    set_sources(split, {"a": (0.9, 1.0), "b": (0.5, 1.0), "c": (0.1, 1.0)})
    # Gains a^(S+1): a 0.9, 0.81, 0.729; b 0.5, 0.25; c 0.1. Five drafts, at most three each
    # (the plan's longest): a three, b two, c none.
    plan = split.split(decodes(("a", 3), ("b", 1), ("c", 1)), PLENTY, ONE_TIER)
    assert drafts_of(plan) == {"a": 3, "b": 2, "c": 0}


def test_low_goodput_raises_a_requests_share() -> None:
    split = splitter()
    set_sources(split, {"a": (0.6, 1.0), "b": (0.6, 3.0)})
    # a: 0.6, 0.36, 0.216; b: 0.2, 0.12, 0.072: a takes three of the four (its cap).
    plan = split.split(decodes(("a", 1), ("b", 3)), PLENTY, ONE_TIER)
    assert drafts_of(plan) == {"a": 3, "b": 1}


def test_requests_alike_keep_the_planners_split() -> None:
    # A tight tier's 3 and a loose tier's 1 and 1, nothing observed yet: nothing moves (one
    # split over all three would hand the drafts out round-robin: 2, 2, 1).
    tiers = {"a": 0.05, "b": 0.1, "c": 0.1}
    plan = splitter().split(decodes(("a", 3), ("b", 1), ("c", 1)), PLENTY, tiers)
    assert drafts_of(plan) == {"a": 3, "b": 1, "c": 1}


def test_drafts_stay_within_their_tier_up_to_the_plans_longest() -> None:
    split = splitter()
    set_sources(split, {"a": (0.1, 1.0), "b": (0.9, 1.0), "c": (0.2, 1.0)})
    tiers = {"a": 0.05, "b": 0.1, "c": 0.1}
    plan = split.split(decodes(("a", 3), ("b", 1), ("c", 1)), PLENTY, tiers)
    assert drafts_of(plan) == {"a": 3, "b": 2, "c": 0}, "b takes c's draft, never a's"


def test_a_request_drafts_at_most_one_token_fewer_than_it_has_left() -> None:
    split = splitter()
    set_sources(split, {"a": (0.9, 1.0), "b": (0.2, 1.0)})
    plan = split.split(decodes(("a", 2), ("b", 2)), {"a": 2, "b": 100}, ONE_TIER)
    assert drafts_of(plan) == {"a": 1, "b": 2}, "a's cap is 1; b's is the plan's longest"


def test_prefills_decodes_without_drafts_or_a_tier_and_lone_drafters_are_left_alone() -> None:
    split = splitter()
    set_sources(split, {"a": (0.9, 1.0), "b": (0.1, 1.0), "c": (0.9, 1.0)})
    plan = BatchPlan((PrefillChunk("p", 16), DecodeStep("a", 0), DecodeStep("b", 3)))
    assert split.split(plan, PLENTY, ONE_TIER) == plan
    untiered = decodes(("b", 3), ("c", 1))
    assert split.split(untiered, PLENTY, {"b": 0.05}) == untiered
    mixed = BatchPlan((PrefillChunk("p", 16), DecodeStep("a", 1), DecodeStep("b", 3)))
    out = split.split(mixed, PLENTY, ONE_TIER)
    assert out.entries[0] == PrefillChunk("p", 16)
    assert drafts_of(out) == {"a": 3, "b": 1}
    assert "p" not in split._sources, "a split reads the estimates, never adds to them"


def test_estimates_follow_verifies_with_their_ema_weights() -> None:
    split = splitter(prior=0.5, acceptance_weight=0.5, goodput_weight=0.5)
    plan = decodes(("a", 4), ("b", 0))
    verify(split, plan, {"a": 2, "b": 0})
    a, b = split._sources["a"], split._sources["b"]
    # a judged 3 drafts (2 accepted, then the rejection): rate 2/3.
    assert a.acceptance == pytest.approx(0.5 * 0.5 + 0.5 * 2 / 3)
    assert a.goodput == pytest.approx(0.5 * 1.0 + 0.5 * 3)
    # b drafted nothing: its acceptance stays, its tokens per step fall toward 1.
    assert b.acceptance == pytest.approx(0.5) and b.goodput == pytest.approx(1.0)
    verify(split, decodes(("a", 2)), {"a": 2})
    assert a.acceptance == pytest.approx(0.5 * (0.25 + 1 / 3) + 0.5 * 1.0)
    split.forget("a")
    assert "a" not in split._sources


def test_acceptance_estimates_stay_inside_eps() -> None:
    split = splitter(acceptance_weight=1.0, eps=0.05)
    verify(split, decodes(("a", 3), ("b", 3)), {"a": 3, "b": 0})
    assert split._sources["a"].acceptance == pytest.approx(0.95)
    assert split._sources["b"].acceptance == pytest.approx(0.05)


def test_the_scheduler_resplits_its_own_plans_within_their_drafts_and_length() -> None:
    # Two admitted decoders, one whose drafts are always accepted and one whose never are.
    # A twin scheduler without GOODSPEED, fed the same steps, shows each step as the planner
    # made it: GOODSPEED keeps its drafts and their longest length, and never moves drafts
    # away from the accepting request. (Here the planner gives both the same length, which
    # leaves GOODSPEED nothing to move: each already has the longest.)
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "draft_steps": 1e-3})
    cache = CacheBudget(num_blocks=256)
    spec = SpecConfig(initial_acceptance=0.6)
    sched = SlosScheduler(perf, cache, PlannerConfig(spec=spec, goodspeed=GoodspeedConfig()))
    twin = SlosScheduler(perf, cache, PlannerConfig(spec=spec))
    executor = PerfExecutor(perf, cache, lambda rid, k: k if rid == "good" else 0)
    for rid in ("good", "bad"):
        request = Request(
            rid, [1] * 32, SamplingParams(max_tokens=120, ignore_eos=True), SLO(1000.0, 50.0)
        )
        executor.add(request)
        sched.add_request(request, 0.0)
        twin.add_request(request, 0.0)
    now, compared = 0.0, 0
    while (plan := sched.schedule(now)) is not None:
        planned = twin.schedule(now)
        assert planned is not None
        before, after = drafts_of(planned), drafts_of(plan)
        assert before.keys() == after.keys()
        if len(before) == 2 and sum(before.values()):
            compared += 1
            assert sum(after.values()) == sum(before.values())
            assert max(after.values()) <= max(before.values())
            assert after["good"] >= before["good"] and after["bad"] <= before["bad"]
        outcome, duration = executor.execute(plan, now)
        now += duration
        sched.update_from_outcome(plan, outcome, now)
        twin.update_from_outcome(plan, outcome, now)
    assert compared > 10
    assert sched.goodspeed is not None and not sched.goodspeed._sources


def test_a_request_aborted_while_its_step_runs_leaves_no_estimates() -> None:
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "draft_steps": 1e-3})
    cache = CacheBudget(num_blocks=256)
    config = PlannerConfig(
        spec=SpecConfig(),
        goodspeed=GoodspeedConfig(),
        laps=LapsConfig(),
        max_best_effort_requests=4,
    )
    sched = SlosScheduler(perf, cache, config)
    executor = PerfExecutor(perf, cache)
    for rid in ("a", "b"):
        request = Request(
            rid, [1] * 8, SamplingParams(max_tokens=40, ignore_eos=True), SLO(1000.0, 50.0)
        )
        executor.add(request)
        sched.add_request(request, 0.0)
    now = 0.0
    for _ in range(3):
        plan = sched.schedule(now)
        assert plan is not None
        outcome, duration = executor.execute(plan, now)
        now += duration
        sched.update_from_outcome(plan, outcome, now)
    assert sched.goodspeed is not None and sched.laps is not None
    assert set(sched.goodspeed._sources) == set(sched.laps._service) == {"a", "b"}
    plan = sched.schedule(now)
    assert plan is not None and {e.request_id for e in plan.entries} == {"a", "b"}
    outcome, duration = executor.execute(plan, now)
    sched.abort_request("a")
    sched.update_from_outcome(plan, outcome, now + duration)
    assert set(sched.goodspeed._sources) == set(sched.laps._service) == {"b"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"acceptance_weight": 1.5}, "goodspeed.acceptance_weight"),
        ({"goodput_weight": 0.0}, "goodspeed.goodput_weight"),
        ({"eps": 0.6}, "goodspeed.eps"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GoodspeedConfig(**kwargs)


def test_goodspeed_needs_speculation() -> None:
    with pytest.raises(ValueError, match="needs spec"):
        PlannerConfig(goodspeed=GoodspeedConfig())
    with pytest.raises(ValueError, match="goodspeed must be a GoodspeedConfig"):
        PlannerConfig(spec=SpecConfig(), goodspeed={"eps": 0.1})  # type: ignore[arg-type]
