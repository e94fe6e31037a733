"""Metrics on hand-made records: both attainment forms, percentiles, goodput, grouping."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loadgen.metrics import (
    attained_deadline,
    attained_paper,
    deadlines_s,
    max_windowed_tpot_s,
    mean_tpot_s,
    percentiles,
    report,
    run_span_s,
    tpot_targets_s,
    ttft_slowdown,
    windowed_tpots,
)
from loadgen.records import RequestRecord
from replica.request import SLO, Stage

SLO_100_50 = SLO(ttft_ms=100.0, tpot_ms=50.0)


def rec(times: list[float], **overrides: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "request_id": "r",
        "scenario": "chatbot",
        "slo_class": "loose/loose",
        "arrival_s": 0.0,
        "prompt_len": 10,
        "output_len": len(times) or 3,
        "slo": SLO_100_50,
        "zero_load_ttft_s": 0.05,
        "verdict": "admitted",
        "token_times_s": tuple(times),
    }
    fields.update(overrides)
    return RequestRecord(**fields)


def test_tokens_exactly_on_their_deadlines_attain() -> None:
    r = rec([0.1, 0.15, 0.2, 0.25])
    assert attained_deadline(r) and attained_paper(r)
    late = rec([0.1, 0.15, 0.2, 0.2501])
    assert not attained_deadline(late)


def test_early_tokens_bank_slack_for_a_later_stall() -> None:
    # 11 tokens within 20 ms, then a stall of 0.58 s; token 11 is due at 0.1 + 11 * 0.05.
    times = [0.01 + 0.001 * i for i in range(11)] + [0.6]
    r = rec(times)
    assert attained_deadline(r)
    assert not attained_paper(r)
    assert max_windowed_tpot_s(r) == pytest.approx((0.6 - 0.011) / 10)  # the last 10 gaps


def test_jitter_that_averages_out_passes_the_paper_form_only() -> None:
    times = [0.1]
    for i in range(10):
        times.append(times[-1] + (0.06 if i % 2 == 0 else 0.04))
    r = rec(times)
    assert not attained_deadline(r)
    assert attained_paper(r)
    ends, tpots = windowed_tpots(r)
    assert ends.tolist() == [10] and tpots.tolist() == pytest.approx([0.05])


def test_late_first_token_fails_both() -> None:
    r = rec([0.11, 0.12, 0.13])
    assert not attained_deadline(r) and not attained_paper(r)
    assert ttft_slowdown(r) == pytest.approx(2.2)


def test_rejected_and_incomplete_requests_never_attain() -> None:
    assert not attained_deadline(rec([], verdict="rejected", output_len=3))
    assert not attained_paper(rec([], verdict="rejected", output_len=3))
    short = rec([0.1, 0.15], output_len=3)
    assert not attained_deadline(short) and not attained_paper(short)


def test_best_effort_requests_that_met_the_slo_count() -> None:
    r = rec([0.1, 0.15], verdict="best_effort")
    assert attained_deadline(r) and attained_paper(r)


def test_tokens_past_output_len_are_ignored() -> None:
    r = rec([0.1, 0.15, 5.0], output_len=2)
    assert attained_deadline(r) and attained_paper(r)
    assert mean_tpot_s(r) == pytest.approx(0.05)


def test_stages_set_the_deadlines_and_window_targets() -> None:
    slo = SLO(100.0, 50.0, (Stage(50.0, num_tokens=2), Stage(100.0)))
    # deadlines: 0.1, 0.15 (thinking), then 0.25, 0.35 (answer, loose).
    assert attained_deadline(rec([0.1, 0.15, 0.25, 0.35], slo=slo))
    assert not attained_deadline(rec([0.1, 0.16, 0.25, 0.35], slo=slo))
    # Paper form, window of 2 gaps: [0..2] ends in the answer (100 ms), the last [1..3] too.
    r = rec([0.1, 0.15, 0.28, 0.34], slo=slo)
    ends, tpots = windowed_tpots(r, window=2)
    assert ends.tolist() == [2, 3] and tpots.tolist() == pytest.approx([0.09, 0.095])
    assert attained_paper(r, window=2)
    assert not attained_paper(r, window=1)


def test_the_last_window_is_the_last_ten_gaps() -> None:
    times = [0.1 + 0.01 * i for i in range(11)] + [0.3, 0.5]
    ends, tpots = windowed_tpots(rec(times))
    assert ends.tolist() == [10, 12]
    assert tpots[1] == pytest.approx((0.5 - 0.12) / 10)  # gaps 2..12, overlapping [0..10]
    short = [0.1, 0.12, 0.3, 0.31]  # fewer than 10 gaps: one window of them all
    assert windowed_tpots(rec(short))[0].tolist() == [3]
    assert windowed_tpots(rec(short))[1] == pytest.approx([0.07])
    assert len(windowed_tpots(rec([0.1]))[0]) == 0
    assert max_windowed_tpot_s(rec([0.1])) is None
    with pytest.raises(ValueError, match="window"):
        windowed_tpots(rec([0.1]), window=0)


def test_one_late_last_gap_is_judged_with_the_nine_before_it() -> None:
    """QA's case: a 192-token request on time throughout (13 s of slack), then one 494.6 ms
    gap at the end. 191 gaps left a last window of one gap, judged alone against 100 ms."""
    times = [0.1 + 0.02 * i for i in range(191)]
    times.append(times[-1] + 0.4946)
    r = rec(times, slo=SLO(ttft_ms=100.0, tpot_ms=100.0))
    assert attained_deadline(r)
    ends, tpots = windowed_tpots(r)
    assert ends[-1] == 191 and ends[-2] == 190
    assert tpots[-1] == pytest.approx((9 * 0.02 + 0.4946) / 10)
    assert attained_paper(r)


def test_percentiles_interpolate_and_skip_missing() -> None:
    p = percentiles([1.0, None, 2.0, 3.0, 4.0])
    assert (p.p50, p.count, p.mean) == (2.5, 4, 2.5)
    assert p.p99 == pytest.approx(3.97)
    assert percentiles([None]).p50 is None
    assert percentiles([1.0, 1.0, 7.0]).mean == 3.0


def test_report_counts_groups_goodput_and_latencies() -> None:
    records = [
        rec([0.1, 0.15], request_id="a"),
        rec([0.3, 0.35], request_id="b"),
        rec([], request_id="c", verdict="rejected", output_len=4),
        rec(
            [1.1, 1.15, 1.2],
            request_id="d",
            arrival_s=1.0,
            slo_class="tight/tight",
            scenario="coder",
            verdict="best_effort",
        ),
    ]
    out = report(records, duration_s=2.0)
    o = out.overall
    assert (o.requests, o.admitted, o.best_effort, o.rejected, o.completed) == (4, 2, 1, 1, 3)
    assert (o.attained_deadline, o.attainment) == (2, 0.5)
    assert o.paper_attainment == 0.5
    assert out.goodput_rps == pytest.approx(1.0)
    assert out.goodput_tokens_per_s == pytest.approx((2 + 3) / 2.0)
    assert o.ttft_s.count == 3 and o.ttft_s.p50 == pytest.approx(0.1)
    assert set(out.by_slo_class) == {"loose/loose", "tight/tight"}
    assert out.by_slo_class["loose/loose"].attainment == pytest.approx(1 / 3)
    assert out.by_scenario["coder"].attainment == 1.0
    # End to end: arrival to last token, complete requests only.
    assert o.e2e_s.count == 3
    assert o.e2e_s.mean == pytest.approx((0.15 + 0.35 + 0.2) / 3)
    assert set(out.by_verdict) == {"admitted", "best_effort", "rejected"}
    assert out.by_verdict["best_effort"].e2e_s.mean == pytest.approx(0.2)
    assert out.by_verdict["rejected"].e2e_s.count == 0
    as_dict = out.to_dict()
    assert as_dict["overall"]["attainment"] == 0.5
    assert as_dict["by_verdict"]["admitted"]["e2e_s"]["p50"] == pytest.approx(0.25)
    assert as_dict["by_slo_class"]["tight/tight"]["mean_tpot_s"]["p50"] == pytest.approx(0.05)


def test_report_span_defaults_to_first_arrival_to_last_token() -> None:
    records = [rec([0.1, 0.15], request_id="a", arrival_s=0.05), rec([2.0], request_id="b")]
    assert run_span_s(records) == pytest.approx(2.0)
    assert report(records).duration_s == pytest.approx(2.0)
    with pytest.raises(ValueError, match="zero records"):
        report([])
    with pytest.raises(ValueError, match="duration_s"):
        report(records, duration_s=0.0)


@pytest.mark.parametrize(
    "slo",
    [
        SLO_100_50,
        SLO(100.0, 50.0, (Stage(50.0, num_tokens=7), Stage(100.0))),
        SLO(80.0, 20.0, (Stage(20.0, num_tokens=3), Stage(40.0, num_tokens=5, ttft_ms=500.0))),
        SLO(80.0, 20.0, (Stage(20.0, num_tokens=1), Stage(30.0, num_tokens=1), Stage(90.0))),
    ],
)
def test_vectorized_deadlines_equal_the_slo_definition(slo: SLO) -> None:
    for n in (1, 2, 5, 30):
        expected = [slo.deadline_s(j) for j in range(n)]
        assert deadlines_s(slo, n).tolist() == pytest.approx(expected)
    tokens = np.arange(30)
    assert tpot_targets_s(slo, tokens).tolist() == [slo.tpot_at(j) for j in range(30)]
