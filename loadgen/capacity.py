"""Serving capacity: the highest per-replica request rate that still attains the SLO target.

The paper's headline metric (max load per GPU with >= 90% attainment). Given a function that
runs the system at a per-replica rate and returns its attainment (deadline semantics), search:
bracket by multiplying the rate by `growth` (up while it passes, down while it fails), then
bisect between the highest passing and lowest failing rate until they are within `rel_tol` of
each other. This assumes attainment falls as the rate grows, and cannot detect otherwise: it
only probes above the highest pass and below the lowest failure, so a rate that passes above a
failing one is never run (runs at fixed rates, `--rate` each, show the curve).
Every evaluated point is kept (`points`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replica.planner.config import check_positive

DEFAULT_TARGET = 0.9
GROWTH = 2.0
"""What a search multiplies (or divides) the rate by while it brackets the capacity."""


@dataclass(frozen=True)
class CapacityPoint:
    rate: float
    attainment: float


@dataclass(frozen=True)
class CapacityResult:
    capacity: float
    """Highest passing rate found (0.0 if even `min_rate` failed)."""
    lowest_failing: float | None
    """Lowest failing rate found (None if even `max_rate` passed)."""
    target: float
    points: tuple[CapacityPoint, ...]
    """Every evaluation, in the order run."""

    @property
    def bound(self) -> dict[str, float] | None:
        """The search's limit when it did not measure the capacity: {"at_least": max_rate} if
        even the ceiling passed, {"below": min_rate} if even the floor failed; None when a pass
        and a failure bracket it. A ratio to a limit would compare the searches, not the
        policies."""
        if self.lowest_failing is None:
            return {"at_least": self.capacity}
        if self.capacity == 0.0:
            return {"below": self.lowest_failing}
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "lowest_failing": self.lowest_failing,
            "target": self.target,
            "points": [{"rate": p.rate, "attainment": p.attainment} for p in self.points],
        }


def checked_attainment(value: float, where: str) -> float:
    """A search's evaluation as a float in [0, 1], or an error naming `where` it came from."""
    value = float(value)
    if not 0 <= value <= 1:
        raise ValueError(f"attainment {where} must be in [0, 1], got {value!r}")
    return value


def check_rel_tol(name: str, rel_tol: float, growth: float = GROWTH) -> None:
    """A tolerance a search can work to: > 0 and at most growth - 1, the relative width of the
    bracket it bisects, so a larger one would be ignored (the bracket is that close already)."""
    if not (math.isfinite(rel_tol) and 0 < rel_tol <= growth - 1):
        raise ValueError(
            f"{name} must be > 0 and <= {growth - 1:g} (a search's first bracket is within a "
            f"factor {growth:g}), got {rel_tol!r}"
        )


def find_capacity(
    attainment_at: Callable[[float], float],
    start_rate: float,
    *,
    target: float = DEFAULT_TARGET,
    rel_tol: float = 0.05,
    growth: float = GROWTH,
    min_rate: float = 1e-3,
    max_rate: float = 1e4,
) -> CapacityResult:
    """Highest rate r in [min_rate, max_rate] with attainment_at(r) >= target, to rel_tol."""
    for name, value in (("start_rate", start_rate), ("min_rate", min_rate), ("max_rate", max_rate)):
        check_positive(name, value)
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if not math.isfinite(growth) or growth <= 1:
        raise ValueError(f"growth must be finite and > 1, got {growth!r}")
    check_rel_tol("rel_tol", rel_tol, growth)
    if not min_rate <= start_rate <= max_rate:
        raise ValueError(f"start_rate={start_rate} must be in [{min_rate}, {max_rate}]")

    points: list[CapacityPoint] = []

    def passes(rate: float) -> bool:
        value = checked_attainment(attainment_at(rate), f"at rate {rate}")
        points.append(CapacityPoint(rate, value))
        return value >= target

    def result(low: float, high: float | None) -> CapacityResult:
        return CapacityResult(low, high, target, tuple(points))

    low: float
    high: float
    if passes(start_rate):
        low = start_rate
        while True:
            if low >= max_rate:
                return result(low, None)
            rate = min(low * growth, max_rate)
            if not passes(rate):
                high = rate
                break
            low = rate
    else:
        high = start_rate
        while True:
            if high <= min_rate:
                return result(0.0, high)
            rate = max(high / growth, min_rate)
            if passes(rate):
                low = rate
                break
            high = rate
    while high - low > rel_tol * low:
        mid = (low + high) / 2
        if passes(mid):
            low = mid
        else:
            high = mid
    return result(low, high)
