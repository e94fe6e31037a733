"""Paper-table, scaling and ablation summaries computed from hand-made capacities."""

from __future__ import annotations

import pytest

from loadgen.capacity_tables import (
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
