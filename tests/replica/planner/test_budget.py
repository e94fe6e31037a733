"""The budget function: batch period, batch size and SLO-adaptive speculation lengths."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from replica.batch import RequestOutcome
from replica.perf_model import PerfModel
from replica.planner.budget import (
    AcceptanceEstimate,
    BatchBudget,
    TierLoad,
    WorstBatch,
    expected_tokens,
    judged_drafts,
    outcome_judged,
    plan_budgets,
)
from replica.planner.config import InvocationConfig, PlannerConfig, SpecConfig

# 10 ms fixed cost, 0.1 ms per token, a cheap draft model.
PERF = PerfModel.synthetic(
    {"const": 0.01, "tokens": 1e-4, "draft_steps": 5e-4, "draft_tokens": 1e-5}
)


def budgets(
    loads: list[TierLoad], acceptance: float = 0.0, spec: SpecConfig | None = None
) -> tuple[BatchBudget, ...]:
    return plan_budgets(
        PERF,
        loads,
        num_requests=sum(load.num_decoders for load in loads),
        max_context=1,
        kv_tokens=0,
        idle_period_s=0.05,
        spec=spec,
        acceptance=acceptance,
    )


def test_expected_tokens_matches_the_geometric_series() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4.0


def test_autoregressive_period_is_the_tightest_tpot_and_batch_fills_it() -> None:
    (budget,) = budgets([TierLoad(0.05, 10), TierLoad(0.2, 20)])
    assert budget.period_s == 0.05
    assert budget.batch_tokens == 400  # (50 ms - 10 ms) / 0.1 ms
    # Loose decoders cost a quarter token per batch: EDF serves them every 4th batch.
    assert budget.cost_per_batch(0.2) == pytest.approx(0.25)
    assert budget.prefill_tokens([TierLoad(0.05, 10), TierLoad(0.2, 20)]) == pytest.approx(385)


def test_dynamic_batch_size_grows_with_a_looser_tightest_tier() -> None:
    (tight,) = budgets([TierLoad(0.02, 5)])
    (loose,) = budgets([TierLoad(0.05, 5)])
    assert tight.batch_tokens / tight.period_s < loose.batch_tokens / loose.period_s


def test_speculation_is_chosen_when_it_pays_and_looser_tiers_keep_the_tightest_pace() -> None:
    spec = SpecConfig(max_spec_tokens=4)
    loads = [TierLoad(0.02, 2), TierLoad(0.2, 2)]
    best, autoregressive = budgets(loads, 0.8, spec)
    assert best.draft_steps > 0 and autoregressive.draft_steps == 0
    assert best.period_s > 0.02
    s = best.spec_len(0.02)
    assert expected_tokens(0.8, s) >= best.period_s / 0.02 - 1e-9
    # The 200 ms tier would keep up with no drafts, yet it speculates as much as the tightest
    # tier (a token per stretched period would be slower than autoregressive batches give it),
    # every decoder drafts, and the budget pays s + 1 tokens per batch for each.
    assert best.period_s < 0.2 and best.spec_len(0.2) == s and best.min_spec_len == s
    assert best.draft_batch == 4
    assert best.cost_per_batch(0.2) == s + 1
    assert best.prefill_tokens(loads) == pytest.approx(best.batch_tokens - 4 * (s + 1))
    assert autoregressive.spec_len(0.2) == 0


def test_speculating_options_are_sized_for_every_decoder_autoregressive_for_their_share() -> None:
    # Two 20 ms decoders and two of 200 ms: an autoregressive batch is due for the 200 ms ones
    # a tenth of the time (the caller counts 2 + 2 x 0.1 -> 3 requests), a speculating batch
    # drafts and verifies all four, reading all their KV.
    spec = SpecConfig(max_spec_tokens=4)
    loads = [TierLoad(0.02, 2), TierLoad(0.2, 2)]
    every = WorstBatch(num_requests=4, max_context=100, kv_tokens=400)
    common = {"max_context": 100, "idle_period_s": 0.05, "spec": spec, "acceptance": 0.8}
    best, autoregressive = plan_budgets(
        PERF, loads, num_requests=3, kv_tokens=220, speculating_batch=every, **common
    )
    assert best.draft_steps > 0 and (best.num_requests, best.kv_tokens) == (4, 400)
    assert autoregressive.draft_steps == 0
    assert (autoregressive.num_requests, autoregressive.kv_tokens) == (3, 220)
    with pytest.raises(ValueError, match="below the 4 decoders"):
        plan_budgets(PERF, loads, num_requests=3, kv_tokens=220, **common)
    short = WorstBatch(num_requests=3, max_context=100, kv_tokens=300)
    with pytest.raises(ValueError, match="below the 4 decoders"):
        plan_budgets(PERF, loads, num_requests=4, kv_tokens=400, speculating_batch=short, **common)


def test_no_speculation_under_heavy_load_or_poor_acceptance() -> None:
    spec = SpecConfig(max_spec_tokens=4)
    heavy = budgets([TierLoad(0.05, 350)], 0.8, spec)
    assert heavy[0].draft_steps == 0
    (poor,) = budgets([TierLoad(0.05, 2)], 0.0, spec)
    assert poor.draft_steps == 0 and poor.spec_len(0.05) == 0


def test_acceptance_estimate_moves_toward_observations_and_stays_capped() -> None:
    estimate = AcceptanceEstimate(SpecConfig(initial_acceptance=0.5, ema_weight=0.5))
    estimate.observe(judged=4, accepted=4)
    assert estimate.value == pytest.approx(0.75)
    for _ in range(20):
        estimate.observe(judged=4, accepted=4)
    assert estimate.value == pytest.approx(0.95)
    estimate.observe(judged=0, accepted=0)
    assert estimate.value == pytest.approx(0.95)
    with pytest.raises(ValueError, match="accepted=5"):
        estimate.observe(judged=4, accepted=5)


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: PlannerConfig(memory_units=0), "memory_units"),
        (lambda: PlannerConfig(idle_period_s=-1.0), "idle_period_s"),
        (lambda: SpecConfig(max_spec_tokens=-1), "max_spec_tokens"),
        (lambda: SpecConfig(initial_acceptance=1.5), "initial_acceptance"),
        (lambda: InvocationConfig(interval_s=0.0), "interval_s"),
        (lambda: InvocationConfig(behind_tpot_factor=0.0), "behind_tpot_factor"),
    ],
)
def test_config_rejects_bad_values_by_name(factory: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        factory()


def test_a_budget_whose_worst_case_overruns_the_period_still_holds_one_token() -> None:
    # Reading 2000 cached tokens alone takes 20 ms, the whole TPOT: the worst-case batch fits
    # no token, yet the running decoders must progress.
    slow = PerfModel.synthetic({"const": 0.01, "tokens": 0.001, "kv_tokens": 1e-5})
    (budget,) = plan_budgets(
        slow,
        [TierLoad(0.02, 4)],
        num_requests=4,
        max_context=500,
        kv_tokens=2000,
        idle_period_s=0.05,
    )
    assert budget.batch_tokens == 1


def test_an_urgent_period_adds_a_shorter_autoregressive_budget() -> None:
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})

    def periods(*urgent: float, min_period: float = 0.0) -> list[float]:
        budgets = plan_budgets(
            perf,
            [TierLoad(0.05, 2)],
            num_requests=2,
            max_context=100,
            kv_tokens=200,
            idle_period_s=0.05,
            min_period_s=min_period,
            urgent_periods_s=urgent,
        )
        return [b.period_s for b in budgets]

    assert periods(0.03) == pytest.approx([0.05, 0.03])
    assert periods(0.06) == pytest.approx([0.05])
    assert periods(0.03, min_period=0.04) == pytest.approx([0.05])
    assert periods(0.0) == pytest.approx([0.05])
    # Shorter than one batch's fixed cost: no token fits, so no such budget is offered.
    assert periods(0.008) == pytest.approx([0.05])
    # The most urgent new request and the most urgent admitted one may each need their own.
    assert periods(0.03, 0.02) == pytest.approx([0.05, 0.02, 0.03])


def test_urgent_budgets_are_sized_for_their_own_batch() -> None:
    # The main batch reads 20000 cached tokens (20 ms at 1 us): a period below that serves
    # no one. Urgent options sized for a batch without the far-ahead decoders still fit.
    perf = PerfModel.synthetic({"const": 0.004, "tokens": 1e-4, "kv_tokens": 1e-6})
    loads = [TierLoad(0.05, 3)]
    main = {"num_requests": 3, "max_context": 8000, "kv_tokens": 20000}
    near = WorstBatch(num_requests=1, max_context=100, kv_tokens=100, min_period_s=0.0041)
    alone = plan_budgets(
        perf, loads, **main, idle_period_s=0.05, min_period_s=0.0241, urgent_periods_s=(0.015,)
    )
    assert [b.period_s for b in alone] == pytest.approx([0.05])
    budgets = plan_budgets(
        perf,
        loads,
        **main,
        idle_period_s=0.05,
        min_period_s=0.0241,
        urgent_periods_s=(0.015,),
        urgent_batch=near,
    )
    assert [b.period_s for b in budgets] == pytest.approx([0.05, 0.015])
    urgent = budgets[1]
    assert (urgent.num_requests, urgent.kv_tokens) == (1, 100)
    # (15 ms - 4 ms - 0.1 ms of cached KV) at 0.101 ms a token (its own KV entry included)
    assert urgent.batch_tokens == 107


def test_urgent_budgets_draft_only_for_the_decoders_in_their_batch() -> None:
    # Three decoders behind their line are held to 5 ms, below the 20 ms floor: every period
    # exceeds their TPOT, so they draft even in the 15 ms urgent option, whose batch holds
    # only one of them.
    loads = [TierLoad(0.005, 3)]
    near = WorstBatch(num_requests=1, max_context=100, kv_tokens=100, min_period_s=0.011)
    budgets = plan_budgets(
        PERF,
        loads,
        num_requests=3,
        max_context=100,
        kv_tokens=300,
        idle_period_s=0.05,
        min_period_s=0.02,
        urgent_periods_s=(0.015,),
        urgent_batch=near,
        spec=SpecConfig(max_spec_tokens=4),
        acceptance=0.6,
    )
    urgent = budgets[-1]
    assert urgent.period_s == pytest.approx(0.015)
    assert (urgent.num_requests, urgent.draft_batch) == (1, 1)
    assert urgent.draft_steps > 0


def test_a_chain_of_crowded_deadlines_is_paced_at_the_tokens_a_verify_yields() -> None:
    # Tokens due 100, 115, 130, 130 ms (the last one's stage starts with no gap).
    chain = (0.100, 0.115, 0.130, 0.130)
    plain = BatchBudget(0.015, 100, 4, 64, 256, 0.0, 0, 0, 0)
    # One token a 15 ms batch: the last, three batches after the first, pulls it to 85 ms.
    assert plain.chain_deadline(chain, 0.015, False) == pytest.approx(0.085)
    assert plain.chain_deadline(chain, 0.015, True) == pytest.approx(0.085)
    # 24 ms batches verifying one draft, both accepted: 2 tokens a batch, one every 12 ms.
    spec = BatchBudget(0.024, 100, 4, 64, 256, 1.0, 4, 1, 4, min_spec_len=1)
    assert spec.chain_deadline(chain, 0.015, False) == pytest.approx(0.130 - 3 * 0.012)
    # After a prompt's first token the first verify is a whole period away.
    assert spec.chain_deadline(chain, 0.015, True) == pytest.approx(0.130 - 0.024 - 2 * 0.012)


def test_drafts_after_the_first_rejection_are_not_judged() -> None:
    assert [judged_drafts(4, a) for a in range(5)] == [1, 2, 3, 4, 4]
    assert judged_drafts(0, 0) == 0


def test_a_tree_verify_counts_the_drafts_its_walk_judged() -> None:
    """Eight tree nodes, two accepted down to a leaf: two judged, not the chain's three."""
    tree = RequestOutcome("t", num_draft_tokens=8, num_accepted_tokens=2, num_judged_drafts=2)
    assert outcome_judged(tree) == 2
    assert outcome_judged(RequestOutcome("c", num_draft_tokens=8, num_accepted_tokens=2)) == 3


def test_a_cut_batch_is_priced_by_the_worst_case_and_a_cut_costs_a_one_token_batch() -> None:
    # 10 ms fixed, 0.1 ms a token: a 50 ms period holds 400 tokens. At worst a cut leaves
    # 10.1 ms (a one-token batch's time, less a hair) that hold nothing, and 39.9 ms hold 299:
    # 101 tokens lost, and 2 for the capacities' rounding.
    (budget,) = budgets([TierLoad(0.05, 10)])
    assert budget.tokens_within(PERF, 0.03) == 200
    assert budget.seconds_for(PERF, 200) == pytest.approx(0.03)
    assert budget.cut_tokens(PERF) == 103


FLOOR = PerfModel.synthetic(
    {"const": 0.004, "tokens": 5e-5, "attn_tokens": 2e-8},
    {"const": 0.006, "requests": 2e-4, "kv_tokens": 1e-7},
)
"""Short batches cost at least a floor (reading the weights), as on a GPU."""


@given(
    perf=st.sampled_from([PERF, FLOOR]),
    period=st.floats(0.012, 0.2),
    cut=st.floats(0.0, 1.0),
)
@example(perf=PERF, period=0.03, cut=0.49)
def test_no_cut_of_a_period_loses_more_than_cut_tokens(
    perf: PerfModel, period: float, cut: float
) -> None:
    """Wherever a boundary splits a period, the two batches hold at least the period's
    tokens less `cut_tokens` (the example: 102 lost, one more than the cut's time alone)."""
    (budget,) = plan_budgets(
        perf,
        [TierLoad(period, 10)],
        num_requests=10,
        max_context=1,
        kv_tokens=0,
        idle_period_s=period,
    )
    first = cut * budget.period_s
    held = budget.tokens_within(perf, first) + budget.tokens_within(perf, budget.period_s - first)
    assert held >= budget.batch_tokens - budget.cut_tokens(perf)
