"""Plain-Python counters and histograms of the controller."""

from __future__ import annotations

import pytest

from cluster.messages import StepReport
from cluster.metrics import Histogram, Metrics
from replica.batch import BatchOutcome, BatchPlan, PrefillChunk, RequestOutcome


def test_histogram_buckets_are_cumulative() -> None:
    hist = Histogram((1.0, 2.0, 5.0))
    for value in (0.5, 1.0, 1.5, 7.0):
        hist.observe(value)
    assert hist.counts == [2, 3, 3]
    assert hist.count == 4
    assert hist.total == pytest.approx(10.0)


def test_histogram_bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Histogram((2.0, 1.0))


def test_a_snapshot_is_plain_data_that_later_counts_leave_alone() -> None:
    """What the controller sends the front door over Ray: copies, not its live objects."""
    metrics = Metrics()
    metrics.inc("admitted", 2)
    metrics.observe("planner_latency_s", 0.1, (0.5,))
    snapshot = metrics.snapshot()
    metrics.inc("admitted")
    metrics.observe("planner_latency_s", 0.7, (0.5,))
    assert snapshot == {
        "counters": {"admitted": 2},
        "histograms": {
            "planner_latency_s": {"bounds": [0.5], "counts": [1], "sum": 0.1, "count": 1}
        },
    }


def step(outcome: BatchOutcome, queries: int = 0, hits: int = 0) -> StepReport:
    plan = BatchPlan(tuple(PrefillChunk(o.request_id, 1) for o in outcome.outcomes))
    return StepReport(0, "i", 1, plan, outcome, 0.0, prefix_queries=queries, prefix_hits=hits)


def test_a_step_counts_its_measured_time_prefix_lookups_and_drafts() -> None:
    metrics = Metrics()
    metrics.count_step(
        step(
            BatchOutcome(
                [RequestOutcome("a", [5, 6, 7], num_draft_tokens=4, num_accepted_tokens=2)],
                draft_s=0.001,
                target_s=0.0025,
                overhead_s=0.0005,
            )
        )
    )
    metrics.count_step(step(BatchOutcome([RequestOutcome("b", [9])], target_s=0.0020004), 40, 32))
    metrics.count_step(step(BatchOutcome([RequestOutcome("c", [9])]), 20, 0))
    assert metrics.counters == {
        "steps": 3,
        "busy_us": 4000 + 2000,
        "spec_draft_tokens": 4,
        "spec_accepted_tokens": 2,
        "prefix_cache_queries": 60,
        "prefix_cache_hits": 32,
    }
