"""AdaServe's step-level choices: tokens each request must gain, and the draft calibration."""

from __future__ import annotations

import pytest

from replica.batch import BatchPlan, DecodeStep
from replica.perf_model import BatchShape, PerfModel
from replica.planner.adaserve import AdaServeConfig, AdaServeTrees, tokens_needed
from replica.request import SLO, Request, SamplingParams, Stage, Tier
from replica.spec.tree import TokenTree

STEP = PerfModel.synthetic({"const": 0.04, "tokens": 0.005})
"""A step of two tokens takes 50 ms."""


def _request(slo: SLO | None, arrival: float = 0.0, tier: Tier = Tier.SLO) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=64), slo, tier, arrival)


def test_tokens_needed_is_the_lag_behind_the_deadline_line_in_tpots() -> None:
    """Token j is due at arrival + TTFT + j x TPOT: at the deadline of token `out` the request
    needs that one token, a TPOT later two, half a TPOT earlier a half."""
    r = _request(SLO(ttft_ms=1000, tpot_ms=100), arrival=10.0)
    assert tokens_needed(r, 5, 11.5) == pytest.approx(1.0)
    assert tokens_needed(r, 5, 11.6) == pytest.approx(2.0)
    assert tokens_needed(r, 5, 11.45) == pytest.approx(0.5)
    assert tokens_needed(r, 5, 10.0) < 0


def test_a_stage_sets_the_tpot_the_lag_is_counted_in() -> None:
    stages = (Stage(tpot_ms=50, num_tokens=4, name="think"), Stage(tpot_ms=200, name="answer"))
    r = _request(SLO(ttft_ms=1000, tpot_ms=200, stages=stages))
    thinking = tokens_needed(r, 2, 1.1 + 0.05)
    assert thinking == pytest.approx(1.0 + (1.15 - 1.1) / 0.05)


def test_best_effort_requests_need_nothing() -> None:
    assert tokens_needed(_request(None, tier=Tier.BEST_EFFORT), 0, 100.0) == 0.0
    late = _request(SLO(ttft_ms=100, tpot_ms=10), tier=Tier.BEST_EFFORT)
    assert tokens_needed(late, 0, 100.0) == 0.0


def test_needs_are_read_at_the_predicted_end_of_the_step() -> None:
    trees = AdaServeTrees(STEP, clock=lambda: 11.45)
    r = _request(SLO(ttft_ms=1000, tpot_ms=100), arrival=10.0)
    shape = BatchShape.of_plan(BatchPlan((DecodeStep("r", 1),)), lambda _rid: 8)
    (need,) = trees.needs([(r, 5)], shape)
    assert need == pytest.approx(1.0)


def test_calibration_learns_per_sibling_rank_and_reweights_the_tree() -> None:
    """A draft whose first choices at 0.3 are always accepted and second choices never: the
    calibrated tree values the first choice's child above its sibling, though the raw draft
    probabilities say otherwise."""
    tree = TokenTree.root(5)
    first = tree.add(0, 6, 0.3)
    tree.add(0, 7, 0.25)
    child = tree.add(first, 8, 0.3 * 0.3)
    trees = AdaServeTrees(STEP)
    raw = trees.calibrated(tree)
    assert raw.probs[2] > raw.probs[3]
    for _ in range(200):
        trees.observe(tree, [first, child])
    learned = trees.calibrated(tree)
    assert learned.probs[3] > learned.probs[2]
    assert learned.probs[first] > 0.9 and learned.probs[2] < 0.1


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match=r"adaserve\.max_width"):
        AdaServeConfig(max_width=0)
    with pytest.raises(ValueError, match=r"adaserve\.max_nodes"):
        AdaServeConfig(max_nodes=-1)
