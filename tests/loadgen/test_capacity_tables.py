"""Paper-table, scaling and ablation summaries computed from hand-made capacities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.capacity import CapacityResult
from loadgen.capacity_tables import (
    Bound,
    capacity_ratios,
    geomean,
    markdown_tables,
    scaling_factors,
    summarize,
)

PAPER = {
    "chatbot": {
        "slos": {"1": 4.0},
        "vllm": {"1": 1.0},
        "sarathi": {"1": 2.0},
        "distserve": {"1": 1.0},
    },
    "coder": {
        "slos": {"1": 8.0},
        "vllm": {"1": 2.0},
        "sarathi": {"1": 0.0},
        "distserve": {"1": 4.0},
    },
}


def test_paper_table_ratios_use_the_best_baseline() -> None:
    summary = summarize(PAPER)
    assert summary["capacity"] is PAPER
    assert summary["capacity_ratio"] == {"chatbot": {"1": 2.0}, "coder": {"1": 4.0}}
    assert summary["capacity_ratio_geomean"] == pytest.approx(8**0.5)
    assert summary["capacity_ratio_vs_distserve"] == {"chatbot": {"1": 4.0}, "coder": {"1": 2.0}}
    assert summary["capacity_ratio_vs_distserve_geomean"] == pytest.approx(8**0.5)
    assert "scaling" not in summary and "ablation" not in summary


def test_a_ratio_needs_both_capacities() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 0.0}, "vllm": {"1": 1.0}},
        "coder": {"slos": {"1": 2.0}, "vllm": {"1": 0.0}, "sarathi": {"1": 0.0}},
        "mixed": {"slos": {"1": 1.0}},
    }
    ratios = capacity_ratios(capacity, "slos", ("vllm", "sarathi"))
    assert ratios == {"chatbot": {"1": None}, "coder": {"1": None}}
    assert summarize(capacity)["capacity_ratio_geomean"] is None
    assert markdown_tables(summarize(capacity)).endswith("| n/a (0 of 2) |")
    assert geomean([None, 2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([]) is None


def test_scaling_is_total_capacity_over_one_replica() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 2.0, "2": 2.0, "4": 2.5}, "vllm": {"2": 1.0}},
        "coder": {"slos": {"1": 0.0, "4": 1.0}},
    }
    assert scaling_factors(capacity) == {
        "chatbot": {"slos": {"2": 2.0, "4": 5.0}},
        "coder": {"slos": {"4": None}},
    }
    summary = summarize(capacity)
    assert summary["scaling"]["chatbot"]["slos"]["4"] == 5.0
    assert summary["capacity_ratio"] == {"chatbot": {"2": 2.0}}


def test_ablation_is_slos_over_each_variant() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 3.0}, "slos-nospec": {"1": 1.5}, "slos-noadmit": {"1": 3.0}},
        "coder": {"slos": {"1": 4.0}, "slos-nospec": {"1": 1.0}, "slos-noadmit": {"1": 2.0}},
    }
    summary = summarize(capacity)
    assert summary["ablation"] == {
        "slos-nospec": {"chatbot": {"1": 2.0}, "coder": {"1": 4.0}},
        "slos-noadmit": {"chatbot": {"1": 1.0}, "coder": {"1": 2.0}},
    }
    assert summary["ablation_geomean"] == pytest.approx(
        {"slos-nospec": 8**0.5, "slos-noadmit": 2**0.5}
    )
    assert summary["capacity_ratio_geomean"] is None


def test_markdown_lists_every_capacity_and_ratio() -> None:
    text = markdown_tables(summarize(PAPER))
    lines = text.splitlines()
    assert lines[0] == (
        "| scenario | replicas | slos | vllm | sarathi | distserve "
        "| slos / best(vllm, sarathi) | slos / distserve |"
    )
    assert "| chatbot | 1 | 4.00 | 1.00 | 2.00 | 1.00 | 2.00x | 4.00x |" in lines
    assert "| coder | 1 | 8.00 | 2.00 | 0.00 | 4.00 | 4.00x | 2.00x |" in lines
    assert lines[-1] == "| geo-mean |  |  |  |  |  | 2.83x | 2.83x |"


def test_markdown_adds_scaling_and_ablation_tables() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 2.0, "4": 2.5}, "slos-noroute": {"1": 2.0, "4": 1.25}},
    }
    text = markdown_tables(summarize(capacity))
    assert "| scenario | policy | x4 vs x1 |" in text
    assert "| chatbot | slos | 5.00x |" in text
    assert "| chatbot | slos-noroute | 2.50x |" in text
    assert "| scenario | replicas | slos / slos-noroute |" in text
    assert "| chatbot | 1 | 1.00x |" in text and "| chatbot | 4 | 2.00x |" in text
    assert "slos / best" not in text


def test_a_ratio_to_a_search_limit_is_left_out_and_the_limit_marked() -> None:
    """QA's table: slos and vllm both passed every rate up to --max-rate 1.5, which printed
    "1.50 | 1.50 | 1.00x" and a geo-mean of 1.0; coder's capacities were measured."""
    capacity = {
        "chatbot": {"slos": {"1": 1.5}, "vllm": {"1": 1.5}},
        "coder": {"slos": {"1": 4.0}, "vllm": {"1": 2.0}},
        "mixed": {"slos": {"1": 1.0}, "vllm": {"1": 0.0}},
    }
    bounds = {
        "chatbot": {"slos": {"1": {"at_least": 1.5}}, "vllm": {"1": {"at_least": 1.5}}},
        "mixed": {"vllm": {"1": {"below": 0.001}}},
    }
    summary = summarize(capacity, bounds)
    assert summary["capacity_ratio"] == {
        "chatbot": {"1": None},
        "coder": {"1": 2.0},
        "mixed": {"1": None},
    }
    assert summary["capacity_ratio_geomean"] == 2.0
    assert summary["capacity_bounds"] == bounds
    lines = markdown_tables(summary).splitlines()
    assert "| chatbot | 1 | >=1.50 | >=1.50 | n/a (bound) |" in lines
    assert "| coder | 1 | 4.00 | 2.00 | 2.00x |" in lines
    assert "| mixed | 1 | 1.00 | <0.001 | n/a (bound) |" in lines
    assert lines[-1] == "| geo-mean |  |  |  | 2.00x (1 of 3) |"
    # One bound side is enough: a measured slos over a baseline at its ceiling flatters slos.
    one_side = {"chatbot": {"vllm": {"1": {"at_least": 1.5}}}}
    assert capacity_ratios(capacity, "slos", ("vllm",), one_side)["chatbot"] == {"1": None}
    assert "capacity_bounds" not in summarize(capacity)


def test_scaling_and_ablation_leave_out_ratios_to_a_bound() -> None:
    capacity = {
        "chatbot": {"slos": {"1": 2.0, "4": 8.0}, "slos-noroute": {"1": 2.0, "4": 1.0}},
    }
    bounds = {"chatbot": {"slos": {"4": {"at_least": 8.0}}}}
    assert scaling_factors(capacity, bounds) == {
        "chatbot": {"slos": {"4": None}, "slos-noroute": {"4": 2.0}}
    }
    summary = summarize(capacity, bounds)
    assert summary["ablation"] == {"slos-noroute": {"chatbot": {"1": 1.0, "4": None}}}
    text = markdown_tables(summary)
    assert "| chatbot | slos | n/a (bound) |" in text
    assert "| chatbot | 4 | n/a (bound) |" in text


def test_the_paper_tables_capacities_are_all_measured() -> None:
    """The shipped paper table's searches each found a pass and a failure: no bound, so its
    summary is what bounds leave it."""
    path = Path(__file__).parents[2] / "loadgen/results/sim-paper-table-tol025-regraded.json"
    data = json.loads(path.read_text())
    bounds: dict[str, dict[str, dict[str, Bound]]] = {}
    for search in data["capacity_searches"]:
        found = CapacityResult(search["capacity"], search["lowest_failing"], 0.9, ())
        if found.bound is not None:
            bounds.setdefault(search["scenario"], {}).setdefault(search["policy"], {})["1"] = (
                found.bound
            )
    assert bounds == {}
    assert summarize(data["summary"]["capacity"], bounds) == data["summary"]
