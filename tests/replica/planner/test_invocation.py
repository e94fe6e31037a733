"""When the planner replans, and how a request behind its line is planned."""

from __future__ import annotations

import numpy as np

from replica.planner.config import InvocationConfig
from replica.planner.invocation import InvocationPolicy, lags


def test_replans_on_timer_arrivals_finishes_and_drift() -> None:
    policy = InvocationPolicy(InvocationConfig(interval_s=0.1, new_requests=2, finished_requests=2))
    assert policy.due(0.0)
    policy.planned(0.0)
    assert not policy.due(0.05)
    assert policy.due(0.1)
    policy.note_new()
    assert not policy.due(0.05)
    policy.note_new()
    assert policy.due(0.05)
    policy.planned(0.05)
    policy.note_finished(2)
    assert policy.due(0.06)
    policy.planned(0.06)
    policy.note_batch(period_s=0.01, measured_s=0.011)
    assert not policy.due(0.07)
    policy.note_batch(period_s=0.01, measured_s=0.02)
    assert policy.due(0.07)


def test_only_a_decoder_newly_behind_counts_as_drift() -> None:
    policy = InvocationPolicy(InvocationConfig())
    policy.planned(0.0)
    policy.note_lagging({"a"})
    assert policy.due(0.01)
    policy.planned(0.01)
    policy.note_lagging({"a"})  # still behind: the plan already holds it tighter
    assert not policy.due(0.02)
    policy.note_lagging(set())
    policy.note_lagging({"a"})  # caught up, then fell behind again
    assert policy.due(0.02)


def test_a_decoder_without_a_period_of_lead_lags() -> None:
    assert not lags(0.15, now=0.10, period_s=0.05)
    assert lags(0.15, now=0.11, period_s=0.05)
    assert lags(np.array([0.15, 0.2]), now=0.11, period_s=0.05).tolist() == [True, False]
