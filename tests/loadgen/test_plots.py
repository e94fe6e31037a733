"""Figure data from hand-made results, and that each figure is written as a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from loadgen.plots import (
    Curve,
    Panel,
    attainment_panels,
    burst_timeline,
    capacity_bars,
    figure_paths,
    plot_attainment,
    plot_capacity,
    plot_replicas_needed,
    plot_sizing,
    plot_timelines,
    replicas_needed,
    sizing_panels,
)
from loadgen.records import RequestRecord
from loadgen.sizing import SizingResult
from replica.request import SLO

SLO_100_50 = SLO(ttft_ms=100.0, tpot_ms=50.0)


def rec(rid: str, arrival: float, verdict: str, times: tuple[float, ...]) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        scenario="coder",
        slo_class="tight/tight",
        arrival_s=arrival,
        prompt_len=10,
        output_len=2,
        slo=SLO_100_50,
        zero_load_ttft_s=0.05,
        verdict=verdict,  # type: ignore[arg-type]
        token_times_s=times,
    )


RECORDS = [
    rec("a", 0.2, "admitted", (0.25, 0.3)),  # on time
    rec("b", 0.5, "admitted", (0.7, 0.75)),  # first token 0.2 s late
    rec("c", 1.5, "best_effort", (3.0, 3.2)),  # deferred, finishes in bin 3
    rec("d", 1.7, "rejected", ()),
]


def run(scenario: str, policy: str, rate: float, attainment: float) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "policy": policy,
        "replicas": 1,
        "rate_per_replica": rate,
        "attainment": attainment,
    }


def test_attainment_panels_sort_rates_and_mark_capacity() -> None:
    runs = [
        run("coder", "slos", 2.0, 0.5),
        run("coder", "slos", 1.0, 1.0),
        run("coder", "vllm", 1.0, 0.8),
        run("chatbot", "slos", 1.0, 0.95),
        run("coder", "slos", 1.5, 0.92),
        # evaluated again: the last value counts (a search stopped it early this time)
        run("coder", "slos", 2.0, 0.6) | {"stopped_early": True},
    ]
    capacity = {"coder": {"slos": {"1": 1.5}, "vllm": {"1": 0.0}}}
    coder, chatbot = attainment_panels(runs, capacity)
    assert coder == Panel(
        "coder",
        1,
        (
            Curve("slos", (1.0, 1.5, 2.0), (1.0, 0.92, 0.6), 1.5, (False, False, True)),
            Curve("vllm", (1.0,), (0.8,), 0.0, (False,)),
        ),
    )
    assert chatbot == Panel("chatbot", 1, (Curve("slos", (1.0,), (0.95,), None, (False,)),))


def test_capacity_bars_group_by_replica_count_with_nan_for_missing() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 3.0, "2": 2.5}, "vllm": {"1": 1.0}},
        "coder": {"vllm": {"1": 2.0}},
    }
    one, two = capacity_bars(capacity)
    assert (one.replicas, one.scenarios, one.policies) == (
        "1",
        ("chatbot", "coder"),
        ("slos", "vllm"),
    )
    assert one.values[0][0] == 3.0 and math.isnan(one.values[0][1])
    assert one.values[1] == (1.0, 2.0)
    assert two.replicas == "2"
    assert two.values[0][0] == 2.5 and math.isnan(two.values[1][0])


def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the plot functions draw, kept instead of written."""
    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    return figures


CREDIT = "arrivals: Azure LLM inference trace 2023 (CC-BY 4.0)"


def test_capacity_bars_label_as_the_table_and_hatch_a_search_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    capacity = {
        "chatbot": {"slos": {"1": 5.25}, "vllm": {"1": 1.5}},
        "coder": {"slos": {"1": 0.0}},
    }
    bounds = {
        "chatbot": {"vllm": {"1": {"at_least": 1.5}}},
        "coder": {"slos": {"1": {"below": 0.001}}},
    }
    (bars,) = capacity_bars(capacity, bounds)
    assert bars.bounds == ((None, {"below": 0.001}), ({"at_least": 1.5}, None))
    figures = drawn(monkeypatch)
    plot_capacity([bars], Path("unused.png"), CREDIT)
    (fig,) = figures
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.texts] == ["5.25", "<0.001", ">=1.50", ""]
    assert [bar.get_hatch() for bar in ax.patches] == [None, "//", "//", None]
    assert ax.get_legend_handles_labels()[1] == ["slos", "vllm"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["slos", "vllm", "search limit"]
    assert fig.get_suptitle() == CREDIT
    assert capacity_bars(capacity)[0].bounds == ((None, None), (None, None))


def test_attainment_names_a_capacity_at_the_search_limit_and_credits_the_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = [run("chatbot", p, r, 1.0) for p in ("slos", "vllm") for r in (0.75, 1.5)]
    capacity = {"chatbot": {"slos": {"1": 1.5}, "vllm": {"1": 1.5}}}
    bounds = {"chatbot": {"slos": {"1": {"at_least": 1.5}}}}
    (panel,) = attainment_panels(runs, capacity, bounds)
    assert [c.bound for c in panel.curves] == [{"at_least": 1.5}, None]
    figures = drawn(monkeypatch)
    plot_attainment([panel], Path("unused.png"), credit=CREDIT)
    timeline = burst_timeline(RECORDS)
    plot_timelines({"slos": timeline}, "chatbot", Path("unused.png"), CREDIT)
    attainment, timelines = figures
    labels = attainment.axes[0].get_legend_handles_labels()[1]
    assert labels[:2] == ["slos (capacity >=1.50)", "vllm"]
    assert attainment.get_suptitle() == CREDIT and timelines.get_suptitle() == CREDIT


def test_burst_timeline_bins_arrivals_verdicts_and_deferred_completions() -> None:
    t = burst_timeline(RECORDS, bin_s=1.0)
    assert t.starts == (0.0, 1.0, 2.0, 3.0)
    assert t.arrivals == (2.0, 2.0, 0.0, 0.0)
    assert t.admitted == (2.0, 0.0, 0.0, 0.0)
    assert t.best_effort == (0.0, 1.0, 0.0, 0.0)
    assert t.rejected == (0.0, 1.0, 0.0, 0.0)
    assert t.attained == (1.0, 0.0, 0.0, 0.0)
    assert t.best_effort_done == (0.0, 0.0, 0.0, 1.0)
    half = burst_timeline(RECORDS, bin_s=2.0)
    assert half.starts == (0.0, 2.0)
    assert half.arrivals == (2.0, 0.0)  # 4 requests in 2 s
    assert half.best_effort_done == (0.0, 0.5)


@pytest.mark.parametrize("bin_s", [0.0, -1.0, math.inf])
def test_burst_timeline_names_a_bad_bin(bin_s: float) -> None:
    with pytest.raises(ValueError, match="bin_s"):
        burst_timeline(RECORDS, bin_s)
    with pytest.raises(ValueError, match="no records"):
        burst_timeline([], 1.0)


def test_figure_paths_put_the_main_figure_at_the_given_path() -> None:
    paths = figure_paths(Path("out/sim.png"))
    assert paths == {
        "attainment": Path("out/sim.png"),
        "capacity": Path("out/sim-capacity.png"),
        "timeline": Path("out/sim-timeline.png"),
        "replicas": Path("out/sim-replicas.png"),
    }
    assert figure_paths(Path("sim"))["capacity"] == Path("sim-capacity.png")


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_every_figure_is_a_non_empty_png(tmp_path: Path) -> None:
    runs = [run("coder", p, r, a) for p in ("slos", "vllm") for r, a in ((1, 1.0), (2, 0.7))]
    capacity = {"coder": {"slos": {"1": 1.5}, "vllm": {"1": 1.0}}}
    paths = figure_paths(tmp_path / "sim.png")
    plot_attainment(attainment_panels(runs, capacity), paths["attainment"])
    plot_capacity(capacity_bars(capacity), paths["capacity"])
    timeline = burst_timeline(RECORDS)
    plot_timelines({"slos": timeline, "vllm": timeline}, "coder", paths["timeline"])
    assert all(is_png(paths[name]) for name in ("attainment", "capacity", "timeline"))
    with pytest.raises(ValueError, match="no runs"):
        plot_attainment([], tmp_path / "empty.png")
    with pytest.raises(ValueError, match="no timelines"):
        plot_timelines({}, "coder", tmp_path / "empty.png")


def test_sizing_figures_from_hand_made_searches(tmp_path: Path) -> None:
    def sized(policy: str, total: float, counts: dict[int, float]) -> list[dict[str, Any]]:
        return [
            run("coder", policy, total / n, a) | {"replicas": n, "total_rate": total}
            for n, a in counts.items()
        ]

    runs = sized("slos", 12.0, {2: 0.95, 1: 0.4}) + sized("vllm", 12.0, {4: 0.8, 3: 0.7})
    runs[1]["stopped_early"] = True
    runs += sized("slos", 24.0, {4: 0.93, 3: 0.6}) + sized("vllm", 24.0, {8: 0.95, 7: 0.85})
    sizing = {
        "coder": {
            "12": {"slos": SizingResult(2, 1, 0.9, ()), "vllm": SizingResult(None, 4, 0.9, ())},
            "24": {"slos": SizingResult(4, 3, 0.9, ()), "vllm": SizingResult(8, 7, 0.9, ())},
        }
    }
    panels = sizing_panels(runs, sizing)
    assert [p.scenario for p in panels] == ["coder, 12 req/s", "coder, 24 req/s"]
    assert panels[0].curves == (
        Curve("slos", (1.0, 2.0), (0.4, 0.95), 2.0, (True, False)),
        Curve("vllm", (3.0, 4.0), (0.7, 0.8), None, (False, False)),
    )
    (needed,) = replicas_needed(sizing)
    assert needed.rates == (12.0, 24.0)
    assert needed.replicas == {"slos": (2, 4), "vllm": (None, 8)}
    paths = figure_paths(tmp_path / "size.png")
    plot_sizing(panels, paths["attainment"])
    plot_replicas_needed([needed], paths["replicas"])
    assert is_png(paths["attainment"]) and is_png(paths["replicas"])
    with pytest.raises(ValueError, match="no sizing"):
        plot_replicas_needed([], tmp_path / "empty.png")
