"""The DP admission on hand-made problems (Figures 3 and 5 of the paper, memory, values)."""

from __future__ import annotations

from dataclasses import replace

from replica.perf_model import PerfModel
from replica.planner.admission import (
    AdmissionProblem,
    AdmissionResult,
    Candidate,
    RunningDecoders,
    RunningPrefill,
    solve_admission,
)
from replica.planner.budget import BatchBudget, TierLoad, plan_budgets

SIX_PER_UNIT = PerfModel.synthetic(
    {"tokens": 1 / 6}
)  # Figure 3: six tokens per time unit (1 s here)


def budget_for(perf: PerfModel, loads: list[TierLoad]) -> BatchBudget:
    (budget,) = plan_budgets(
        perf,
        loads,
        num_requests=sum(load.num_decoders for load in loads),
        max_context=1,
        kv_tokens=0,
        idle_period_s=1.0,
    )
    return budget


def figure3(num_new: int = 4) -> AdmissionProblem:
    """Three decodes due every unit from now + 1; four 6-token prompts due in 6 units."""
    return AdmissionProblem(
        now=0.0,
        budget=budget_for(SIX_PER_UNIT, [TierLoad(1.0, 3 + num_new)]),
        candidates=tuple(Candidate(f"new{i}", 6, 6.0, 1.0, 4, 1) for i in range(num_new)),
        prefills=(),
        decoders=RunningDecoders.of([(1.0, 1.0, 20, 0)] * 3),
        free_blocks=1000,
        memory_units=16,
        perf=SIX_PER_UNIT,
    )


def test_figure3_admits_exactly_three_of_four() -> None:
    problem = figure3()
    assert problem.budget.period_s == 1.0 and problem.budget.batch_tokens == 6
    result = solve_admission(problem)
    assert result.forced_feasible
    assert result.admitted == ("new0", "new1", "new2")
    assert result.declined == ("new3",)


def test_decodes_with_banked_slack_leave_room_for_an_earlier_deadline() -> None:
    urgent = tuple(Candidate(f"u{i}", 6, 3.0, 1.0, 4, 1) for i in range(2))
    on_time = replace(figure3(), candidates=urgent)
    assert len(solve_admission(on_time).admitted) == 1
    # Two tokens ahead, the decoders need one token each in the first three units, not three.
    ahead = replace(on_time, decoders=RunningDecoders.of([(3.0, 1.0, 20, 0)] * 3))
    assert len(solve_admission(ahead).admitted) == 2


def test_figure5_dynamic_batch_size_admits_what_a_fixed_size_cannot() -> None:
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 1e-4})
    decoders = RunningDecoders.of([(0.05, 0.05, 100, 0)] * 4)
    new = (Candidate("long", 600, 0.1, 0.05, 10, 1),)
    dynamic = budget_for(perf, [TierLoad(0.05, 5)])
    # A fixed batch size set for the tightest TPOT the system supports (20 ms).
    fixed = budget_for(perf, [TierLoad(0.02, 5)])
    problem = AdmissionProblem(0.0, dynamic, new, (), decoders, 1000, 16, perf)
    assert solve_admission(problem).admitted == ("long",)
    assert solve_admission(replace(problem, budget=fixed)).admitted == ()


def test_memory_bounds_admission_and_value_picks_the_heavier_request() -> None:
    problem = replace(figure3(num_new=2), free_blocks=10, memory_units=10)
    light = Candidate("light", 6, 6.0, 1.0, 4, 6, value=1.0)
    heavy = Candidate("heavy", 6, 6.0, 1.0, 4, 6, value=3.0)
    result = solve_admission(replace(problem, candidates=(light, heavy)))
    assert result.admitted == ("heavy",) and result.value == 3.0


def test_running_prefill_is_forced_in_and_can_make_the_plan_infeasible() -> None:
    late = RunningPrefill(prefill_tokens=60, deadline_s=2.0, tpot_s=1.0, decode_tokens=4)
    result = solve_admission(replace(figure3(), prefills=(late,)))
    assert result.admitted == ()
    assert result.forced_late == 1


def test_options_that_keep_no_running_request_feasible_rank_by_their_pace() -> None:
    """Each leaves a request late in the DP's worst case; the real batches, cheaper than
    that, clear the work soonest at the most tokens a second."""
    prompt = RunningPrefill(prefill_tokens=30, deadline_s=6.0, tpot_s=1.0, decode_tokens=4)
    slow = solve_admission(replace(figure3(0), prefills=(prompt,)))
    budget = slow.budget
    fast = solve_admission(
        replace(figure3(0), prefills=(prompt,), budget=replace(budget, batch_tokens=7))
    )
    assert not slow.forced_feasible and not fast.forced_feasible
    assert slow.forced_late == fast.forced_late
    assert max([slow, fast], key=AdmissionResult.rank) is fast
    # Feasible options still rank by admitted value, whatever their pace.
    feasible = solve_admission(figure3())
    assert feasible.rank()[:3] == (True, 0, feasible.value) and feasible.rank()[3] == 0.0


def test_tpot_tiers_let_loose_decoders_leave_room() -> None:
    new = tuple(Candidate(f"new{i}", 7, 6.0, 1.0, 4, 1) for i in range(4))
    tight = RunningDecoders.of([(1.0, 1.0, 20, 0)] * 2)
    loose = RunningDecoders.of([(1.0, 3.0, 20, 0)] * 2)
    budget = budget_for(SIX_PER_UNIT, [TierLoad(1.0, 6), TierLoad(3.0, 2)])
    problem = replace(figure3(), candidates=new, decoders=tight, budget=budget)
    assert len(solve_admission(problem).admitted) == 3
    assert len(solve_admission(replace(problem, decoders=loose)).admitted) == 4


def test_large_bursts_are_decided_in_groups_with_earlier_admissions_forced_in() -> None:
    grouped = solve_admission(figure3(), max_candidates=2)
    assert grouped.admitted == ("new0", "new1", "new2")
    assert grouped.value == 3.0 and grouped.forced_feasible


def test_a_decoder_with_tokens_crowded_together_is_late_under_a_longer_period() -> None:
    # Tokens due at 4 and 4 (a stage starting at once), one per batch: batches of 2 units
    # from now = 0 deliver them by 2 and 4; batches of 3 units only by 3 and 6.
    crowded = replace(RunningDecoders.of([(4.0, 2.0, 5, 1)]), chains=((4.0, 4.0),))
    short = budget_for(SIX_PER_UNIT, [TierLoad(2.0, 1)])
    long = budget_for(SIX_PER_UNIT, [TierLoad(3.0, 1)])
    problem = AdmissionProblem(0.0, short, (), (), crowded, 1000, 16, SIX_PER_UNIT)
    assert solve_admission(problem).forced_late == 0
    assert solve_admission(replace(problem, budget=long)).forced_late == 1


def test_a_budget_that_overruns_its_period_admits_nothing() -> None:
    overrun = replace(figure3(), budget=replace(figure3().budget, overruns=True))
    result = solve_admission(overrun)
    assert result.admitted == () and len(result.declined) == 4 and result.forced_feasible
