"""Capacity comparisons the paper reports, computed from searched capacities, and their tables.

Input everywhere: `capacity[scenario][policy][replicas]` = req/s per replica at >= 90%
attainment (replica counts are strings, as in the JSON). Outputs:

- ratios of one policy over the best of some others, per (scenario, replicas), and their
  geometric mean (the paper's 2.2x is slos over the best of vllm/sarathi, 2.4x over distserve);
- scaling: total capacity with n replicas over the 1-replica capacity, n x cap(n) / cap(1)
  (the paper's 4.61x ChatBot, 6.2x Coder at 4 replicas);
- ablation: slos over each of its variants with one part switched off (the paper's 1.19x
  routing, 1.66x speculation, 1.34x burst resilience).

A ratio needs both capacities > 0 and measured: a capacity at a search's ceiling (every rate
passed up to it) or floor (even that failed) is a bound (`Bounds`), and a ratio to a bound would
compare the searches' limits, not the policies. Otherwise the ratio is None (JSON null) and left
out of means; the tables print bounds as ">=1.50" and "<0.001".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Capacity = Mapping[str, Mapping[str, Mapping[str, float]]]
Ratios = dict[str, dict[str, float | None]]
"""scenario -> replicas -> ratio."""
Bound = Mapping[str, float]
"""{"at_least": rate}: every rate passed up to the search's ceiling; {"below": rate}: even its
floor failed (`CapacityResult.bound`)."""
Bounds = Mapping[str, Mapping[str, Mapping[str, Bound]]]
"""scenario -> policy -> replicas -> the bound, for the capacities a search did not measure."""

FULL = "slos"
BASELINES = ("vllm", "sarathi")
DISTSERVE = "distserve"
ABLATION_PREFIX = "slos-"
"""Policies named slos-<part> are slos with <part> switched off (slos+<policy> adds one)."""


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the values that exist; None when none does."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def bound_of(bounds: Bounds, scenario: str, policy: str, n: str) -> Bound | None:
    """The capacity's bound, None if it was measured."""
    return bounds.get(scenario, {}).get(policy, {}).get(n)


def capacity_ratios(
    capacity: Capacity, policy: str, against: Sequence[str], bounds: Bounds | None = None
) -> Ratios:
    """`policy` over the best of `against`, wherever `policy` and one of `against` ran; None
    where either is a bound."""
    bounds = bounds or {}
    out: Ratios = {}
    for scenario, by_policy in capacity.items():
        others = [a for a in against if a in by_policy]
        if policy not in by_policy or not others:
            continue
        for n, value in by_policy[policy].items():
            ran = [a for a in others if n in by_policy[a]]
            if not ran:
                continue
            best = max(ran, key=lambda a: by_policy[a][n])
            bounded = any(bound_of(bounds, scenario, p, n) for p in (policy, best))
            ratio = None if bounded else _ratio(value, by_policy[best][n])
            out.setdefault(scenario, {})[n] = ratio
    return out


def ratios_geomean(ratios: Ratios) -> float | None:
    return geomean(r for by_n in ratios.values() for r in by_n.values())


def scaling_factors(
    capacity: Capacity, bounds: Bounds | None = None
) -> dict[str, dict[str, dict[str, float | None]]]:
    """scenario -> policy -> replicas -> n x cap(n) / cap(1), for n > 1 with a 1-replica run;
    None where either is a bound."""
    bounds = bounds or {}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for scenario, by_policy in capacity.items():
        for policy, by_n in by_policy.items():
            single = by_n.get("1")
            for n, value in by_n.items():
                if n != "1" and single is not None:
                    bounded = any(bound_of(bounds, scenario, policy, m) for m in (n, "1"))
                    factor = None if bounded else _ratio(int(n) * value, single)
                    out.setdefault(scenario, {}).setdefault(policy, {})[n] = factor
    return out


def ablation_variants(capacity: Capacity) -> list[str]:
    """The slos-<part> policies present, in first-seen order."""
    seen: dict[str, None] = {}
    for by_policy in capacity.values():
        seen.update(dict.fromkeys(p for p in by_policy if p.startswith(ABLATION_PREFIX)))
    return list(seen)


def summarize(capacity: Capacity, bounds: Bounds | None = None) -> dict[str, Any]:
    """The `summary` object of a capacity run: the capacities plus every comparison the
    policies and replica counts present allow, and the capacities that are bounds
    (`capacity_bounds`, when there are any)."""
    bounds = bounds or {}
    ratio = capacity_ratios(capacity, FULL, BASELINES, bounds)
    summary: dict[str, Any] = {
        "capacity": capacity,
        "capacity_ratio_geomean": ratios_geomean(ratio),
        "capacity_ratio": ratio,
    }
    if any(by_n for by_policy in bounds.values() for by_n in by_policy.values()):
        summary["capacity_bounds"] = bounds
    vs_distserve = capacity_ratios(capacity, FULL, (DISTSERVE,), bounds)
    if vs_distserve:
        summary["capacity_ratio_vs_distserve"] = vs_distserve
        summary["capacity_ratio_vs_distserve_geomean"] = ratios_geomean(vs_distserve)
    scaling = scaling_factors(capacity, bounds)
    if scaling:
        summary["scaling"] = scaling
    ablation = {
        variant: capacity_ratios(capacity, FULL, (variant,), bounds)
        for variant in ablation_variants(capacity)
    }
    if any(ablation.values()):
        summary["ablation"] = ablation
        summary["ablation_geomean"] = {v: ratios_geomean(r) for v, r in ablation.items()}
    return summary


def best_baseline_title(policies: list[str]) -> str:
    """What the ratio column divides by: the baselines that ran, not the ones that might."""
    ran = [b for b in BASELINES if b in policies] or list(BASELINES)
    return ran[0] if len(ran) == 1 else f"best({', '.join(ran)})"


def _fmt(value: float | None, suffix: str = "") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}{suffix}"


def capacity_cell(value: float | None, bound: Bound | None = None) -> str:
    """A capacity as the tables print it: a bound marked (">=1.50", "<0.001")."""
    if bound is None:
        return _fmt(value)
    if "at_least" in bound:
        return f">={_fmt(bound['at_least'])}"
    return f"<{bound['below']:g}"


def _ratio_cell(ratio: float | None, bounded: bool, suffix: str = "x") -> str:
    return "n/a (bound)" if ratio is None and bounded else _fmt(ratio, suffix)


def markdown_tables(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: capacities with the slos ratios, then scaling and ablation."""
    capacity: Capacity = summary["capacity"]
    bounds: Bounds = summary.get("capacity_bounds", {})
    policies = list(dict.fromkeys(p for by_policy in capacity.values() for p in by_policy))
    counts = _replica_counts(capacity)
    ratio_columns = [
        (key, title, compared)
        for key, title, compared in (
            ("capacity_ratio", f"{FULL} / {best_baseline_title(policies)}", BASELINES),
            ("capacity_ratio_vs_distserve", f"{FULL} / {DISTSERVE}", (DISTSERVE,)),
        )
        if summary.get(key)
    ]
    head = ["scenario", "replicas", *policies, *(title for _, title, _ in ratio_columns)]
    lines = [_row(head), _row(["---", "---:", *["---:"] * (len(head) - 2)])]
    for scenario, by_policy in capacity.items():
        for n in counts:
            if not any(n in by_policy[p] for p in by_policy):
                continue
            cells = [
                capacity_cell(by_policy.get(p, {}).get(n), bound_of(bounds, scenario, p, n))
                for p in policies
            ]
            ratios = [
                _ratio_cell(
                    summary[key].get(scenario, {}).get(n),
                    any(bound_of(bounds, scenario, p, n) for p in (FULL, *compared)),
                )
                for key, _, compared in ratio_columns
            ]
            lines.append(_row([scenario, n, *cells, *ratios]))
    if ratio_columns:
        means = [_mean_cell(summary[key], summary[f"{key}_geomean"]) for key, _, _ in ratio_columns]
        lines.append(_row(["geo-mean", "", *[""] * len(policies), *means]))
    if "scaling" in summary:
        lines += ["", _scaling_table(summary["scaling"], bounds)]
    if "ablation" in summary:
        lines += ["", _ablation_table(summary["ablation"], summary["ablation_geomean"], bounds)]
    return "\n".join(lines)


def _mean_cell(ratios: Ratios, mean: float | None) -> str:
    """The geometric mean, with how many ratios it covers when some are undefined."""
    values = [r for by_n in ratios.values() for r in by_n.values()]
    defined = sum(r is not None for r in values)
    cell = _fmt(mean, "x")
    return cell if defined == len(values) else f"{cell} ({defined} of {len(values)})"


def _replica_counts(nested: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """Replica counts of a scenario -> policy -> replicas mapping, first-seen order."""
    return list(
        dict.fromkeys(n for by_p in nested.values() for by_n in by_p.values() for n in by_n)
    )


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _scaling_table(
    scaling: Mapping[str, Mapping[str, Mapping[str, float | None]]], bounds: Bounds
) -> str:
    counts = _replica_counts(scaling)
    lines = [
        _row(["scenario", "policy", *(f"x{n} vs x1" for n in counts)]),
        _row(["---", "---", *["---:"] * len(counts)]),
    ]
    for scenario, by_policy in scaling.items():
        for policy, by_n in by_policy.items():
            cells = [
                _ratio_cell(
                    by_n.get(n),
                    n in by_n and any(bound_of(bounds, scenario, policy, m) for m in (n, "1")),
                )
                for n in counts
            ]
            lines.append(_row([scenario, policy, *cells]))
    return "\n".join(lines)


def _ablation_table(
    ablation: Mapping[str, Ratios], means: Mapping[str, float | None], bounds: Bounds
) -> str:
    variants = list(ablation)
    rows: dict[tuple[str, str], list[str]] = {}
    for i, variant in enumerate(variants):
        for scenario, by_n in ablation[variant].items():
            for n, ratio in by_n.items():
                bounded = any(bound_of(bounds, scenario, p, n) for p in (FULL, variant))
                rows.setdefault((scenario, n), ["n/a"] * len(variants))[i] = _ratio_cell(
                    ratio, bounded
                )
    lines = [
        _row(["scenario", "replicas", *(f"{FULL} / {v}" for v in variants)]),
        _row(["---", "---:", *["---:"] * len(variants)]),
    ]
    lines += [_row([s, n, *cells]) for (s, n), cells in rows.items()]
    lines.append(_row(["geo-mean", "", *(_mean_cell(ablation[v], means[v]) for v in variants)]))
    return "\n".join(lines)
