"""Capacity search on synthetic monotone systems with a known threshold."""

from __future__ import annotations

import pytest

from loadgen.capacity import find_capacity


def system(threshold: float) -> object:
    """Attainment falls linearly with rate and crosses 0.9 exactly at `threshold`."""

    def attainment(rate: float) -> float:
        return min(1.0, max(0.0, 0.9 - 0.2 * (rate - threshold)))

    return attainment


@pytest.mark.parametrize("start", [0.01, 1.0, 3.7, 50.0])
@pytest.mark.parametrize("threshold", [0.37, 3.7, 41.0])
def test_finds_the_known_threshold_from_any_start(start: float, threshold: float) -> None:
    result = find_capacity(system(threshold), start, rel_tol=0.01)  # type: ignore[arg-type]
    assert result.capacity <= threshold
    assert result.capacity == pytest.approx(threshold, rel=0.011)
    assert result.lowest_failing is not None and result.lowest_failing > threshold
    assert (result.lowest_failing - result.capacity) <= 0.01 * result.capacity
    assert result.bound is None
    assert len(result.points) < 30


def test_points_are_reported_in_evaluation_order() -> None:
    seen: list[float] = []

    def attainment(rate: float) -> float:
        seen.append(rate)
        return 1.0 if rate <= 5.0 else 0.0

    result = find_capacity(attainment, 1.0, rel_tol=0.1)
    assert [p.rate for p in result.points] == seen
    assert seen[:4] == [1.0, 2.0, 4.0, 8.0]
    assert result.capacity == pytest.approx(5.0, rel=0.1)
    assert result.to_dict()["points"][0] == {"rate": 1.0, "attainment": 1.0}


def test_unbounded_and_hopeless_systems_report_a_bound() -> None:
    always = find_capacity(lambda r: 1.0, 1.0, max_rate=100.0)
    assert always.capacity == 100.0 and always.lowest_failing is None
    assert always.bound == {"at_least": 100.0}
    never = find_capacity(lambda r: 0.0, 1.0, min_rate=0.01)
    assert never.capacity == 0.0 and never.lowest_failing == 0.01
    assert never.bound == {"below": 0.01}


def test_a_non_monotone_curve_goes_unseen_and_is_not_claimed_checked() -> None:
    """QA's curve: passing up to 1.5, failing in (1.5, 2.5], passing again up to 6. The search
    never runs a rate above its first failure, so nothing in the result could flag it."""

    def attainment(rate: float) -> float:
        return 0.95 if rate <= 1.5 or 2.5 < rate <= 6.0 else 0.5

    result = find_capacity(attainment, 1.0, rel_tol=0.05)
    assert result.capacity <= 1.5 and result.lowest_failing is not None
    assert all(p.rate <= 2.0 for p in result.points)
    assert "monotone" not in result.to_dict() and not hasattr(result, "monotone")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_rate": 0.0}, "start_rate"),
        ({"start_rate": 1.0, "target": 1.5}, "target"),
        ({"start_rate": 1.0, "growth": 1.0}, "growth"),
        ({"start_rate": 1.0, "rel_tol": 0.0}, "rel_tol must be > 0 and <= 1 "),
        ({"start_rate": 1.0, "rel_tol": 1.5}, r"rel_tol must be > 0 and <= 1 \(a search's first "),
        ({"start_rate": 1.0, "rel_tol": 3.5, "growth": 4.0}, "rel_tol must be > 0 and <= 3 "),
        ({"start_rate": 1e5}, r"start_rate=100000.0 must be in"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_capacity(lambda r: 1.0, **kwargs)


def test_the_tolerance_may_be_as_wide_as_the_bracket() -> None:
    """At growth - 1 the first bracket already meets it: nothing is bisected."""
    result = find_capacity(lambda r: 1.0 if r <= 5.0 else 0.0, 1.0, rel_tol=3.0, growth=4.0)
    assert [p.rate for p in result.points] == [1.0, 4.0, 16.0]
    assert (result.capacity, result.lowest_failing) == (4.0, 16.0)


def test_attainment_outside_unit_interval_raises() -> None:
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        find_capacity(lambda r: 90.0, 1.0)
