"""The SLOs-Serve scheduler end to end: plans executed on the perf model as the clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replica.batch import BatchOutcome, BatchPlan, PrefillChunk, RequestOutcome
from replica.perf_model import PerfModel
from replica.planner import slos as slos_module
from replica.planner.admission import AdmissionResult, solve_admission
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.config import InvocationConfig, PlannerConfig, SpecConfig
from replica.planner.deadlines import late_tokens, token_deadline
from replica.planner.executor import (
    OUTPUT_TOKENS,
    AcceptFn,
    Emits,
    PerfExecutor,
    run_workload,
    token_id,
)
from replica.planner.queues import peak_tokens
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.slos import SlosScheduler
from replica.planner.vllm import VllmScheduler
from replica.request import SLO, Request, SamplingParams, Stage, Tier

SIX_PER_UNIT = PerfModel.synthetic({"tokens": 1 / 6})
GPU_LIKE = PerfModel.synthetic(
    {
        "const": 0.004,
        "tokens": 5e-5,
        "attn_tokens": 2e-8,
        "draft_steps": 1e-3,
        "draft_tokens": 2e-5,
    },
    {"const": 0.006, "requests": 2e-4, "kv_tokens": 1e-7, "draft_steps": 1e-3},
)


def request(
    rid: str,
    prompt: int,
    max_tokens: int,
    ttft_s: float = 1.0,
    tpot_s: float = 0.05,
    arrival: float = 0.0,
    stages: tuple[Stage, ...] = (),
    tier: Tier = Tier.SLO,
    value: float = 1.0,
) -> Request:
    slo = SLO(ttft_ms=ttft_s * 1e3, tpot_ms=tpot_s * 1e3, stages=stages)
    return Request(
        rid,
        [1] * prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo if tier is Tier.SLO else None,
        tier=tier,
        arrival_time=arrival,
        value=value,
    )


def figure3_requests() -> list[Request]:
    """Three decoders exactly on their line (TPOT 1 unit) when four 6-token prompts (TTFT 6
    units) arrive at t = 1."""
    running = [request(f"run{i}", 2, 12, 1.0, 1.0) for i in range(3)]
    burst = [request(f"new{i}", 6, 5, 6.0, 1.0, arrival=1.0) for i in range(4)]
    return running + burst


def run(
    scheduler: Scheduler,
    perf: PerfModel,
    cache: CacheBudget,
    requests: list[Request],
    accept: AcceptFn | None = None,
    emits: dict[str, Emits] | None = None,
) -> tuple[PerfExecutor, dict[str, list[int]]]:
    """Judged by each request's SLO as the run closed its stages (SLO.closed_by)."""
    executor = PerfExecutor(perf, cache, accept)
    run_workload(scheduler, executor, requests, emits=emits)
    late = {
        r.request_id: late_tokens(
            r, executor.token_times[r.request_id], executor.output(r.request_id)
        )
        for r in requests
    }
    return executor, late


def steps(scheduler: SlosScheduler, executor: PerfExecutor, now: float, count: int) -> float:
    """Plan and execute `count` batches from `now`; returns the clock after the last."""
    for _ in range(count):
        plan = scheduler.schedule(now)
        assert plan is not None
        outcome, duration = executor.execute(plan, now)
        now += duration
        scheduler.update_from_outcome(plan, outcome, now)
    return now


def test_figure3_prefill_first_misses_tpot_and_decode_first_misses_ttft() -> None:
    cache = CacheBudget(100, 16)
    _, vllm_late = run(VllmScheduler(cache), SIX_PER_UNIT, cache, figure3_requests())
    assert all(vllm_late[f"run{i}"] for i in range(3))  # decodes stalled behind prefills
    sarathi = SarathiScheduler(cache, SarathiConfig(token_budget=6))
    _, sarathi_late = run(sarathi, SIX_PER_UNIT, cache, figure3_requests())
    assert sarathi_late["new2"][:1] == [0] and sarathi_late["new3"][:1] == [0]  # TTFT missed


def test_figure3_slos_admits_three_and_every_admitted_slo_holds() -> None:
    cache = CacheBudget(100, 16)
    config = PlannerConfig(idle_period_s=1.0)
    scheduler = SlosScheduler(SIX_PER_UNIT, cache, config)
    _, late = run(scheduler, SIX_PER_UNIT, cache, figure3_requests())
    admitted = [rid for rid, ok in scheduler.verdicts.items() if ok]
    assert sorted(admitted) == ["new0", "new1", "new2", "run0", "run1", "run2"]
    assert all(not late[rid] for rid in admitted)
    assert late["new3"]  # declined: served best-effort afterwards


def test_plan_admission_is_a_pure_verdict() -> None:
    cache = CacheBudget(100, 16)
    scheduler = SlosScheduler(SIX_PER_UNIT, cache, PlannerConfig(idle_period_s=1.0))
    for r in figure3_requests()[:3]:
        scheduler.add_request(r, 0.0)
    assert scheduler.schedule(0.0) is not None
    burst = figure3_requests()[3:]
    result = scheduler.plan_admission(burst, 0.0)
    assert len(result.admitted) + len(result.declined) == 4
    assert set(scheduler.admitted) == {"run0", "run1", "run2"}
    assert scheduler.plan_admission(burst, 0.0) == result
    be = request("be", 4, 2, tier=Tier.BEST_EFFORT)
    assert scheduler.plan_admission([be], 0.0).declined == ("be",)


def test_reasoning_request_is_planned_with_the_tight_tier_only_while_thinking() -> None:
    stages = (Stage(tpot_ms=20.0, num_tokens=6, name="think"), Stage(tpot_ms=200.0, name="answer"))
    reasoning = request("r", 8, 12, ttft_s=0.2, tpot_s=0.2, stages=stages)
    chat = request("c", 8, 40, ttft_s=0.2, tpot_s=0.2)
    cache = CacheBudget(64, 16)
    config = PlannerConfig(invocation=InvocationConfig(interval_s=1e-3))
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    executor = PerfExecutor(GPU_LIKE, cache)
    now = 0.0
    periods: list[tuple[int, float]] = []
    for r in (reasoning, chat):
        executor.add(r)
        scheduler.add_request(r, now)
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)
        assert plan is not None and scheduler.budget is not None
        if "r" in scheduler.queues.states:
            periods.append(
                (len(scheduler.queues.states["r"].output_token_ids), scheduler.budget.period_s)
            )
        outcome, duration = executor.execute(plan, now)
        now += duration
        scheduler.update_from_outcome(plan, outcome, now)
    assert all(p == 0.02 for n, p in periods if n < 6)
    assert any(p == 0.2 for n, p in periods if n > 6)
    for r in (reasoning, chat):
        assert not late_tokens(r, executor.token_times[r.request_id])


def test_a_thinking_stage_that_ends_on_a_token_relaxes_once_the_model_outputs_it() -> None:
    end = OUTPUT_TOKENS  # a token the simulated model outputs only where told
    stages = (Stage(tpot_ms=20.0, name="think", end_token_ids=(end,)), Stage(200.0, name="answer"))
    reasoning = request("r", 8, 12, ttft_s=0.2, tpot_s=0.02, stages=stages)
    cache = CacheBudget(64, 16)
    config = PlannerConfig(invocation=InvocationConfig(interval_s=1e-3))
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    executor = PerfExecutor(GPU_LIKE, cache)
    executor.add(reasoning, emits=[(5, end)])
    scheduler.add_request(reasoning, 0.0)
    now = 0.0
    periods: list[tuple[int, float]] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)
        assert plan is not None and scheduler.budget is not None
        periods.append(
            (len(scheduler.queues.states["r"].output_token_ids), scheduler.budget.period_s)
        )
        outcome, duration = executor.execute(plan, now)
        now += duration
        scheduler.update_from_outcome(plan, outcome, now)
    assert executor.output("r")[5] == end
    # Tight while thinking, for as long as it lasts; the answer's TPOT once the model ended it.
    assert all(p == 0.02 for n, p in periods if n < 6)
    assert any(p == 0.2 for n, p in periods if n > 6)
    assert reasoning.slo is not None and reasoning.slo.stages[0].end_token_ids  # its own copy
    assert not late_tokens(reasoning, executor.token_times["r"], executor.output("r"))


def test_speculation_lengths_follow_the_measured_acceptance() -> None:
    cache = CacheBudget(64, 16)
    config = PlannerConfig(spec=SpecConfig(initial_acceptance=0.3, ema_weight=0.5))
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    requests = [request(f"r{i}", 16, 24, ttft_s=0.1, tpot_s=0.015) for i in range(2)]
    executor, late = run(scheduler, GPU_LIKE, cache, requests, accept=lambda _r, k: k)
    assert scheduler.acceptance is not None and scheduler.acceptance.value > 0.9
    assert any(k > 0 for k in executor.drafted)
    assert not any(late.values())


@pytest.mark.parametrize(("kv_fraction", "stretched_for_the_prompt"), [(0.5, False), (0.0, True)])
def test_speculation_stretches_the_period_only_when_no_prompt_waits_or_kv_is_scarce(
    kv_fraction: float, stretched_for_the_prompt: bool
) -> None:
    # A lone request reserves 240 of 1024 KV slots: not scarce at 0.5, so its prompt is
    # planned with the autoregressive period; once it decodes (no prompt waits) the period
    # stretches at once, and the decoder verifies drafts from its first step on.
    cache = CacheBudget(64, 16)
    config = PlannerConfig(spec=SpecConfig(stretch_kv_fraction=kv_fraction))
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    a = request("a", 200, 40, ttft_s=0.5, tpot_s=0.05)
    verdict = scheduler.plan_admission([a], 0.0)
    assert verdict.is_admitted("a")
    assert (verdict.budget.draft_steps > 0) is stretched_for_the_prompt
    scheduler.add_request(a, 0.0)
    executor = PerfExecutor(GPU_LIKE, cache, lambda _r, k: k)
    executor.add(a)
    steps(scheduler, executor, 0.0, 3)
    assert executor.drafted[0] > 0
    assert scheduler.budget is not None and scheduler.budget.period_s > 0.05


def test_best_effort_requests_are_preempted_and_resume_with_their_tokens() -> None:
    cache = CacheBudget(6, 16)
    background = [request(f"be{i}", 20, 30, tier=Tier.BEST_EFFORT) for i in range(2)]
    urgent = request("slo", 40, 20, ttft_s=0.5, tpot_s=0.05, arrival=0.05)
    scheduler = SlosScheduler(GPU_LIKE, cache)
    executor = PerfExecutor(GPU_LIKE, cache)
    run_workload(scheduler, executor, [*background, urgent])
    assert scheduler.verdicts == {"slo": True}
    assert set(executor.preemptions) <= {"be0", "be1"} and executor.preemptions
    for r in [*background, urgent]:
        expected = [token_id(r.request_id, j) for j in range(r.sampling.max_tokens)]
        assert executor.output(r.request_id) == expected
    assert not late_tokens(urgent, executor.token_times["slo"])
    assert executor.peak_blocks <= cache.num_blocks


def test_a_best_effort_prompt_started_from_a_cached_prefix_takes_its_blocks_when_it_runs() -> None:
    """Eight blocks of 16. a starts from 96 cached tokens (6 blocks it takes as it runs) and
    feeds its last 4 (a seventh block): b, behind it, may have the one block left."""
    scheduler = SlosScheduler(GPU_LIKE, CacheBudget(8, 16))
    scheduler.add_best_effort(best_effort("a", 100, 2), 0.0, cached=96)
    scheduler.add_best_effort(best_effort("b", 40, 2), 0.0)
    plan = scheduler.schedule(0.0)
    assert plan is not None and plan.entries == (PrefillChunk("a", 4), PrefillChunk("b", 16))


def test_a_request_falling_behind_on_time_is_planned_with_a_tighter_tpot() -> None:
    # A speculating plan stretches the period past the TPOT (several tokens a batch). A batch
    # whose drafts are all rejected delivers one token, on time, but the next one is then due
    # sooner than a period away: the request keeps its guarantee and is replanned so that the
    # next batch delivers that token in time.
    cache = CacheBudget(64, 16)
    config = PlannerConfig(spec=SpecConfig(stretch_kv_fraction=0.0))
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    accepting = [True]
    executor = PerfExecutor(GPU_LIKE, cache, lambda _r, k: k if accepting[0] else 0)
    r = request("r", 200, 40, ttft_s=0.5, tpot_s=0.05)
    executor.add(r)
    scheduler.add_request(r, 0.0)
    now = steps(scheduler, executor, 0.0, 3)
    assert scheduler.budget is not None and scheduler.budget.period_s > 0.05
    accepting[0] = False
    plan = scheduler.schedule(now)
    assert plan is not None
    outcome, _ = executor.execute(plan, now)
    on_time = token_deadline(r, len(executor.output("r")) - 1)
    scheduler.update_from_outcome(plan, outcome, on_time)
    assert scheduler.invocation.drifted and not scheduler.demoted
    stretched = scheduler.budget.period_s
    assert scheduler.schedule(on_time) is not None
    next_due = token_deadline(r, len(executor.output("r")))
    assert scheduler.budget.period_s < stretched
    assert on_time + scheduler.budget.period_s <= next_due


def test_admitted_requests_that_missed_a_deadline_become_best_effort() -> None:
    # A decoder whose step reports past its next token's deadline and a prompt still waiting
    # past its first token's deadline can no longer attain: both give up their guarantee, the
    # request that is still on time keeps it, and all three are still served.
    cache = CacheBudget(64, 16)
    scheduler = SlosScheduler(GPU_LIKE, cache)
    executor = PerfExecutor(GPU_LIKE, cache)
    slow = request("slow", 8, 20, ttft_s=0.1, tpot_s=0.05)
    executor.add(slow)
    scheduler.add_request(slow, 0.0)
    now = steps(scheduler, executor, 0.0, 2)
    waiting = request("waiting", 8, 4, ttft_s=0.2, arrival=now)
    on_time = request("on-time", 8, 4, ttft_s=5.0, arrival=now)
    for r in (waiting, on_time):
        executor.add(r)
        scheduler.add_request(r, now)
    plan = scheduler.schedule(now)
    assert plan is not None
    assert set(scheduler.admitted) == {"slow", "waiting", "on-time"}
    outcome, _ = executor.execute(plan, now)
    # The step runs far slower than planned: it reports 1 s later.
    scheduler.update_from_outcome(plan, outcome, now + 1.0)
    assert set(scheduler.admitted) == {"on-time"}
    assert sorted(scheduler.demoted) == ["slow", "waiting"]
    assert sorted(scheduler.best_effort) == ["slow", "waiting"]
    now = steps(scheduler, executor, now + 1.0, 1)
    while scheduler.has_unfinished():
        now = steps(scheduler, executor, now, 1)
    assert len(executor.output("slow")) == 20 and len(executor.output("waiting")) == 4


def test_an_admitted_request_on_time_keeps_its_guarantee() -> None:
    cache = CacheBudget(64, 16)
    scheduler = SlosScheduler(GPU_LIKE, cache)
    executor = PerfExecutor(GPU_LIKE, cache)
    r = request("r", 8, 20, ttft_s=0.1, tpot_s=0.05)
    executor.add(r)
    scheduler.add_request(r, 0.0)
    now = steps(scheduler, executor, 0.0, 3)
    plan = scheduler.schedule(now)
    assert plan is not None
    outcome, _ = executor.execute(plan, now)
    # Reported exactly at the deadline of the token it delivered: on time.
    due = token_deadline(r, len(executor.output("r")) - 1)
    scheduler.update_from_outcome(plan, outcome, due)
    assert set(scheduler.admitted) == {"r"} and not scheduler.demoted


@st.composite
def slo_request(draw: st.DrawFn, rid: str, tpots: list[float]) -> Request:
    """SLO or best-effort; some with a second stage, possibly starting early."""
    max_tokens = draw(st.integers(1, 30))
    stages: tuple[Stage, ...] = ()
    if max_tokens > 2 and draw(st.booleans()):
        split = draw(st.integers(1, max_tokens - 1))
        first = Stage(tpot_ms=draw(st.sampled_from(tpots)) * 1e3, num_tokens=split)
        gap = draw(st.sampled_from([None, 0.0, 20.0, 100.0]))
        stages = (first, Stage(tpot_ms=draw(st.sampled_from(tpots)) * 1e3, ttft_ms=gap))
    tier = Tier.BEST_EFFORT if draw(st.integers(0, 9)) == 0 else Tier.SLO
    return request(
        rid,
        prompt=draw(st.integers(1, 300)),
        max_tokens=max_tokens,
        ttft_s=draw(st.sampled_from([0.02, 0.05, 0.1, 0.3])),
        tpot_s=draw(st.sampled_from(tpots)),
        arrival=draw(st.floats(0.0, 0.3)),
        stages=stages,
        tier=tier,
        value=draw(st.sampled_from([1.0, 2.5])),
    )


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 12) -> tuple[list[Request], int, int]:
    """Requests over 1-3 TPOT tiers, KV blocks (enough for the largest alone and up to 6x
    that), and the DP's group size."""
    tpots = draw(
        st.lists(st.sampled_from([0.015, 0.025, 0.04, 0.08]), min_size=1, max_size=3, unique=True)
    )
    count = draw(st.integers(1, max_requests))
    requests = [draw(slo_request(f"r{i}", tpots)) for i in range(count)]
    need = max(-(-peak_tokens(r) // 16) for r in requests)
    return requests, draw(st.integers(need, 6 * need)), draw(st.sampled_from([3, 16]))


THINKING_ENDS = OUTPUT_TOKENS
"""A token the simulated model outputs only where a workload says (the end of thinking)."""


@st.composite
def thinking_workloads(draw: st.DrawFn) -> tuple[list[Request], int, int, dict[str, Emits]]:
    """`workloads`, some of whose SLO requests think first: a tight stage that ends on a
    token (bounded or not) the model outputs at a drawn place, or never, then an answer
    stage whose first token is due at least the tightest TPOT after the end of thinking."""
    requests, num_blocks, group = draw(workloads())
    tpots = sorted({r.slo.tpot_ms for r in requests if r.slo is not None})
    emits: dict[str, Emits] = {}
    for i, r in enumerate(requests):
        if r.slo is None or r.sampling.max_tokens < 2 or not draw(st.booleans()):
            continue
        thinking = draw(st.sampled_from(tpots))
        answer = draw(st.sampled_from(tpots))
        bound = draw(st.one_of(st.none(), st.integers(1, r.sampling.max_tokens - 1)))
        gap = draw(st.sampled_from([None, min(thinking, answer), 100.0]))
        stages = (
            Stage(tpot_ms=thinking, num_tokens=bound, end_token_ids=(THINKING_ENDS,)),
            Stage(tpot_ms=answer, ttft_ms=gap),
        )
        requests[i] = replace(r, slo=replace(r.slo, tpot_ms=thinking, stages=stages))
        emits[r.request_id] = ((draw(st.integers(0, r.sampling.max_tokens)), THINKING_ENDS),)
    return requests, num_blocks, group, emits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(thinking_workloads(), st.booleans())
def test_property_admitted_requests_meet_their_slos_when_thinking_ends_on_a_token(
    workload: tuple[list[Request], int, int, dict[str, Emits]], spec: bool
) -> None:
    """The planner learns where thinking ends only when the model says so, and keeps every
    admitted request's guarantee under the SLO as the run closed it."""
    requests, num_blocks, group, emits = workload
    check_admitted_slos_hold((requests, num_blocks, group), spec, emits)


def check_admitted_slos_hold(
    workload: tuple[list[Request], int, int], spec: bool, emits: dict[str, Emits] | None = None
) -> None:
    requests, num_blocks, group = workload
    cache = CacheBudget(num_blocks, 16)
    config = PlannerConfig(spec=SpecConfig() if spec else None, max_dp_candidates=group)
    scheduler = SlosScheduler(GPU_LIKE, cache, config)
    # With speculation every draft is accepted: at least what the planner's E(s) assumes.
    accept = (lambda _r, k: k) if spec else None
    executor, late = run(scheduler, GPU_LIKE, cache, requests, accept, emits)
    for r in requests:
        assert len(executor.output(r.request_id)) == r.sampling.max_tokens
        if scheduler.verdicts.get(r.request_id):
            assert not late[r.request_id], (r.request_id, late[r.request_id])
    assert executor.peak_blocks <= num_blocks


def best_effort(rid: str, prompt: int, max_tokens: int, arrival: float = 0.0) -> Request:
    return request(rid, prompt, max_tokens, arrival=arrival, tier=Tier.BEST_EFFORT)


class Driven(Protocol):
    """A replica's planner as the controller drives it: it decides each request on arrival
    (True: admitted), plans the next step and takes its report; `regraded` says which
    requests it promoted (True) or gave up (False) since."""

    def decide(self, request: Request, now: float) -> bool: ...

    def plan(self, now: float) -> BatchPlan | None: ...

    def report(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None: ...

    def has_work(self) -> bool: ...

    def regraded(self) -> dict[str, bool]: ...


@dataclass
class PlannerAlone:
    """The planner itself, driven as the controller drives its replica's mirror."""

    scheduler: SlosScheduler

    @classmethod
    def of(cls, cache: CacheBudget, config: PlannerConfig, _: PerfExecutor) -> PlannerAlone:
        return cls(SlosScheduler(GPU_LIKE, cache, config))

    def decide(self, request: Request, now: float) -> bool:
        rid = request.request_id
        if request.slo is not None and self.scheduler.plan_admission([request], now).is_admitted(
            rid
        ):
            self.scheduler.add_admitted(request, now)
            return True
        self.scheduler.add_best_effort(request, now)
        return False

    def plan(self, now: float) -> BatchPlan | None:
        return self.scheduler.schedule(now)

    def report(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        self.scheduler.update_from_outcome(plan, outcome, now)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def regraded(self) -> dict[str, bool]:
        s = self.scheduler
        return dict.fromkeys(s.promoted, True) | dict.fromkeys(s.demoted, False)


def run_as_controller(driven: Driven, executor: PerfExecutor, requests: list[Request]) -> set[str]:
    """Drive a planner as the controller drives a replica's mirror: a request is decided
    when it arrives, while a batch is in flight if one is, and the batch is reported when it
    ends. Returns the requests admitted on arrival."""
    arrivals = sorted(requests, key=lambda r: r.arrival_time)
    admitted: set[str] = set()

    def decide(request: Request, now: float) -> None:
        executor.add(request)
        if driven.decide(request, now):
            admitted.add(request.request_id)

    now, nxt = arrivals[0].arrival_time, 0
    for _ in range(100_000):
        plan = driven.plan(now)
        if plan is None:
            if nxt == len(arrivals):
                assert not driven.has_work()
                return admitted
            now = max(now, arrivals[nxt].arrival_time)
            decide(arrivals[nxt], now)
            nxt += 1
            continue
        outcome, duration = executor.execute(plan, now)
        while nxt < len(arrivals) and arrivals[nxt].arrival_time < now + duration:
            decide(arrivals[nxt], max(now, arrivals[nxt].arrival_time))
            nxt += 1
        now += duration
        driven.report(plan, outcome, now)
    raise AssertionError("the workload did not finish")


NO_ROOM_BESIDE_A_PROMPT = (
    [
        best_effort("r0", 57, 1, arrival=0.15625),
        best_effort("r1", 235, 1, arrival=0.15625),
        request("r2", 163, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.1692336629642497),
        request("r3", 295, 1, ttft_s=0.05, tpot_s=0.015, arrival=0.171875),
        request("r4", 100, 3, ttft_s=0.05, tpot_s=0.015, arrival=0.140625),
    ],
    19,
    3,
)
"""Found by a random run of `run_as_controller` (2026-11-27, with speculation): r2 was admitted
while a best-effort batch ran; the next batch held its whole prompt, due 13.1 ms after the
batch began, and 23 tokens of r3, served best-effort, which pushed the batch 0.5 ms past
r2's deadline. Work beside the tokens a batch owes now rides only in the time before the
first of them falls due (`form_batch`)."""


LATE_WITH_THE_CANDIDATE = (
    [
        request("r0", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.2109375),
        request("r1", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.20160244810001532),
        request("r2", 1, 1, ttft_s=0.05, tpot_s=0.015, arrival=0.203125),
        request("r3", 212, 8, ttft_s=0.02, tpot_s=0.015, arrival=0.00390625),
        best_effort("r4", 1, 10),
        request("r5", 169, 21, ttft_s=0.02, tpot_s=0.015, arrival=0.0625),
        best_effort("r6", 1, 1),
        request("r7", 3, 1, ttft_s=0.02, tpot_s=0.015),
    ],
    15,
    3,
)
"""Found by a random run (2026-11-28): r0 was admitted on a budget whose batches, sized
for it too, no longer ended by r1's first-token deadline; the DP counted r1 late and
admitted r0 anyway. A budget on which a running request is late now admits nothing."""


SLOWER_FOR_A_PROMOTABLE = (
    [
        request("r0", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.26171875),
        request("r1", 204, 1, ttft_s=0.02, tpot_s=0.025, arrival=0.2578125),
        best_effort("r2", 1, 2, arrival=0.25),
    ],
    13,
    3,
)
"""Found by a random run (2026-11-28): r1 was admitted on 25 ms batches of 388 tokens, and r0,
declined, offered again to the next replan as promotable. Every option of that replan was
sized with r0 among its decoders (15 ms, 203 tokens), too slow for r1's prompt. The options
for the running requests alone are now solved too, and keep r1 on time."""


CHAIN_UNDER_SPECULATION = (
    [
        request("r0", 12, 1, ttft_s=0.05, tpot_s=0.015, arrival=0.00390625),
        request("r1", 1, 2, ttft_s=0.02, tpot_s=0.025),
        request(
            "r2",
            300,
            9,
            ttft_s=0.1,
            tpot_s=0.025,
            stages=(Stage(tpot_ms=15.0, num_tokens=8), Stage(tpot_ms=25.0, ttft_ms=0.0)),
        ),
        request("r3", 268, 1, ttft_s=0.05, tpot_s=0.025),
    ],
    39,
    3,
)
"""Found by a random run (2026-11-28): r2's last token is due with the one before it, so its
tokens are a chain; on a speculating budget's 24 ms batches (15 ms x E(s)) a chain paced one
token a batch pulled r2's next token forward to 37 ms, the batch cut there took less of r3's
prompt than the plan counted on, and r3's first token was 7.7 us late. A chain is now paced
at the tokens a verify yields (`BatchBudget.chain_deadline`), in the plans and the batches
alike."""


@pytest.mark.parametrize(
    ("workload", "spec"),
    [
        (NO_ROOM_BESIDE_A_PROMPT, True),
        (NO_ROOM_BESIDE_A_PROMPT, False),
        (LATE_WITH_THE_CANDIDATE, False),
        (SLOWER_FOR_A_PROMOTABLE, False),
        (CHAIN_UNDER_SPECULATION, True),
    ],
)
def test_requests_admitted_while_a_batch_runs_meet_their_slos(
    workload: tuple[list[Request], int, int], spec: bool
) -> None:
    """Admission mid-batch, as the controller decides: every request admitted keeps its
    guarantee."""
    assert check_admitted_while_a_batch_runs(workload, spec)


def check_admitted_while_a_batch_runs(
    workload: tuple[list[Request], int, int],
    spec: bool,
    drive: Callable[[CacheBudget, PlannerConfig, PerfExecutor], Driven] = PlannerAlone.of,
) -> set[str]:
    """Every request is served whole, each guaranteed one (on arrival, or promoted later) on
    time, none given up (the replica runs at the profile's speed), in the memory there is;
    returns the requests admitted on arrival."""
    requests, num_blocks, group = workload
    cache = CacheBudget(num_blocks, 16)
    config = PlannerConfig(spec=SpecConfig() if spec else None, max_dp_candidates=group)
    executor = PerfExecutor(GPU_LIKE, cache, (lambda _r, k: k) if spec else None)
    driven = drive(cache, config, executor)
    admitted = run_as_controller(driven, executor, requests)
    regraded = driven.regraded()
    assert all(regraded.values()), regraded
    for r in requests:
        assert len(executor.output(r.request_id)) == r.sampling.max_tokens
        if r.request_id in admitted or r.request_id in regraded:
            times = executor.token_times[r.request_id]
            assert not late_tokens(r, times), (r.request_id, late_tokens(r, times))
    assert executor.peak_blocks <= num_blocks
    return admitted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_property_requests_admitted_while_a_batch_runs_meet_their_slos(
    workload: tuple[list[Request], int, int], spec: bool
) -> None:
    """Admission mid-batch, as the controller decides, on random workloads."""
    check_admitted_while_a_batch_runs(workload, spec)


# Workloads hypothesis found where requests admitted with batches shorter than their TPOT
# (first token due sooner than a TPOT away) lost their guarantee at the next replan.
CROWDED_TOKENS = (
    [
        best_effort("r0", 1, 1, arrival=0.015625),
        *(
            best_effort(f"r{i}", p, m)
            for i, (p, m) in enumerate(
                [(156, 1), (1, 2), (216, 2), (231, 2), (1, 1), (1, 1), (100, 2)], start=1
            )
        ),
        request(
            "r8",
            156,
            3,
            ttft_s=0.02,
            tpot_s=0.08,
            stages=(Stage(tpot_ms=40.0, num_tokens=2), Stage(tpot_ms=80.0, ttft_ms=0.0)),
        ),
    ],
    59,
    3,
)
NO_TOKEN_FITS = (
    [
        *(best_effort(f"r{i}", 1, 1) for i in range(9)),
        best_effort("r9", 223, 1, arrival=0.0078125),
        request("r10", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.015625),
    ],
    14,
    3,
)
NEXT_TOKEN_CLOSE = (
    [
        best_effort("r0", 1, 1, arrival=0.03125),
        best_effort("r1", 162, 1),
        request("r2", 144, 1, ttft_s=0.1, tpot_s=0.025, arrival=0.0078125),
        request("r3", 61, 6, ttft_s=0.02, tpot_s=0.025),
    ],
    14,
    3,
)


def early_stages(first: int) -> tuple[Stage, ...]:
    """`first` tokens at 25 ms, then a 40 ms stage whose first token is due with the last of
    them (`ttft_ms` 0: a stage that starts early)."""
    return (Stage(tpot_ms=25.0, num_tokens=first), Stage(tpot_ms=40.0, ttft_ms=0.0))


def no_option_on_time(
    late_arrival: float, prompt: int, num_blocks: int
) -> tuple[list[Request], int, int]:
    """Found in CI twice (2026-11-27): after r3's prompt no budget option keeps r5's and r6's
    prompts on time in the DP's worst case (their stages start early, pulling first tokens
    forward). The options tied on (feasible, late count); the first (the shortest period)
    won, and its slow batches made r6's first token late, where the option with the most
    tokens a second keeps both on time (AdmissionResult.rank)."""
    arrival = 0.0703125
    return (
        [
            best_effort("r0", 1, 1),
            best_effort("r1", 1, 1),
            request("r2", 1, 1, ttft_s=0.02, tpot_s=0.04, arrival=late_arrival),
            request("r3", prompt, 1, ttft_s=0.02, tpot_s=0.04, arrival=arrival),
            best_effort("r4", 1, 9),
            request(
                "r5", 196, 4, ttft_s=0.05, tpot_s=0.04, arrival=arrival, stages=early_stages(3)
            ),
            request(
                "r6",
                196,
                5,
                ttft_s=0.05,
                tpot_s=0.04,
                arrival=arrival,
                stages=early_stages(4),
            ),
            best_effort("r7", 54, 1),
            request("r8", 1, 11, ttft_s=0.02, tpot_s=0.04),
        ],
        num_blocks,
        3,
    )


PERIOD_NOT_OFFERED = (
    [
        request("r0", 1, 1, ttft_s=0.02, tpot_s=0.04, arrival=0.0078125),
        request("r1", 238, 2, ttft_s=0.02, tpot_s=0.025),
        request(
            "r2",
            189,
            5,
            ttft_s=0.05,
            tpot_s=0.04,
            stages=early_stages(4),
        ),
        request(
            "r3",
            178,
            6,
            ttft_s=0.05,
            tpot_s=0.04,
            stages=early_stages(5),
        ),
    ],
    42,
    3,
)
"""Found in CI (2026-11-27): r1, r2 and r3 were admitted on a 20 ms period (r1's first token
due in 20 ms). The next replan offered 25 ms, 8.6 ms and 21.2 ms, none feasible: on the
21.2 ms one r2's and r3's early stages pulled their prompts forward past r1's next decode.
The period they were admitted on is now always offered again."""


PROMPT_AFTER_A_CUT = (
    [
        request("r0", 1, 1, ttft_s=0.02, tpot_s=0.04, arrival=0.0078125),
        request("r1", 224, 2, ttft_s=0.02, tpot_s=0.025),
        request("r2", 220, 5, ttft_s=0.05, tpot_s=0.04, stages=early_stages(4)),
        request("r3", 180, 6, ttft_s=0.05, tpot_s=0.04, stages=early_stages(5)),
    ],
    42,
    3,
)
"""A neighbour of PERIOD_NOT_OFFERED (16 of 3,840 such were late): the batch after r0's
was cut at r2's early stage, 5 ms before r3's prompt was due, and held 3 tokens too few of
it in the budget's worst case, though the batch as formed (two prompts) fitted them all;
the rest could not have a batch of its own in time. Either change keeps it on time: the DP
charging a cut what it costs at worst (`BatchBudget.cut_tokens`), or a cut batch's prompts
taking what its own price fits (`form_batch`)."""


NO_BATCH_AFTER_A_CUT = (
    [
        best_effort("r0", 155, 1, arrival=0.1796875),
        request("r1", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.185546875),
        request("r2", 106, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.19140625),
        best_effort("r3", 1, 7, arrival=0.140625),
    ],
    10,
    3,
)
"""Found by a random run (2026-11-27): r1's prompt needs a batch cut 9.5 ms into a 15 ms
period, and r2's is due 5.9 ms after that cut, less than a one-token batch takes (6.4 ms):
the cut batch held 105 of r2's 106 tokens and the last came late. The DP charged the cut as
two half periods; it now charges the part of a period too short for a batch."""


HEAD_WITHOUT_MEMORY = (
    [
        request("r0", 1, 1, ttft_s=0.02, tpot_s=0.015, arrival=0.29121572940042745),
        request("r1", 186, 2, ttft_s=0.05, tpot_s=0.015, arrival=0.2890625),
        request("r2", 279, 3, ttft_s=0.02, tpot_s=0.015, arrival=0.109375),
        request("r3", 1, 4, ttft_s=0.02, tpot_s=0.015, arrival=0.09375),
        request("r4", 1, 6, ttft_s=0.02, tpot_s=0.015),
        best_effort("r5", 23, 15, arrival=0.03125),
        best_effort("r6", 55, 16, arrival=0.0078125),
        request("r7", 120, 26, ttft_s=0.02, tpot_s=0.015, arrival=0.1015625),
    ],
    18,
    3,
)
"""Found by a random run (2026-11-28): r2, served best-effort, could not grow into the
memory held for r1, and r1's next token was not yet due; the batch kept the time of the
head's token for r2 and left r1 none, so the replica planned nothing (here: forever, as
nothing else arrives). The riders now take the head's time when it gets nothing."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example(CROWDED_TOKENS)
@example(NO_TOKEN_FITS)
@example(NEXT_TOKEN_CLOSE)
@example(no_option_on_time(0.078125, 191, 42))
@example(no_option_on_time(0.08203125, 202, 45))
@example(PERIOD_NOT_OFFERED)
@example(PROMPT_AFTER_A_CUT)
@example(NO_BATCH_AFTER_A_CUT)
@example(HEAD_WITHOUT_MEMORY)
def test_property_admitted_requests_meet_their_slos(
    workload: tuple[list[Request], int, int],
) -> None:
    check_admitted_slos_hold(workload, spec=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example(CROWDED_TOKENS)
@example(NO_TOKEN_FITS)
@example(NEXT_TOKEN_CLOSE)
@example(NO_BATCH_AFTER_A_CUT)
def test_property_admitted_requests_meet_their_slos_with_speculation(
    workload: tuple[list[Request], int, int],
) -> None:
    check_admitted_slos_hold(workload, spec=True)


def test_admission_plans_from_the_end_of_the_batch_in_flight() -> None:
    # A's 300-token prefill runs 0-0.05 s (1/6 ms per token). B, due at 0.055 s, is admitted
    # on an idle replica (it goes first), but not once A's batch is in flight, until that
    # batch is reported.
    perf = PerfModel.synthetic({"tokens": 1 / 6000})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256))
    a = request("a", 300, 4, ttft_s=1.0)
    sched.add_admitted(a, 0.0)
    b = request("b", 60, 4, ttft_s=0.055)
    assert sched.plan_admission([b], 0.0).is_admitted("b")
    plan = sched.schedule(0.0)
    assert plan is not None and plan.num_tokens == 300
    assert not sched.plan_admission([b], 0.0).is_admitted("b")
    executor = PerfExecutor(perf, sched.queues.budget)
    executor.add(a)
    outcome, duration = executor.execute(plan, 0.0)
    assert duration == pytest.approx(0.05)
    sched.update_from_outcome(plan, outcome, duration)
    later = request("c", 60, 4, ttft_s=0.2)
    assert sched.plan_admission([later], duration).is_admitted("c")


def test_a_request_due_within_one_period_is_admitted_and_its_batch_cut_at_its_deadline() -> None:
    # Due 30 ms after arrival with a 50 ms TPOT: no whole 50 ms batch ends in time, a batch
    # cut at 30 ms does (4 ms + 100 tokens x 0.1 ms), and the schedule cuts it there.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4})
    cache = CacheBudget(num_blocks=256)
    sched = SlosScheduler(perf, cache)
    a = request("a", 100, 8, ttft_s=0.03, tpot_s=0.05)
    assert sched.plan_admission([a], 0.0).is_admitted("a")
    late = request("b", 100, 8, ttft_s=0.012, tpot_s=0.05)
    assert not sched.plan_admission([late], 0.0).is_admitted("b")
    sched.add_request(a, 0.0)
    plan = sched.schedule(0.0)
    assert plan is not None and sched.verdicts == {"a": True}
    executor = PerfExecutor(perf, cache)
    executor.add(a)
    _, duration = executor.execute(plan, 0.0)
    assert duration <= 0.03


def test_prompts_due_inside_a_period_pay_for_every_cut_beyond_the_first() -> None:
    # A 50 ms period holds 460 tokens after 4 ms of fixed time: a batch cut at 30 ms holds
    # 260, one cut at 45 ms 410. Two prompts due at 30 and 45 ms need two cuts, and the
    # second boundary costs its fixed time (40 tokens): 250 + 110 tokens fit, 250 + 140 (which
    # a single 45 ms batch would hold) do not.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256))
    first = request("first", 250, 8, ttft_s=0.03, tpot_s=0.05)
    fits = request("fits", 110, 8, ttft_s=0.045, tpot_s=0.05)
    too_long = request("too-long", 140, 8, ttft_s=0.045, tpot_s=0.05)
    assert sched.plan_admission([first, fits], 0.0).admitted == ("first", "fits")
    assert len(sched.plan_admission([first, too_long], 0.0).admitted) == 1
    assert sched.plan_admission([too_long], 0.0).admitted == ("too-long",)


def test_a_looser_tiers_decoders_count_as_the_share_of_batches_they_are_due_in() -> None:
    # A CPU-like profile (0.7 ms per request in a batch): one 30 ms decoder and 30 of 60 ms.
    # Counting all 31 in every 30 ms batch leaves no room for a 40-token prompt (the period
    # stretches to 33.7 ms for 31 tokens); a 60 ms decoder is due in every other batch, so it
    # counts as half a request, as it counts half a token, and the prompt is admitted: 23
    # decoders (1 + 22 x 0.5) and 8 prompts still computing make 20 requests, 21 with it.
    perf = PerfModel.synthetic({"const": 0.002, "tokens": 3e-4, "requests": 7e-4})
    cache = CacheBudget(num_blocks=1024)
    sched = SlosScheduler(perf, cache)
    executor = PerfExecutor(perf, cache)
    running = [request("tight", 4, 64, tpot_s=0.03)]
    running += [request(f"loose{i}", 4, 64, tpot_s=0.06) for i in range(30)]
    for r in running:
        sched.add_admitted(r, 0.0)
        executor.add(r)
    now = steps(sched, executor, 0.0, 3)
    new = request("new", 40, 8, ttft_s=0.1, tpot_s=0.06, arrival=now)
    result = sched.plan_admission([new], now)
    assert result.is_admitted("new")
    assert (result.budget.num_requests, result.budget.period_s) == (21, pytest.approx(0.03))
    sched.add_admitted(new, now)
    executor.add(new)
    while sched.has_unfinished():
        now = steps(sched, executor, now, 1)
    for r in [*running, new]:
        assert late_tokens(r, executor.token_times[r.request_id]) == [], r.request_id


def test_the_budget_never_assumes_more_kv_than_the_cache_holds() -> None:
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "kv_tokens": 1e-6})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=64))
    result = sched.plan_admission([request(f"r{i}", 900, 8) for i in range(8)], 0.0)
    assert result.budget.kv_tokens == 64 * 16
    assert result.budget.num_requests == 8


def test_best_effort_work_neither_shrinks_the_budget_nor_slows_slo_work() -> None:
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4})
    idle = SlosScheduler(perf, CacheBudget(num_blocks=256))
    crowded = SlosScheduler(perf, CacheBudget(num_blocks=256))
    for i in range(8):
        crowded.add_best_effort(request(f"be{i}", 100, 8, tier=Tier.BEST_EFFORT), 0.0)
    slo = request("a", 100, 8, tpot_s=0.05)
    budget = crowded.plan_admission([slo], 0.0).budget
    assert budget == idle.plan_admission([slo], 0.0).budget and budget.num_requests == 1
    crowded.add_request(slo, 0.0)
    plan = crowded.schedule(0.0)
    assert plan is not None and crowded.budget is not None
    # The SLO prompt's batch takes 14 ms of a 50 ms period; best-effort prefill adds 10% of
    # that (14 tokens at 0.1 ms), not the 36 ms the period has left.
    assert [e.request_id for e in plan.entries] == ["a", "be0"]
    assert plan.num_tokens == 100 + 14
    assert perf.predict(crowded.shape(plan)) <= 0.014 * 1.1 + 1e-9


def test_the_best_effort_head_progresses_while_decoders_ahead_of_their_line_wait() -> None:
    # One token costs 40 ms on top of 50 ms a batch, so a batch holds one request within the
    # 100 ms period. `a` is seconds ahead of its line after its first token: the best-effort
    # request takes the batches it needs, and `a` still meets every deadline.
    perf = PerfModel.synthetic({"const": 0.05, "tokens": 0.04})
    cache = CacheBudget(num_blocks=64)
    sched = SlosScheduler(perf, cache)
    a = request("a", 3, 40, ttft_s=1.5, tpot_s=0.1)
    filler = request("filler", 2, 2, arrival=0.3, tier=Tier.BEST_EFFORT)
    executor, late = run(sched, perf, cache, [a, filler])
    assert executor.token_times["filler"][-1] < 1.0 < executor.token_times["a"][-1]
    assert not late["a"]


def test_best_effort_requests_that_can_still_be_on_time_go_first() -> None:
    # Neither can be guaranteed (no batch is as short as a 1 ms TPOT), so both stay
    # best-effort: the one whose first token can still be on time gets the head's token,
    # ahead of the older one that is already late.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "requests": 4e-3})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256))
    late_one = request("late", 100, 8, ttft_s=0.01, tpot_s=0.001)
    hopeful = request("hopeful", 100, 8, ttft_s=1.0, tpot_s=0.001, arrival=0.05)
    sched.add_best_effort(late_one, 0.0)
    sched.add_best_effort(hopeful, 0.05)
    plan = sched.schedule(0.1)
    assert plan is not None and plan.entries[0].request_id == "hopeful"
    assert not sched.promoted


def test_an_admitted_request_computed_again_is_due_by_its_next_token_not_its_first() -> None:
    """A replica that dropped an admitted request's KV (a mirror rebuilt from its snapshot
    holds it so) computes prompt and output again: the DP holds that prefill to the next
    token's deadline. Held to its first token's, long past, it would count as late, and
    every new request would be declined until it was recomputed."""
    cache = CacheBudget(256, 16)
    scheduler = SlosScheduler(GPU_LIKE, cache)
    again = request("again", 64, 40, ttft_s=0.2, tpot_s=0.1)
    scheduler.add_admitted(again, 0.0)
    tokens = RequestOutcome("again", new_token_ids=[5] * 5, num_computed_tokens=0)
    scheduler.restore(BatchPlan(()), BatchOutcome(outcomes=[tokens]), 0.3)
    assert "again" in scheduler.admitted and not scheduler.queues.states["again"].is_decoding
    result = scheduler.plan_admission([request("new", 32, 8, arrival=0.3)], 0.3)
    assert result.keeps_running and result.is_admitted("new")


def test_a_request_declined_in_a_burst_is_promoted_when_the_plan_has_room() -> None:
    # The DP plans every token attending to the longest context (999 keys at 0.1 us: as
    # costly as the token itself), i.e. 250 tokens per 50 ms batch, so two 520-token
    # prompts do not fit the 4 batches before their 200 ms deadline. The real prefill of `a`
    # takes 66 ms; at the next replan `b` fits, is guaranteed, and is on time.
    perf = PerfModel.synthetic({"tokens": 1e-4, "attn_tokens": 1e-7})
    cache = CacheBudget(num_blocks=256)
    sched = SlosScheduler(perf, cache)
    a = request("a", 520, 480, ttft_s=0.2, tpot_s=0.05)
    b = request("b", 520, 480, ttft_s=0.2, tpot_s=0.05)
    _, late = run(sched, perf, cache, [a, b])
    assert sched.verdicts == {"a": True, "b": False}
    assert list(sched.promoted) == ["b"] and sched.num_promoted == 1
    assert not late["a"] and not late["b"]


def test_a_tight_prompt_is_admitted_beside_a_decoder_far_ahead_of_its_line() -> None:
    # Reading d's 2000 cached tokens costs 20 ms, so no batch that serves d ends within n's
    # 20 ms TTFT; d is seconds ahead of its line, so the plan may leave it out of n's batch.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "kv_tokens": 1e-5})
    cache = CacheBudget(num_blocks=256)
    sched = SlosScheduler(perf, cache)
    executor = PerfExecutor(perf, cache)
    d = request("d", 2000, 50, ttft_s=10.0, tpot_s=1.0)
    sched.add_admitted(d, 0.0)
    executor.add(d)
    now = steps(sched, executor, 0.0, 3)
    n = request("n", 50, 4, ttft_s=0.02, tpot_s=0.05, arrival=now)
    assert sched.plan_admission([n], now).is_admitted("n")
    sched.add_admitted(n, now)
    executor.add(n)
    plan = sched.schedule(now)
    assert plan is not None and [e.request_id for e in plan.entries] == ["n"]
    _, duration = executor.execute(plan, now)
    assert now + duration <= token_deadline(n, 0)


def test_later_plans_keep_the_short_batches_a_request_was_admitted_with() -> None:
    # Due 20 ms after arrival with a 40 ms TPOT, and its third token due with its second
    # (the answer stage starts at once): admitted with 20 ms batches, it needs batches that
    # short until its third token, though the next replan has no new request asking for them.
    stages = (Stage(tpot_ms=40.0, num_tokens=2), Stage(tpot_ms=80.0, ttft_ms=0.0))
    a = request("a", 150, 3, ttft_s=0.02, tpot_s=0.08, stages=stages)
    sched = SlosScheduler(GPU_LIKE, CacheBudget(num_blocks=256))
    sched.add_request(a, 0.0)
    plan = sched.schedule(0.0)
    assert sched.verdicts["a"] and sched.budget is not None and sched.budget.period_s == 0.02
    executor = PerfExecutor(GPU_LIKE, sched.queues.budget)
    executor.add(a)
    assert plan is not None
    outcome, now = executor.execute(plan, 0.0)
    sched.update_from_outcome(plan, outcome, now)
    assert len(executor.output("a")) == 1
    result = sched.plan_admission([], now)
    # Two batches must end by token 1's and token 2's common deadline.
    assert result.forced_late == 0
    assert result.budget.period_s <= (token_deadline(a, 2) - now) / 2 + 1e-9


def test_later_plans_keep_the_next_token_of_a_decoder_on_time() -> None:
    # After its first token, `a` decodes only when due: once the short batches it was
    # admitted with end, a decoder due within 40 ms still needs a batch ending by then.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4})
    sched = SlosScheduler(perf, CacheBudget(num_blocks=256))
    a = request("a", 100, 8, ttft_s=0.02, tpot_s=0.05)
    sched.add_admitted(a, 0.0)
    executor = PerfExecutor(perf, sched.queues.budget)
    executor.add(a)
    plan = sched.schedule(0.0)
    assert plan is not None
    outcome, now = executor.execute(plan, 0.0)
    sched.update_from_outcome(plan, outcome, now)
    later = now + 0.035
    result = sched.plan_admission([], later)
    assert token_deadline(a, 1) - later < 0.05  # the tightest TPOT: the usual period
    assert result.forced_late == 0
    assert result.budget.period_s == pytest.approx(token_deadline(a, 1) - later)


def test_verdict_and_demotion_histories_keep_only_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A controller plans for days: what it remembers per request must not grow with them.
    monkeypatch.setattr(slos_module, "HISTORY", 2)
    cache = CacheBudget(64, 16)
    scheduler = SlosScheduler(GPU_LIKE, cache)
    executor = PerfExecutor(GPU_LIKE, cache)
    now = 0.0
    for i in range(3):
        r = request(f"r{i}", 8, 2, arrival=now)
        executor.add(r)
        scheduler.add_request(r, now)
        while scheduler.has_unfinished():
            now = steps(scheduler, executor, now, 1)
    assert list(scheduler.verdicts) == ["r1", "r2"]


class EveryOptionSolved(Scheduler):
    """A SlosScheduler checked before every step: its admission of what a replan would decide
    on chooses what solving every budget option would, where one keeps the running requests
    on time; where none does, what it chooses ranks no lower and admits nothing else (its
    fallback). (The check wraps it, rather than patching its methods, which the compiled
    planner calls natively.)"""

    def __init__(self, inner: SlosScheduler, group: int) -> None:
        self.inner = inner
        self.group = group

    def add_request(self, request: Request, now: float, cached: int = 0) -> None:
        self.inner.add_request(request, now, cached)

    def abort_request(self, request_id: str) -> None:
        self.inner.abort_request(request_id)

    def schedule(self, now: float) -> BatchPlan | None:
        inner = self.inner
        new, promotable, cached = inner.undecided(now)
        problems = inner.admission_problems(new + promotable, now, cached)
        best = max((solve_admission(p, self.group) for p in problems), key=AdmissionResult.rank)
        chosen = inner.plan_admission(new + promotable, now, cached)
        if best.keeps_running:
            assert (chosen.budget, chosen.admitted) == (best.budget, best.admitted)
        else:
            assert chosen.rank() >= best.rank()
            assert chosen.admitted == best.admitted or not chosen.admitted
        return inner.schedule(now)

    def update_from_outcome(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        self.inner.update_from_outcome(plan, outcome, now)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_property_admission_stops_only_at_an_option_no_later_one_beats(
    workload: tuple[list[Request], int, int], spec: bool
) -> None:
    # plan_admission stops solving at an option that keeps every running request on time and
    # admits every candidate; solving every option must choose the same.
    requests, num_blocks, group = workload
    cache = CacheBudget(num_blocks, 16)
    config = PlannerConfig(spec=SpecConfig() if spec else None, max_dp_candidates=group)
    run(EveryOptionSolved(SlosScheduler(GPU_LIKE, cache, config), group), GPU_LIKE, cache, requests)
