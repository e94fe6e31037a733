"""Batch formation: what rides in a batch beside the work the plan promised."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replica.batch import BatchOutcome, BatchPlan, DecodeStep, PrefillChunk, RequestOutcome
from replica.perf_model import BatchShape, PerfModel
from replica.planner.base import CacheBudget
from replica.planner.batching import SloWork, form_batch
from replica.planner.budget import BatchBudget, TierLoad, plan_budgets
from replica.planner.queues import RequestQueues
from replica.request import SLO, Request, SamplingParams, Tier


def of_period(period_s: float) -> BatchBudget:
    """A budget of this period (all an SloWork reads of one that does not speculate)."""
    return BatchBudget(period_s, 1, 1, 1, 1, 0.0, 0, 0, 0)


def decoders_ahead(
    queues: RequestQueues, count: int, context: int, max_tokens: Sequence[int] = ()
) -> list[SloWork]:
    """Requests with their prompt done and one token out, ten seconds ahead of their line
    (`max_tokens` of the first ones, else 100)."""
    caps = [*max_tokens, *[100] * (count - len(max_tokens))]
    requests = [
        Request(
            f"d{i}",
            [1] * context,
            SamplingParams(max_tokens=caps[i], ignore_eos=True),
            SLO(ttft_ms=10_000, tpot_ms=100),
            tier=Tier.SLO,
        )
        for i in range(count)
    ]
    for r in requests:
        queues.add(r)
    queues.apply(
        BatchPlan(entries=tuple(PrefillChunk(r.request_id, context) for r in requests)),
        BatchOutcome(
            outcomes=[
                RequestOutcome(r.request_id, [7], num_computed_tokens=context) for r in requests
            ]
        ),
        0.0,
    )
    return [SloWork.of(queues.states[r.request_id], 0.0, of_period(0.1), 0.5) for r in requests]


def drafts(draft_step_s: float, ride_spec_tokens: int, count: int = 4) -> list[int]:
    # Memory-bound: 15 ms a batch whatever its tokens, plus the draft steps.
    perf = PerfModel.synthetic({"const": 0.015, "tokens": 1e-5, "draft_steps": draft_step_s})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = decoders_ahead(queues, count, 64)
    (budget,) = plan_budgets(
        perf,
        [TierLoad(0.1, count)],
        num_requests=count,
        max_context=164,
        kv_tokens=count * 164,
        idle_period_s=0.05,
        acceptance=0.6,
    )
    assert budget.draft_steps == 0  # autoregressive: the plan promises one token a batch
    plan = form_batch(0.01, budget, perf, works, [], queues, 0, 8, 0.1, ride_spec_tokens)
    assert plan is not None and len(plan.entries) == count
    steps = [e for e in plan.entries if isinstance(e, DecodeStep)]
    return [e.num_spec_tokens for e in steps]


@pytest.mark.parametrize(
    ("draft_step_s", "ride_spec_tokens", "expected"),
    [
        (5e-4, 4, 4),  # 2.3 tokens for 17 ms beats 1 token for 15 ms and every length between
        (5e-4, 0, 0),  # not allowed to (the scheduler allows it while KV binds or no prompt waits)
        (0.02, 4, 0),  # a 20 ms draft step: 1.6 tokens for 35 ms lose to 1 for 15 ms
    ],
)
def test_decoders_ahead_of_their_line_speculate_as_far_as_it_pays(
    draft_step_s: float, ride_spec_tokens: int, expected: int
) -> None:
    assert drafts(draft_step_s, ride_spec_tokens) == [expected] * 4


def test_decoders_ahead_of_their_line_ride_only_within_the_period() -> None:
    # 40 ms a decoder: two of three fit the 100 ms period after the 15 ms fixed cost.
    perf = PerfModel.synthetic({"const": 0.015, "tokens": 1e-6, "requests": 0.04})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = decoders_ahead(queues, 3, 64)
    # A budget sized for one of them (as urgent budgets leave out decoders far ahead).
    (budget,) = plan_budgets(
        perf,
        [TierLoad(0.1, 1)],
        num_requests=1,
        max_context=164,
        kv_tokens=164,
        idle_period_s=0.05,
    )
    plan = form_batch(0.01, budget, perf, works, [], queues, 0, 8, 0.1)
    assert plan is not None and [e.request_id for e in plan.entries] == ["d0", "d1"]


def test_decoders_ahead_of_their_line_ride_only_in_the_tokens_left() -> None:
    # Time is no bound here (15 ms a batch, 100 ms period): the budget's 3 tokens are. Three
    # plain decodes (3 tokens for 15.03 ms) beat one decoder drafting 1 or 2 of them (2.6 or
    # 1.96 tokens for a batch a draft step longer); lengths 3 and 4 are length 2 again.
    perf = PerfModel.synthetic({"const": 0.015, "tokens": 1e-5, "draft_steps": 5e-4})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = decoders_ahead(queues, 4, 64)
    budget = BatchBudget(0.1, 3, 4, 164, 4 * 164, 0.6, 4, 0, 0)
    plan = form_batch(0.01, budget, perf, works, [], queues, 0, 8, 0.1, 4)
    assert plan is not None
    assert plan.entries == (DecodeStep("d0", 0), DecodeStep("d1", 0), DecodeStep("d2", 0))


def test_decoders_ahead_of_their_line_draft_no_further_than_their_output_and_the_tokens() -> None:
    # 15 ms a batch, 0.2 ms a draft step, 11 tokens. Drafting 4 beyond the budget: d0 has 2
    # tokens to go (1 draft), d1 drafts 4, d2 gets the 4 tokens left (3 drafts): 6.08 tokens
    # expected for 15.91 ms beat every shorter length (3: 5.95 for 15.7 ms).
    perf = PerfModel.synthetic({"const": 0.015, "tokens": 1e-5, "draft_steps": 2e-4})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = decoders_ahead(queues, 3, 64, max_tokens=[3])
    budget = BatchBudget(0.1, 11, 3, 164, 3 * 164, 0.6, 4, 0, 0)
    plan = form_batch(0.01, budget, perf, works, [], queues, 0, 8, 0.1, 4)
    assert plan is not None
    assert plan.entries == (DecodeStep("d0", 1), DecodeStep("d1", 4), DecodeStep("d2", 3))


def test_decoders_ahead_of_their_line_may_draft_one_beyond_the_budgets_length() -> None:
    # A speculating budget drafts 1 for each decoder; riding, 2 pay best at 3 ms a draft step:
    # 4 x 1.96 tokens for 21.1 ms beat 4 x 1.6 for 18.1 ms and 4 x 2.18 for 24.2 ms.
    perf = PerfModel.synthetic({"const": 0.015, "tokens": 1e-5, "draft_steps": 0.003})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = decoders_ahead(queues, 4, 64)
    budget = BatchBudget(0.1, 100, 4, 164, 4 * 164, 0.6, 4, 1, 4, min_spec_len=1)
    assert budget.spec_len(0.1) == 1
    plan = form_batch(0.01, budget, perf, works, [], queues, 0, 8, 0.1, 4)
    assert plan is not None
    assert [e.num_spec_tokens for e in plan.entries] == [2] * 4


def prompt(queues: RequestQueues, rid: str, tokens: int, ttft_s: float) -> SloWork:
    request = Request(
        rid,
        [1] * tokens,
        SamplingParams(max_tokens=4, ignore_eos=True),
        SLO(ttft_ms=ttft_s * 1e3, tpot_ms=50),
        tier=Tier.SLO,
    )
    queues.add(request)
    return SloWork.of(queues.states[rid], 0.0, of_period(0.05), 0.5)


def test_a_batch_cut_at_a_prompts_deadline_holds_what_its_own_price_fits() -> None:
    # 4 ms + 1 ms a request + 0.1 ms a token; the budget's worst case is a batch of 8
    # requests: 179 tokens within the 30 ms cut at a's deadline (180, rounded down). This
    # batch has 2 requests and fits 240: b, due 5 ms later, is finished too (a batch of its
    # own could not be).
    perf = PerfModel.synthetic({"const": 0.004, "requests": 1e-3, "tokens": 1e-4})
    queues = RequestQueues(CacheBudget(num_blocks=256))
    works = [prompt(queues, "a", 100, 0.03), prompt(queues, "b", 130, 0.035)]
    budget = BatchBudget(0.05, 380, 8, 256, 0, 0.0, 0, 0, 0)
    assert budget.tokens_within(perf, 0.03) < 100 + 130  # 179: not both in the worst case
    plan = form_batch(0.0, budget, perf, works, [], queues, 0, 8, 0.1)
    assert plan is not None
    assert plan.entries == (PrefillChunk("a", 100), PrefillChunk("b", 130))
    assert perf.predict(BatchShape.of_plan(plan, lambda _rid: 0)) <= 0.03
