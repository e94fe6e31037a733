"""Planner knobs fail at construction, naming the knob."""

from __future__ import annotations

import math

import pytest

from replica.planner.config import PlannerConfig, SpecConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"best_effort_stretch": -0.1}, "best_effort_stretch must be in"),
        ({"best_effort_stretch": math.nan}, "best_effort_stretch must be a finite number"),
        ({"best_effort_stretch": "0.1"}, "best_effort_stretch must be a finite number"),
        ({"memory_units": 0}, "memory_units must be >= 1"),
        ({"idle_period_s": 0.0}, "idle_period_s must be finite and > 0, got 0.0"),
        ({"spec": "draft"}, "spec must be a SpecConfig"),
    ],
)
def test_a_bad_planner_knob_is_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]


def test_a_bad_speculation_knob_is_named() -> None:
    with pytest.raises(ValueError, match="stretch_kv_fraction must be in"):
        SpecConfig(stretch_kv_fraction=1.5)
    assert PlannerConfig(best_effort_stretch=0.0).best_effort_stretch == 0.0
