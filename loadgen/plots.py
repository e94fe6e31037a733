"""Figures of `slos-serve simulate` results: attainment vs rate, capacity bars, burst
timeline, and attainment vs replica count for a sizing run.

Each figure has a data-preparation function (tested on hand-made results) and a drawing
function. Drawing uses matplotlib's object API on the Agg canvas, never pyplot, so no global
backend state is touched and nothing needs a display; the path's suffix picks the format (PNG
without one). A capacity that is a search's bound, not a measurement, is marked as the tables
mark it (">=1.50", "<0.001"; hatched bars). `credit` (the traces' attribution, for runs on
trace arrivals) goes in each figure's heading.

The burst timeline follows the SLOs-Serve paper's Figure 11: over one run, per second,
how many requests arrived, how many were admitted, deferred to best effort or rejected, how many
of those arriving then attained their SLO (deadline semantics), and when deferred requests
finished (the paper's point: best-effort work is served in the lulls after a burst).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from loadgen.capacity import DEFAULT_TARGET
from loadgen.capacity_tables import Bound, Bounds, bound_of, capacity_cell
from loadgen.metrics import attained_deadline
from loadgen.records import RequestRecord, Verdict
from loadgen.sizing import Sizing, rate_key

Capacity = Mapping[str, Mapping[str, Mapping[str, float]]]
"""scenario -> policy -> replica count (as a string, the JSON key) -> req/s per replica."""


def figure_paths(path: Path) -> dict[str, Path]:
    """Where the figures of one `--plot PATH` go: PATH itself is attainment vs rate (vs replica
    count for sizing); the capacity bars, the burst timeline and sizing's replicas needed vs
    rate get `-capacity`, `-timeline` and `-replicas` before the suffix."""
    suffix = path.suffix or ".png"
    return {
        "attainment": path.with_suffix(suffix),
        "capacity": path.with_name(f"{path.stem}-capacity{suffix}"),
        "timeline": path.with_name(f"{path.stem}-timeline{suffix}"),
        "replicas": path.with_name(f"{path.stem}-replicas{suffix}"),
    }


# -- attainment vs rate -------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """One policy's evaluated rates, ascending, and its capacity when one was searched."""

    policy: str
    rates: tuple[float, ...]
    attainments: tuple[float, ...]
    capacity: float | None
    stopped: tuple[bool, ...] = ()
    """Per point (or none): the run stopped early, so its attainment is only the most it could
    have reached (drawn as a hollow triangle under the target, off the line)."""
    bound: Bound | None = None
    """Set when the capacity is the search's ceiling or floor (named in the legend)."""


@dataclass(frozen=True)
class Panel:
    scenario: str
    replicas: int
    curves: tuple[Curve, ...]


def attainment_panels(
    runs: Sequence[Mapping[str, Any]], capacity: Capacity, bounds: Bounds | None = None
) -> list[Panel]:
    """One panel per (scenario, replica count) in first-seen order, one curve per policy.

    `runs` are the `runs` entries of the simulate JSON (scenario, policy, replicas,
    rate_per_replica, attainment, stopped_early); a rate evaluated twice keeps its last value.
    `bounds`: the capacities that are a search's bound (`summary.capacity_bounds`)."""
    points = _group(
        runs,
        lambda run: (str(run["scenario"]), int(run["replicas"])),
        lambda run: float(run["rate_per_replica"]),
    )
    panels = []
    for (scenario, replicas), by_policy in points.items():
        curves = []
        for policy, by_rate in by_policy.items():
            found = capacity.get(scenario, {}).get(policy, {}).get(str(replicas))
            bound = bound_of(bounds or {}, scenario, policy, str(replicas))
            curves.append(replace(_curve(policy, by_rate, found), bound=bound))
        panels.append(Panel(scenario, replicas, tuple(curves)))
    return panels


Point = tuple[float, bool]
"""A run's attainment and whether it stopped early."""
K = TypeVar("K")


def _group(
    runs: Sequence[Mapping[str, Any]],
    key: Callable[[Mapping[str, Any]], K],
    x: Callable[[Mapping[str, Any]], float],
) -> dict[K, dict[str, dict[float, Point]]]:
    """Runs by panel key, then policy, then x; an x evaluated twice keeps its last run."""
    out: dict[K, dict[str, dict[float, Point]]] = {}
    for run in runs:
        by_x = out.setdefault(key(run), {}).setdefault(str(run["policy"]), {})
        by_x[x(run)] = float(run["attainment"]), bool(run.get("stopped_early", False))
    return out


def _curve(policy: str, points: Mapping[float, Point], mark: float | None) -> Curve:
    xs = sorted(points)
    return Curve(
        policy,
        tuple(xs),
        tuple(points[x][0] for x in xs),
        mark,
        tuple(points[x][1] for x in xs),
    )


def _grid(n: int, width: float, height: float, credit: str) -> tuple[Figure, list[Axes]]:
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    _credit(fig, credit)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _credit(fig: Figure, credit: str) -> None:
    """The data's attribution as the figure's heading (a trace's licence asks for it)."""
    if credit:
        fig.suptitle(credit, fontsize="x-small", wrap=True)


def plot_attainment(
    panels: Sequence[Panel], path: Path, target: float = DEFAULT_TARGET, credit: str = ""
) -> None:
    """Attainment vs per-replica rate per policy; a dotted vertical line marks each capacity
    (a bound's is named in the legend: "slos (capacity >=1.50)")."""
    _plot_curves(
        panels,
        path,
        lambda panel: f"{panel.scenario}, {panel.replicas} replica(s)",
        "request rate per replica (req/s)",
        target,
        integer_x=False,
        credit=credit,
    )


def _plot_curves(
    panels: Sequence[Panel],
    path: Path,
    title: Callable[[Panel], str],
    xlabel: str,
    target: float,
    *,
    integer_x: bool,
    credit: str,
) -> None:
    if not panels:
        raise ValueError("no runs to plot")
    fig, axes = _grid(len(panels), 4.5, 3.2, credit)
    for ax, panel in zip(axes, panels, strict=True):
        for color, curve in zip(_colors(), panel.curves, strict=False):
            stopped = curve.stopped or (False,) * len(curve.rates)
            whole = [i for i, s in enumerate(stopped) if not s]
            xs, ys = [curve.rates[i] for i in whole], [curve.attainments[i] for i in whole]
            label = curve.policy
            if curve.bound is not None:
                label += f" (capacity {capacity_cell(curve.capacity, curve.bound)})"
            ax.plot(xs, ys, "o-", color=color, label=label, ms=3)
            cut = [i for i, s in enumerate(stopped) if s]
            xs, ys = [curve.rates[i] for i in cut], [curve.attainments[i] for i in cut]
            ax.plot(xs, ys, "v", color=color, mfc="white", ms=5)
            if curve.capacity is not None:
                ax.axvline(curve.capacity, color=color, ls=":", lw=1.2)
        if any(any(c.stopped) for c in panel.curves):
            ax.plot([], [], "v", color="gray", mfc="white", ms=5, label="failed, stopped early")
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"{target:.0%} target")
        ax.set_title(title(panel))
        ax.set_xlabel(xlabel)
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


# -- sizing: attainment vs replica count, replicas needed vs total rate -------------------------


def sizing_panels(runs: Sequence[Mapping[str, Any]], sizing: Sizing) -> list[Panel]:
    """One panel per (scenario, total rate), one curve per policy over the replica counts its
    search ran (`Curve.rates` holds the counts, `Curve.capacity` the count found). `runs` are
    a sizing run's entries (scenario, policy, total_rate, replicas, attainment);
    `Panel.replicas` is 0."""
    points = _group(
        runs,
        lambda run: (str(run["scenario"]), rate_key(float(run["total_rate"]))),
        lambda run: float(run["replicas"]),
    )
    panels = []
    for (scenario, rate), by_policy in points.items():
        curves = []
        for policy, by_count in by_policy.items():
            found = sizing.get(scenario, {}).get(rate, {}).get(policy)
            chosen = None if found is None or found.replicas is None else float(found.replicas)
            curves.append(_curve(policy, by_count, chosen))
        panels.append(Panel(f"{scenario}, {rate} req/s", 0, tuple(curves)))
    return panels


def plot_sizing(
    panels: Sequence[Panel], path: Path, target: float = DEFAULT_TARGET, credit: str = ""
) -> None:
    """Attainment vs replica count at one total rate per panel; a dotted line marks each
    policy's count."""
    _plot_curves(
        panels,
        path,
        lambda panel: panel.scenario,
        "replicas",
        target,
        integer_x=True,
        credit=credit,
    )


@dataclass(frozen=True)
class Needed:
    """One scenario's replicas needed per policy at each total rate (None: not found)."""

    scenario: str
    rates: tuple[float, ...]
    replicas: Mapping[str, tuple[int | None, ...]]


def replicas_needed(sizing: Sizing) -> list[Needed]:
    """Per scenario, each policy's count at each rate, rates ascending."""
    out = []
    for scenario, by_rate in sizing.items():
        rates = sorted(by_rate, key=float)
        policies = dict.fromkeys(p for by in by_rate.values() for p in by)
        counts = {
            policy: tuple(
                None if (r := by_rate[rate].get(policy)) is None else r.replicas for rate in rates
            )
            for policy in policies
        }
        out.append(Needed(scenario, tuple(map(float, rates)), counts))
    return out


def plot_replicas_needed(needed: Sequence[Needed], path: Path, credit: str = "") -> None:
    """Replicas each policy needs as the total rate grows, one panel per scenario (a count not
    found within the search's ceiling is left out)."""
    if not needed:
        raise ValueError("no sizing to plot")
    fig, axes = _grid(len(needed), 4.5, 3.2, credit)
    for ax, one in zip(axes, needed, strict=True):
        for color, (policy, counts) in zip(_colors(), one.replicas.items(), strict=False):
            ys = [math.nan if n is None else n for n in counts]
            ax.plot(one.rates, ys, "o-", color=color, label=policy, ms=3)
        ax.set_title(one.scenario)
        ax.set_xlabel("requests per second in all")
        ax.set_ylabel(f"replicas for {DEFAULT_TARGET:.0%} attainment")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def _colors() -> list[str]:
    return [f"C{i}" for i in range(10)]


# -- capacity bars ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bars:
    """Capacity of each policy (rows) in each scenario (columns) at one replica count; NaN
    where a policy was not searched."""

    replicas: str
    scenarios: tuple[str, ...]
    policies: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]
    bounds: tuple[tuple[Bound | None, ...], ...]
    """Like `values`: the bound a capacity is (a search's ceiling or floor), else None."""


def capacity_bars(capacity: Capacity, bounds: Bounds | None = None) -> list[Bars]:
    """One group of bars per replica count, scenarios and policies in first-seen order;
    `bounds`: the capacities that are a search's bound (`summary.capacity_bounds`)."""
    scenarios = list(capacity)
    policies: dict[str, None] = {}
    counts: dict[str, None] = {}
    for by_policy in capacity.values():
        for policy, by_replicas in by_policy.items():
            policies[policy] = None
            counts.update(dict.fromkeys(by_replicas))
    out = []
    for n in counts:
        values = tuple(
            tuple(capacity[s].get(p, {}).get(n, math.nan) for s in scenarios) for p in policies
        )
        marks = tuple(tuple(bound_of(bounds or {}, s, p, n) for s in scenarios) for p in policies)
        out.append(Bars(n, tuple(scenarios), tuple(policies), values, marks))
    return out


def plot_capacity(bars: Sequence[Bars], path: Path, credit: str = "") -> None:
    """Per-scenario capacity, the policies side by side, one panel per replica count; each bar
    labeled as the table prints it, a bound's hatched."""
    if not bars:
        raise ValueError("no capacities to plot")
    fig, axes = _grid(len(bars), max(4.5, 1.3 * len(bars[0].scenarios)), 3.4, credit)
    for ax, group in zip(axes, bars, strict=True):
        x = np.arange(len(group.scenarios))
        width = 0.8 / len(group.policies)
        for i, (color, policy) in enumerate(zip(_colors(), group.policies, strict=False)):
            heights = np.asarray(group.values[i], dtype=float)
            offset = (i - (len(group.policies) - 1) / 2) * width
            drawn = ax.bar(x + offset, heights, width, label=policy, color=color)
            marks = group.bounds[i]
            for bar, bound in zip(drawn, marks, strict=True):
                if bound is not None:
                    bar.set_hatch("//")
            labels = [
                "" if math.isnan(v) else capacity_cell(v, bound)
                for v, bound in zip(group.values[i], marks, strict=True)
            ]
            ax.bar_label(drawn, labels, fontsize="x-small")
        handles = ax.get_legend_handles_labels()[0]
        if any(any(marks) for marks in group.bounds):
            handles.append(
                Patch(facecolor="white", edgecolor="gray", hatch="//", label="search limit")
            )
        ax.set_xticks(x, group.scenarios)
        ax.set_ylabel("capacity (req/s per replica)")
        ax.set_title(f"capacity at {DEFAULT_TARGET:.0%} attainment, {group.replicas} replica(s)")
        ax.legend(handles=handles, fontsize="small")
    fig.savefig(path, dpi=110)


# -- burst timeline -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """Per-second rates in bins of `bin_s` seconds starting at `starts`."""

    bin_s: float
    starts: tuple[float, ...]
    arrivals: tuple[float, ...]
    admitted: tuple[float, ...]
    best_effort: tuple[float, ...]
    """Deferred on arrival (the paper's red line)."""
    rejected: tuple[float, ...]
    attained: tuple[float, ...]
    """Requests arriving in the bin that attained their SLO."""
    best_effort_done: tuple[float, ...]
    """Deferred requests finishing in the bin (binned by their last token)."""


def burst_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> Timeline:
    """Bin one run's records by arrival (and deferred completions by their last token)."""
    if not records:
        raise ValueError("no records to bin")
    if not math.isfinite(bin_s) or bin_s <= 0:
        raise ValueError(f"bin_s must be finite and > 0, got {bin_s!r}")
    done = [
        r.token_times_s[-1] for r in records if r.verdict is Verdict.BEST_EFFORT and r.token_times_s
    ]
    end = max([r.arrival_s for r in records] + done)
    edges = bin_s * np.arange(math.floor(end / bin_s) + 2)

    def rate(times: Sequence[float]) -> tuple[float, ...]:
        counts, _ = np.histogram(np.asarray(times, dtype=float), bins=edges)
        return tuple(float(c) / bin_s for c in counts)

    def arrivals(verdict: Verdict | None) -> tuple[float, ...]:
        return rate([r.arrival_s for r in records if verdict is None or r.verdict is verdict])

    return Timeline(
        bin_s=bin_s,
        starts=tuple(float(e) for e in edges[:-1]),
        arrivals=arrivals(None),
        admitted=arrivals(Verdict.ADMITTED),
        best_effort=arrivals(Verdict.BEST_EFFORT),
        rejected=arrivals(Verdict.REJECTED),
        attained=rate([r.arrival_s for r in records if attained_deadline(r)]),
        best_effort_done=rate(done),
    )


def plot_timelines(
    timelines: Mapping[str, Timeline], title: str, path: Path, credit: str = ""
) -> None:
    """One row per policy (the same arrivals), like the paper's Figure 11."""
    if not timelines:
        raise ValueError("no timelines to plot")
    fig = Figure(figsize=(10, 2.4 * len(timelines)), layout="constrained")
    FigureCanvasAgg(fig)
    _credit(fig, credit)
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False).ravel()
    for ax, (policy, t) in zip(axes, timelines.items(), strict=True):
        edges = [*t.starts, t.starts[-1] + t.bin_s]
        ax.stairs(t.arrivals, edges, fill=True, color="0.85", label="arrived")
        for values, color, style, label in (
            (t.admitted, "C2", "-", "admitted"),
            (t.best_effort, "C3", "-", "deferred (best effort)"),
            (t.rejected, "k", "-", "rejected"),
            (t.attained, "C0", "--", "attained SLO"),
            (t.best_effort_done, "C1", ":", "deferred, finished"),
        ):
            if any(values):
                ax.stairs(values, edges, color=color, ls=style, lw=1, label=label)
        ax.set_title(f"{policy}: {title}", fontsize="medium")
        ax.set_ylabel("requests/s")
        ax.legend(fontsize="x-small", ncol=3, loc="upper right")
    axes[-1].set_xlabel(f"time (s), {timelines[next(iter(timelines))].bin_s:g} s bins")
    fig.savefig(path, dpi=110)
