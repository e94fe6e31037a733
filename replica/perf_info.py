"""What a perf profile says about itself, and how the hardware may differ from it.

Both are read from files and flags, so they are checked here, in plain Python: the compiled
perf model (`replica.compiled`) would convert a bool given for a number before any check saw it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SOURCES = ("measured", "analytic")


@dataclass(frozen=True)
class ProfileInfo:
    """Where a profile comes from; serialized at the JSON's top level."""

    source: str
    """"measured" (fitted on engine runs) or "analytic" (FLOPs and bytes over datasheet rates)."""
    backend: str
    device: str
    model: str
    draft: str | None = None
    dtype: str = "bfloat16"
    tp: int = 1
    date: str = ""
    """ISO date the profile was made."""
    r2: float | None = None
    """Coefficient of determination on the held-out split (measured profiles)."""
    mape: float | None = None
    """Mean absolute percentage error on the held-out split, as a fraction (0.05 = 5%)."""
    notes: tuple[str, ...] = ()
    assumptions: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)
    """How the coefficients were fitted (method, sample counts, ...)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int):
            raise ValueError(f"tp must be an integer, got {self.tp!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.source == "measured" and (self.r2 is None or self.mape is None):
            raise ValueError("a measured profile needs r2 and mape from its held-out split")


@dataclass(frozen=True)
class Slowdown:
    """Steps take `factor` times the profile's time plus `overhead_s`: hardware slower than
    its profile (shared cores, a serving loop's per-step cost), for asking how planners that
    believe the profile fare against it."""

    factor: float = 1.0
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("factor", self.factor), ("overhead_s", self.overhead_s)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"slowdown {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"slowdown {name} must be finite, got {value!r}")
        if self.factor <= 0:
            raise ValueError(f"slowdown factor must be > 0, got {self.factor!r}")
        if self.overhead_s < 0:
            raise ValueError(f"slowdown overhead_s must be >= 0, got {self.overhead_s!r}")

    @property
    def is_none(self) -> bool:
        return self.factor == 1.0 and self.overhead_s == 0.0

    def __str__(self) -> str:
        return f"{self.factor:g} x the profile + {self.overhead_s * 1e3:g} ms per step"
