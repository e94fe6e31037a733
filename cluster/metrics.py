"""Counters and histograms of the cluster, in plain Python (the front door exports them).

The controller counts what only it sees (routing decisions, the replicas' steps, planner
latency); the front door counts what clients saw (router.metrics).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from cluster.messages import StepReport

PLANNER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: counts[i] observations <= bounds[i])."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"histogram bounds must be increasing, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i in range(bisect.bisect_left(self.bounds, value), len(self.bounds)):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict[str, object]:
        return {
            "bounds": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.total,
            "count": self.count,
        }


@dataclass
class Metrics:
    """Named counters and histograms of one party."""

    counters: dict[str, int] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def inc(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def count_step(self, report: StepReport) -> None:
        """A step a replica executed: its measured time (`busy_us`, microseconds so that the
        counter stays an integer), its prefix-cache lookups, and its drafts. Busy time over
        wall time is how loaded the replicas were, and per request what serving one cost,
        which tells a policy that is out of room from one that wastes it (loadgen reports
        both)."""
        outcome = report.outcome
        self.inc("steps")
        self.inc("busy_us", round(outcome.total_s * 1e6))
        if report.prefix_queries:
            self.inc("prefix_cache_queries", report.prefix_queries)
            self.inc("prefix_cache_hits", report.prefix_hits)
        drafted = sum(o.num_draft_tokens for o in outcome.outcomes)
        if drafted:
            self.inc("spec_draft_tokens", drafted)
            self.inc("spec_accepted_tokens", sum(o.num_accepted_tokens for o in outcome.outcomes))

    def observe(self, name: str, value: float, bounds: tuple[float, ...]) -> None:
        hist = self.histograms.get(name)
        if hist is None:
            hist = self.histograms[name] = Histogram(bounds)
        hist.observe(value)

    def snapshot(self) -> dict[str, object]:
        return {
            "counters": dict(self.counters),
            "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
        }
