"""When requests arrive: Poisson, gamma (tunable burstiness) or a replayed Azure trace.

All three return arrival times in seconds from 0, deterministic for a seed, with a chosen mean
rate. Burstiness is the coefficient of variation (CV) of the gaps between arrivals: 1 for
Poisson, above 1 for bursts (the Azure coding trace has ~13), below 1 for smoother-than-random.

Trace replay takes n consecutive rows from a seeded offset (wrapping around the end) and rescales
that window so ITS mean rate is the target: the measured rate of the run is the one asked for,
and the trace's shape (bursts and lulls, relative to its mean) is kept. Trace data: Azure LLM
inference trace 2023, CC-BY 4.0 (see loadgen.traces.AZURE_ATTRIBUTION).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from loadgen.traces import Trace, TraceRow


def _check_rate_and_count(rate: float, n: int) -> None:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        raise ValueError(f"rate must be a finite number, got {rate!r}")
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of requests must be an integer >= 1, got {n!r}")


def gamma_arrivals(rate: float, n: int, cv: float, seed: int) -> np.ndarray:
    """n arrivals whose gaps are gamma distributed with mean 1/rate and the given CV.

    Gamma with shape 1/cv^2 has exactly that CV; shape 1 is the exponential (Poisson arrivals).
    The first request arrives at 0.
    """
    _check_rate_and_count(rate, n)
    if isinstance(cv, bool) or not isinstance(cv, int | float) or not math.isfinite(cv) or cv <= 0:
        raise ValueError(f"cv must be a finite number > 0, got {cv!r}")
    shape = 1.0 / (cv * cv)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """n Poisson arrivals (exponential gaps, CV 1); the first at 0."""
    return gamma_arrivals(rate, n, 1.0, seed)


def trace_arrivals(trace: Trace, rate: float, n: int, seed: int) -> list[TraceRow]:
    """n consecutive trace rows from a seeded start, times rescaled to mean rate `rate`.

    Rows keep their token counts, so a workload can pair each arrival with its logged lengths.
    Past the trace's end the replay wraps to its start after one mean gap.
    """
    _check_rate_and_count(rate, n)
    times = np.array(trace.times())
    gaps = np.append(np.diff(times), 1.0 / trace.mean_rate)
    start = int(np.random.default_rng(seed).integers(len(times)))
    index = (start + np.arange(n)) % len(times)
    window = gaps[index[:-1]]
    if n > 1 and window.sum() <= 0:
        raise ValueError(f"trace {trace.name!r}: the chosen {n} rows all share one timestamp")
    scale = (n - 1) / (rate * window.sum()) if n > 1 else 1.0
    arrivals = np.concatenate(([0.0], np.cumsum(window * scale)))
    return [replace(trace.rows[i], time_s=float(t)) for i, t in zip(index, arrivals, strict=True)]


def interarrival_cv(times: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation of the gaps between sorted arrivals (burstiness)."""
    gaps = np.diff(np.sort(np.asarray(times, dtype=float)))
    if len(gaps) < 2 or gaps.mean() <= 0:
        raise ValueError("need at least 3 arrivals spanning a positive time to measure burstiness")
    return float(gaps.std() / gaps.mean())


def mean_rate(times: Sequence[float] | np.ndarray) -> float:
    """Arrivals per second: n-1 gaps over the span from first to last arrival."""
    arr = np.asarray(times, dtype=float)
    if len(arr) < 2 or arr.max() <= arr.min():
        raise ValueError("need at least 2 arrivals spanning a positive time to measure a rate")
    return float((len(arr) - 1) / (arr.max() - arr.min()))


class ArrivalKind(StrEnum):
    POISSON = "poisson"
    GAMMA = "gamma"
    TRACE = "trace"


@dataclass(frozen=True)
class ArrivalProcess:
    """An arrival pattern chosen by configuration; `times` runs it at a given rate."""

    kind: ArrivalKind
    cv: float = 1.0
    """Burstiness for kind 'gamma' (1 = Poisson)."""
    trace: Trace | None = None
    """The trace to replay for kind 'trace'."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ArrivalKind(self.kind))
        if self.kind is ArrivalKind.TRACE and self.trace is None:
            raise ValueError("arrival kind 'trace' needs a trace (load one with load_trace)")
        if self.kind is not ArrivalKind.TRACE and self.trace is not None:
            raise ValueError(f"arrival kind {self.kind.value!r} takes no trace")
        if self.kind is ArrivalKind.POISSON and self.cv != 1.0:
            raise ValueError(f"poisson arrivals have cv 1, got cv={self.cv}; use kind 'gamma'")

    def times(self, rate: float, n: int, seed: int) -> np.ndarray:
        """n arrival times in seconds, mean rate `rate`, first at 0."""
        if self.trace is not None:
            return np.array([r.time_s for r in trace_arrivals(self.trace, rate, n, seed)])
        return gamma_arrivals(rate, n, self.cv, seed)

    def describe(self) -> str:
        """One line for result files, with the data attribution when a trace is replayed."""
        if self.trace is not None:
            credit = f" ({self.trace.attribution})" if self.trace.attribution else ""
            return f"trace {self.trace.name}{credit}"
        if self.kind is ArrivalKind.GAMMA:
            return f"gamma (cv={self.cv:g})"
        return "poisson"
