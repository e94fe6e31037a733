"""SpecServe's confidence-driven lengths: the verifier's trim, the drafter's floors, and the
simulated engine that runs them."""

from __future__ import annotations

import pytest

from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.perf_model import BatchShape, PerfModel
from replica.planner.base import CacheBudget
from replica.planner.executor import PerfExecutor, leading_accepted, token_id
from replica.planner.specserve import (
    ConfidenceCalibration,
    SpecServeLengths,
    acceptance_products,
    drafted_length,
    keeps_drafting,
)
from replica.request import SLO, Request, SamplingParams

LINEAR = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})
"""Every verify token costs 1 ms on top of a 10 ms step."""
WEIGHT_BOUND = PerfModel.synthetic({"const": 0.02}, {"const": 0.001, "tokens": 0.001})
"""Reading the weights (20 ms) bounds a step of up to 19 tokens: a verify slot is free."""


def shape(*new_tokens: int) -> BatchShape:
    drafting = [n - 1 for n in new_tokens if n > 1]
    return BatchShape(
        tuple(new_tokens), (10,) * len(new_tokens), max(drafting, default=0), len(drafting)
    )


def test_acceptance_products_and_the_drafters_rule() -> None:
    assert acceptance_products([0.5, 0.5, 0.8]) == pytest.approx([0.5, 0.25, 0.2])
    assert keeps_drafting([], 0.9), "the first draft is always made"
    assert keeps_drafting([0.1], 0.0), "no floor: draft all the plan gave"
    # Predicted acceptance of the next draft: 0.8 * 0.8 = 0.64, then 0.8 * 0.5 * 0.5 = 0.2.
    assert keeps_drafting([0.8], 0.6)
    assert not keeps_drafting([0.8, 0.5], 0.25)
    assert drafted_length([0.8, 0.5, 0.9, 0.9], 0.25) == 2
    assert drafted_length([0.8, 0.5], 0.0) == 2 and drafted_length([], 0.5) == 0


# Confidences at bin centres, whose chances the calibration's prior leaves as they are.
SURE, UNSURE = {0: [0.95, 0.95, 0.15], 1: [0.55, 0.25]}, {0: [0.55, 0.15]}


def test_the_verifier_drops_the_least_likely_drafts_while_goodput_grows() -> None:
    lengths = SpecServeLengths(LINEAR)
    # ARs: a 0.95, 0.9025, 0.135; b 0.55, 0.1375. NAT = 4.675 over 17 ms (275/s). Drop
    # 0.135: 4.54 / 16 ms (284/s); drop 0.1375: 4.4025 / 15 ms (293.5/s); dropping 0.55 next
    # would give 3.8525 / 14 ms (275/s): stop there.
    kept = lengths.verify_lengths(shape(4, 3), SURE, 2)
    assert kept == {0: 2, 1: 1}
    assert lengths.rate == pytest.approx(4.4025 / 0.015)


def test_entries_kept_whole_count_but_keep_their_drafts() -> None:
    lengths = SpecServeLengths(LINEAR)
    # Entry 0 may not be cut: its 0.135 stays, so the verifier cuts b's 0.1375 and then finds
    # nothing else worth cutting (b's first draft always stays).
    assert lengths.verify_lengths(shape(4, 3), SURE, 2, whole={0}) == {0: 3, 1: 1}


def test_the_verifier_keeps_every_draft_where_verify_slots_are_free() -> None:
    lengths = SpecServeLengths(WEIGHT_BOUND)
    assert lengths.verify_lengths(shape(4, 3), SURE, 2) == {0: 3, 1: 2}


def test_work_without_confidences_counts_in_the_step_time() -> None:
    # Alone, a decode drops its 0.0825 draft: 1.6325 tokens / 13 ms < 1.55 / 12 ms.
    alone = SpecServeLengths(LINEAR)
    assert alone.verify_lengths(shape(3), UNSURE, 1) == {0: 1}
    # Beside a 30-token prefill chunk the step is 43 ms, which one slot barely changes:
    # 1.6325 / 43 ms > 1.55 / 42 ms, so the draft stays.
    beside = SpecServeLengths(LINEAR)
    assert beside.verify_lengths(shape(3, 30), UNSURE, 1) == {0: 2}
    assert beside.rate == pytest.approx(1.6325 / 0.043)


def test_the_drafters_floor_is_the_last_goodput_times_a_verify_slot() -> None:
    lengths = SpecServeLengths(LINEAR)
    assert lengths.draft_floors(shape(5, 1, 3), [0, 2]) == [0.0, 0.0], "nothing observed yet"
    lengths.verify_lengths(shape(4, 3), SURE, 2)
    floors = lengths.draft_floors(shape(5, 1, 3), [0, 1, 2])
    assert floors == pytest.approx([lengths.rate * 0.001, 0.0, lengths.rate * 0.001])


Draws = dict[str, tuple[list[float], list[bool]]]


def prefilled(lengths: SpecServeLengths, draws: Draws) -> PerfExecutor:
    """A simulated SpecServe engine holding requests a and b, prefilled, whose drafts come
    with `draws` (confidences, and whether the target accepts each)."""
    executor = PerfExecutor(
        LINEAR, CacheBudget(64, 16), specserve=(lengths, lambda rid, k: draws[rid])
    )
    for rid in "ab":
        request = Request(rid, [1] * 10, SamplingParams(max_tokens=20), SLO(1000.0, 500.0))
        executor.add(request)
        executor.execute(BatchPlan((PrefillChunk(rid, 10),)), 0.0)
    return executor


def test_the_simulated_engine_verifies_only_what_specserve_keeps() -> None:
    draws: Draws = {"a": (SURE[0], [True, False, True]), "b": (SURE[1], [True, True])}
    executor = prefilled(SpecServeLengths(LINEAR), draws)
    outcome, duration = executor.execute(BatchPlan((DecodeStep("a", 3), DecodeStep("b", 2))), 1.0)
    # The verifier keeps a's first two drafts and b's first (as in the hand-worked trim
    # above); a's second is refused, b's first accepted.
    assert duration == pytest.approx(0.015)
    got = {o.request_id: (o.num_draft_tokens, o.num_accepted_tokens) for o in outcome.outcomes}
    assert got == {"a": (2, 1), "b": (1, 1)}
    assert executor.output("b") == [token_id("b", j) for j in range(3)]
    assert executor.drafted[-2:] == [2, 1] and executor.accepted_drafts == 2


def test_the_simulated_drafter_stops_below_its_floor() -> None:
    draws: Draws = {"a": ([0.95, 0.45, 0.95, 0.95], [True] * 4), "b": ([0.95] * 4, [True] * 4)}
    lengths = SpecServeLengths(LINEAR)
    lengths.rate = 400.0  # a verify slot (1 ms) is worth 0.4 tokens: the floor
    executor = prefilled(lengths, draws)
    outcome, _ = executor.execute(BatchPlan((DecodeStep("a", 4), DecodeStep("b", 4))), 1.0)
    # a: after 0.95, 0.45 the next is predicted 0.4275 * 0.45 = 0.19 < 0.4: two drafts. b:
    # 0.95^4 = 0.81 still clears it: all four. The verifier then keeps all six: dropping a's
    # 0.4275 would turn 6.90 tokens / 18 ms into 6.47 / 17 ms, less.
    got = {o.request_id: o.num_draft_tokens for o in outcome.outcomes}
    assert got == {"a": 2, "b": 4}


def test_leading_accepted_counts_up_to_the_first_refusal() -> None:
    assert leading_accepted([True, True, False, True]) == 2
    assert leading_accepted([]) == 0


def test_the_calibration_learns_each_bins_acceptance_from_judged_drafts() -> None:
    calibration = ConfidenceCalibration(bins=10, prior_weight=4.0, window=1000)
    assert calibration.chances([0.05, 0.51, 1.0]) == pytest.approx([0.05, 0.55, 0.95])
    # A flat draft whose top token the target keeps anyway: 0.05 accepted, twice, then
    # refused; the 0.51 after the refusal was never judged.
    for _ in range(36):
        calibration.observe([0.05, 0.05, 0.05, 0.51], 2)
    table = calibration.table()
    assert table[0] == pytest.approx((0.2 + 72) / (4 + 108))
    assert table[5] == pytest.approx(0.55), "drafts after a refusal are not judged"
    # Past its window a bin halves its counts: recent verifies weigh more.
    short = ConfidenceCalibration(bins=10, prior_weight=4.0, window=100)
    for _ in range(36):
        short.observe([0.05, 0.05, 0.05], 2)
    # The 97th judged draft takes the bin past 100: halved to 50.5, then 11 more.
    assert short.judged[0] == pytest.approx((4 + 97) / 2 + 11)
    assert 0.6 < short.table()[0] < 2 / 3


def test_a_calibration_refuses_what_it_cannot_count_and_bins_nan_low() -> None:
    for bad in ({"bins": 0}, {"prior_weight": 0.0}, {"window": 0}):
        with pytest.raises(ValueError, match="calibration needs"):
            ConfidenceCalibration(**bad)
    calibration = ConfidenceCalibration()
    assert calibration.chances([float("nan"), -0.1, 1.0]) == pytest.approx([0.05, 0.05, 0.95])
