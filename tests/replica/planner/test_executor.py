"""The perf-model executor: token semantics, its clock, and the plans it refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.sim_spec import SeededAcceptance, SimulatedTrees
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.perf_model import PerfModel
from replica.planner.adaserve import AdaServeTrees
from replica.planner.base import CacheBudget
from replica.planner.executor import PerfExecutor, token_id
from replica.request import SLO, Request, SamplingParams, Tier

PERF = PerfModel.synthetic({"tokens": 0.5})


def make(prompt: int = 4, max_tokens: int = 4) -> Request:
    return Request("a", [1] * prompt, SamplingParams(max_tokens=max_tokens), SLO(1000.0, 500.0))


def test_prefill_samples_the_first_token_and_decode_appends_accepted_drafts() -> None:
    executor = PerfExecutor(PERF, CacheBudget(4, 4), accept=lambda _rid, k: k - 1)
    executor.add(make(prompt=4, max_tokens=5))
    outcome, duration = executor.execute(BatchPlan((PrefillChunk("a", 4),)), 0.0)
    assert duration == 2.0 and outcome.outcomes[0].new_token_ids == [token_id("a", 0)]
    outcome, _ = executor.execute(BatchPlan((DecodeStep("a", 2),)), 2.0)
    assert outcome.outcomes[0].num_accepted_tokens == 1
    assert executor.output("a") == [token_id("a", j) for j in range(3)]
    assert executor.token_times["a"] == [2.0, 3.5, 3.5]


def test_a_tensor_parallel_profile_times_steps_at_its_degree() -> None:
    split = PerfModel(PERF.terms, replace(PERF.info, tp=4))
    executor = PerfExecutor(split, CacheBudget(4, 4))
    executor.add(make(prompt=4))
    _, duration = executor.execute(BatchPlan((PrefillChunk("a", 4),)), 0.0)
    assert duration == 2.0


def test_preemption_keeps_tokens_and_resume_recomputes_them() -> None:
    executor = PerfExecutor(PERF, CacheBudget(4, 4))
    executor.add(make(prompt=4, max_tokens=3))
    executor.execute(BatchPlan((PrefillChunk("a", 4),)), 0.0)
    executor.execute(BatchPlan((DecodeStep("a"),)), 2.0)
    executor.execute(BatchPlan((), preempt=("a",)), 2.5)
    assert executor.output("a") == [token_id("a", 0), token_id("a", 1)]
    executor.execute(BatchPlan((PrefillChunk("a", 6),)), 2.5)
    assert executor.output("a") == [token_id("a", j) for j in range(3)]
    assert executor.preemptions == ["a"]
    assert executor.preempted_tokens == 5  # the prompt and the first token's KV


def test_refuses_plans_that_overrun_the_cache_or_feed_unknown_tokens() -> None:
    executor = PerfExecutor(PERF, CacheBudget(1, 4))
    executor.add(make(prompt=6))
    with pytest.raises(ValueError, match="KV blocks"):
        executor.execute(BatchPlan((PrefillChunk("a", 6),)), 0.0)
    roomy = PerfExecutor(PERF, CacheBudget(8, 4))
    roomy.add(make(prompt=6))
    with pytest.raises(ValueError, match="uncomputed"):
        roomy.execute(BatchPlan((PrefillChunk("a", 7),)), 0.0)
    with pytest.raises(ValueError, match="not decoding"):
        executor.execute(BatchPlan((DecodeStep("a"),)), 0.0)


def test_refuses_speculation_past_max_tokens() -> None:
    executor = PerfExecutor(PERF, CacheBudget(8, 4), accept=lambda _rid, k: k)
    executor.add(make(prompt=4, max_tokens=3))
    executor.execute(BatchPlan((PrefillChunk("a", 4),)), 0.0)
    with pytest.raises(ValueError, match="speculates 2 tokens with 2 to go"):
        executor.execute(BatchPlan((DecodeStep("a", 2),)), 2.0)


def test_stop_after_ends_the_request_early_even_inside_accepted_drafts() -> None:
    executor = PerfExecutor(PERF, CacheBudget(4, 4), accept=lambda _rid, k: k)
    executor.add(make(prompt=4, max_tokens=8), stop_after=3)
    executor.execute(BatchPlan((PrefillChunk("a", 4),)), 0.0)
    outcome, _ = executor.execute(BatchPlan((DecodeStep("a", 4),)), 2.0)
    assert outcome.outcomes[0].finish_reason is FinishReason.STOP
    assert executor.output("a") == [token_id("a", j) for j in range(3)]
    assert executor.release("a") == [2.0, 4.5, 4.5]
    assert "a" not in executor.sequences


def test_stop_after_must_fit_max_tokens_and_release_needs_a_finished_request() -> None:
    executor = PerfExecutor(PERF, CacheBudget(4, 4))
    with pytest.raises(ValueError, match="stop_after"):
        executor.add(make(max_tokens=4), stop_after=5)
    executor.add(make(max_tokens=4), stop_after=4)
    with pytest.raises(ValueError, match="not finished"):
        executor.release("a")


def test_a_request_started_from_a_cached_prefix_computes_the_rest_in_blocks_of_its_own() -> None:
    """Eight of ten prompt tokens were cached: the prefill feeds two, and the KV check counts
    the blocks it writes (the cache holds the other two), so it fits one block."""
    executor = PerfExecutor(PERF, CacheBudget(1, 4))
    executor.add(make(prompt=10, max_tokens=2))
    with pytest.raises(ValueError, match="cannot start 'a' from 10 cached tokens"):
        executor.start_from("a", 10)  # its last token is always left to feed
    executor.start_from("a", 8)
    with pytest.raises(ValueError, match="cannot start 'a' from 8 cached tokens"):
        executor.start_from("a", 8)  # it holds KV now
    outcome, duration = executor.execute(BatchPlan((PrefillChunk("a", 2),)), 0.0)
    assert duration == 1.0 and outcome.outcomes[0].num_computed_tokens == 10
    assert executor.output("a") == [token_id("a", 0)]
    executor.execute(BatchPlan((), preempt=("a",)), 1.0)
    assert executor.preempted_tokens == 10
    with pytest.raises(ValueError, match="KV blocks"):
        executor.execute(BatchPlan((PrefillChunk("a", 11),)), 1.0)  # all of it its own now


def _two_decoding(blocks: int) -> PerfExecutor:
    """A request far behind its SLO line and one ahead of it, both prefilled, on an executor
    verifying AdaServe's trees (the simulated draft's)."""
    perf = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})
    trees = (AdaServeTrees(perf), SimulatedTrees(SeededAcceptance(0.6, 1), (0.5, 0.25)))
    executor = PerfExecutor(perf, CacheBudget(blocks, 4), adaserve=trees)
    slo = SLO(ttft_ms=100.0, tpot_ms=10.0)
    for rid, arrival in (("late", 0.0), ("early", 0.95)):
        executor.add(Request(rid, [1] * 4, SamplingParams(max_tokens=20), slo, Tier.SLO, arrival))
    executor.execute(BatchPlan((PrefillChunk("late", 4), PrefillChunk("early", 4))), 0.95)
    return executor


def test_adaserve_trees_go_to_the_late_request_within_the_step_and_the_cache() -> None:
    plan = BatchPlan((DecodeStep("late", 3), DecodeStep("early", 3)))
    outcome, _ = _two_decoding(blocks=8).execute(plan, 1.0)
    verified = {o.request_id: o.num_draft_tokens for o in outcome.outcomes}
    assert verified["late"] > 3 and verified["early"] < 3 and sum(verified.values()) <= 6
    for o in outcome.outcomes:
        assert o.num_judged_drafts is not None
        assert o.num_accepted_tokens <= o.num_judged_drafts <= o.num_accepted_tokens + 1
    assert (outcome.draft_steps, outcome.draft_batch) == (3, 2), "3 levels for both"
    # Four blocks hold the plan's own split (4 + 4 tokens each) but not 7 + 1: it is kept.
    outcome, _ = _two_decoding(blocks=4).execute(plan, 1.0)
    assert all(o.num_draft_tokens <= 3 for o in outcome.outcomes)
