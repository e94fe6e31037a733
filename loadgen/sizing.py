"""Sizing: the fewest replicas that serve a given total request rate at the SLO target.

Capacity (loadgen.capacity) answers "how much can one replica take"; a user planning a
deployment asks the converse, "how many replicas (GPUs) does my traffic need", and that is not
the total rate over the 1-replica capacity: routing, pooled bursts and best-effort spill-over
make capacity per replica change with the count. So the count is searched directly, replaying
the same requests at the same total rate on n replicas: from a starting count, multiply by
`growth` while it fails and divide by `shrink` while it passes (rounded up, by one replica at
least), then bisect the integers between the largest failing and the smallest passing count.
The steps down are short because the runs below the answer are overloaded, and an overloaded
run is the slowest to simulate (its queues only grow); a good start (the count the work bound
allows) leaves the answer at most a little below it. Attainment is assumed to rise with the count,
and the search cannot detect otherwise: it only probes between the largest failing and the
smallest passing count, so a count that fails above a passing one is never run (runs at fixed
counts, `--replicas N --rate TOTAL/N` each, show the curve). Every evaluation is kept (`points`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from loadgen.capacity import DEFAULT_TARGET, checked_attainment
from loadgen.capacity_tables import BASELINES, DISTSERVE, FULL, best_baseline_title


@dataclass(frozen=True)
class SizingPoint:
    replicas: int
    attainment: float


@dataclass(frozen=True)
class SizingResult:
    replicas: int | None
    """Fewest replicas found that attain the target (None if even `most` failed)."""
    largest_failing: int | None
    """Most replicas found that fail (None if even `least` passed)."""
    target: float
    points: tuple[SizingPoint, ...]
    """Every evaluation, in the order run."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "largest_failing": self.largest_failing,
            "target": self.target,
            "points": [{"replicas": p.replicas, "attainment": p.attainment} for p in self.points],
        }


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def find_replicas(
    attainment_at: Callable[[int], float],
    start: int,
    *,
    target: float = DEFAULT_TARGET,
    least: int = 1,
    most: int = 64,
    growth: float = 2.0,
    shrink: float = 1.25,
) -> SizingResult:
    """Smallest n in [least, most] with attainment_at(n) >= target."""
    for name, value in (("start", start), ("least", least), ("most", most)):
        _count(name, value)
    if not least <= start <= most:
        raise ValueError(f"start={start} must be in [{least}, {most}]")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    for name, factor in (("growth", growth), ("shrink", shrink)):
        if not math.isfinite(factor) or factor <= 1:
            raise ValueError(f"{name} must be finite and > 1, got {factor!r}")

    points: list[SizingPoint] = []

    def passes(n: int) -> bool:
        value = checked_attainment(attainment_at(n), f"with {n} replicas")
        points.append(SizingPoint(n, value))
        return value >= target

    def result(passing: int | None, failing: int | None) -> SizingResult:
        return SizingResult(passing, failing, target, tuple(points))

    low: int
    high: int
    if passes(start):
        high = start
        while True:
            if high <= least:
                return result(high, None)
            n = max(least, min(high - 1, math.ceil(high / shrink)))
            if not passes(n):
                low = n
                break
            high = n
    else:
        low = start
        while True:
            if low >= most:
                return result(None, low)
            n = min(most, max(low + 1, math.ceil(low * growth)))
            if passes(n):
                high = n
                break
            low = n
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            high = mid
        else:
            low = mid
    return result(high, low)


Sizing = Mapping[str, Mapping[str, Mapping[str, SizingResult]]]
"""scenario -> total rate (`rate_key`) -> policy -> the search's result."""


def rate_key(total_rate: float) -> str:
    """A total rate as a JSON key."""
    return f"{total_rate:g}"


def _savings(by_policy: Mapping[str, int | None]) -> dict[str, dict[str, Any]]:
    """What slos saves against the best (fewest-replica) of vllm/sarathi, and against
    distserve; left out where a count is missing (a ratio to a ceiling would flatter)."""
    ours = by_policy.get(FULL)
    out = {}
    for key, against in (("vs_best_baseline", BASELINES), ("vs_distserve", (DISTSERVE,))):
        found = [by_policy[a] for a in against if a in by_policy]
        if ours is None or not found or None in found:
            continue
        best = min(n for n in found if n is not None)
        out[key] = {"replicas": best, "replicas_saved": best - ours, "ratio": best / ours}
    return out


def summarize_sizing(
    sizing: Sizing,
    max_replicas: int,
    gpus_per_replica: int,
    work_bound: Mapping[str, Mapping[str, int]],
) -> dict[str, Any]:
    """The `summary` of a sizing run: replicas and GPUs per policy, what slos saves, and the
    fewest replicas the work bound allows any policy without speculation (scenario -> rate)."""
    replicas = {
        s: {rate: {p: r.replicas for p, r in by.items()} for rate, by in by_rate.items()}
        for s, by_rate in sizing.items()
    }
    return {
        "max_replicas": max_replicas,
        "gpus_per_replica": gpus_per_replica,
        "work_bound_replicas": work_bound,
        "replicas": replicas,
        "gpus": {
            s: {
                rate: {p: None if n is None else n * gpus_per_replica for p, n in by.items()}
                for rate, by in by_rate.items()
            }
            for s, by_rate in replicas.items()
        },
        "slos_saves": {
            s: {rate: _savings(by) for rate, by in by_rate.items()}
            for s, by_rate in replicas.items()
        },
    }


def sizing_table(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: the work bound's count, replicas per policy (">N" where even
    the ceiling failed) and the best baseline's count over slos's."""
    replicas: Mapping[str, Mapping[str, Mapping[str, int | None]]] = summary["replicas"]
    policies = list(
        dict.fromkeys(p for by_rate in replicas.values() for by in by_rate.values() for p in by)
    )
    head = ["scenario", "req/s in all", "work bound", *policies]
    head.append(f"{best_baseline_title(policies)} / {FULL}")
    lines = [
        f"Replicas at {DEFAULT_TARGET:.0%} attainment ({summary['gpus_per_replica']} GPU(s) each):",
        "",
        "| " + " | ".join(head) + " |",
        "| --- | " + " | ".join("---:" for _ in head[1:]) + " |",
    ]
    for scenario, by_rate in replicas.items():
        for rate, by_policy in by_rate.items():
            cells = [scenario, rate, str(summary["work_bound_replicas"][scenario][rate])]
            for policy in policies:
                n = by_policy.get(policy, 0)
                cells.append(
                    "-" if n == 0 else f">{summary['max_replicas']}" if n is None else str(n)
                )
            vs = summary["slos_saves"][scenario][rate].get("vs_best_baseline")
            cells.append("n/a" if vs is None else f"{vs['ratio']:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
