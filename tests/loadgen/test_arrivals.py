"""Arrival processes: mean rate, burstiness, determinism, and trace rescaling."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from loadgen.arrivals import (
    ArrivalKind,
    ArrivalProcess,
    gamma_arrivals,
    interarrival_cv,
    mean_rate,
    poisson_arrivals,
    trace_arrivals,
)
from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE, Trace, TraceRow, load_trace

AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-inference-2023"


def small_trace() -> Trace:
    """Gaps 1, 1, 1, 7 (a lull), then the wrap-around gap of one mean gap (2.5)."""
    times = [0.0, 1.0, 2.0, 3.0, 10.0]
    return Trace("small", tuple(TraceRow(t, 100 + i, 10 + i) for i, t in enumerate(times)))


@pytest.mark.parametrize(("rate", "cv"), [(2.0, 1.0), (10.0, 0.5), (0.5, 3.0)])
def test_gamma_has_the_asked_rate_and_burstiness(rate: float, cv: float) -> None:
    times = gamma_arrivals(rate, 20_000, cv, seed=1)
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    assert mean_rate(times) == pytest.approx(rate, rel=0.05)
    assert interarrival_cv(times) == pytest.approx(cv, rel=0.08)


def test_poisson_is_gamma_with_cv_one_and_deterministic() -> None:
    a = poisson_arrivals(3.0, 1000, seed=7)
    np.testing.assert_array_equal(a, poisson_arrivals(3.0, 1000, seed=7))
    np.testing.assert_array_equal(a, gamma_arrivals(3.0, 1000, 1.0, seed=7))
    assert not np.array_equal(a, poisson_arrivals(3.0, 1000, seed=8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: poisson_arrivals(0.0, 10, 0), "rate must be > 0"),
        (lambda: poisson_arrivals(float("inf"), 10, 0), "finite"),
        (lambda: poisson_arrivals(1.0, 0, 0), "integer >= 1"),
        (lambda: gamma_arrivals(1.0, 10, 0.0, 0), "cv must be"),
        (lambda: trace_arrivals(small_trace(), -1.0, 3, 0), "rate must be > 0"),
        (lambda: interarrival_cv([1.0, 2.0]), "at least 3"),
        (lambda: mean_rate([1.0]), "at least 2"),
    ],
)
def test_bad_arguments_raise(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_trace_window_is_rescaled_to_the_target_rate_keeping_its_shape() -> None:
    trace = small_trace()
    seed = next(s for s in range(100) if trace_arrivals(trace, 1.0, 2, s)[0].context_tokens == 100)
    rows = trace_arrivals(trace, 2.0, 5, seed)
    times = [r.time_s for r in rows]
    assert mean_rate(times) == pytest.approx(2.0)
    # gaps 1, 1, 1, 7 keep their proportions: total 10 rescaled to 4 gaps / 2 per s = 2 s.
    assert np.diff(times) == pytest.approx([0.2, 0.2, 0.2, 1.4])
    assert [r.context_tokens for r in rows] == [100, 101, 102, 103, 104]


def test_trace_replay_wraps_around_after_one_mean_gap() -> None:
    trace = small_trace()
    seed = next(s for s in range(100) if trace_arrivals(trace, 1.0, 2, s)[0].context_tokens == 103)
    rows = trace_arrivals(trace, 1.0, 4, seed)
    assert [r.context_tokens for r in rows] == [103, 104, 100, 101]
    # gaps 7, 2.5 (wrap), 1: rescaled so 3 gaps take 3 s.
    assert np.diff([r.time_s for r in rows]) == pytest.approx(np.array([7, 2.5, 1]) * 3 / 10.5)


def test_trace_replay_is_deterministic_for_a_seed() -> None:
    trace = small_trace()
    assert trace_arrivals(trace, 1.0, 12, 3) == trace_arrivals(trace, 1.0, 12, 3)
    starts = {trace_arrivals(trace, 1.0, 3, s)[0].context_tokens for s in range(40)}
    assert len(starts) > 1


def test_arrival_process_dispatches_and_describes() -> None:
    trace = small_trace()
    replay = ArrivalProcess(ArrivalKind.TRACE, trace=trace)
    assert mean_rate(replay.times(4.0, 9, 0)) == pytest.approx(4.0)
    assert "CC-BY 4.0" in replay.describe()
    own = replace(trace, name="ours", attribution="")
    assert ArrivalProcess(ArrivalKind.TRACE, trace=own).describe() == "trace ours"
    bursty = ArrivalProcess(ArrivalKind.GAMMA, cv=2.0)
    np.testing.assert_array_equal(bursty.times(1.0, 50, 2), gamma_arrivals(1.0, 50, 2.0, 2))
    assert ArrivalProcess(ArrivalKind.POISSON).describe() == "poisson"
    with pytest.raises(ValueError, match="needs a trace"):
        ArrivalProcess(ArrivalKind.TRACE)
    with pytest.raises(ValueError, match="takes no trace"):
        ArrivalProcess(ArrivalKind.GAMMA, trace=trace)
    with pytest.raises(ValueError, match="use kind 'gamma'"):
        ArrivalProcess(ArrivalKind.POISSON, cv=2.0)
    with pytest.raises(ValueError):
        ArrivalProcess("uniform")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "bursty"), [(AZURE_CODE_FILE, True), (AZURE_CONV_FILE, False)])
def test_real_traces_rescale_and_keep_their_burstiness(name: str, bursty: bool) -> None:
    path = AZURE_DIR / name
    if not path.is_file():
        pytest.skip(f"Azure trace not available at {path} (the data is not in the repository)")
    rows = trace_arrivals(load_trace(path), 1.5, 3000, seed=0)
    times = [r.time_s for r in rows]
    assert mean_rate(times) == pytest.approx(1.5)
    cv = interarrival_cv(times)
    assert cv > 2.0 if bursty else cv < 1.5
