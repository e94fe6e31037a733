"""Sizing: the replica-count search on synthetic systems, and its summary and table."""

from __future__ import annotations

import math

import pytest

from loadgen.sizing import (
    SizingPoint,
    SizingResult,
    find_replicas,
    sizing_table,
    summarize_sizing,
)


def step_at(needed: int) -> tuple[list[int], object]:
    """A system that attains 0.95 from `needed` replicas on and less below, logging calls."""
    calls: list[int] = []

    def attainment(n: int) -> float:
        calls.append(n)
        return 0.95 if n >= needed else 0.9 * n / needed

    return calls, attainment


@pytest.mark.parametrize("start", [1, 2, 6, 7, 8, 20, 64])
def test_finds_the_fewest_passing_count_from_any_start(start: int) -> None:
    calls, attainment = step_at(7)
    found = find_replicas(attainment, start, most=64)  # type: ignore[arg-type]
    assert (found.replicas, found.largest_failing) == (7, 6)
    assert [p.replicas for p in found.points] == calls
    assert len(set(calls)) == len(calls)  # no count is run twice


def test_bracketing_multiplies_up_divides_down_then_bisects() -> None:
    calls, attainment = step_at(11)
    find_replicas(attainment, 1)  # type: ignore[arg-type]
    assert calls == [1, 2, 4, 8, 16, 12, 10, 11]
    calls, attainment = step_at(3)
    find_replicas(attainment, 40)  # type: ignore[arg-type]
    assert calls == [40, 32, 26, 21, 17, 14, 12, 10, 8, 7, 6, 5, 4, 3, 2]
    calls, attainment = step_at(30)
    find_replicas(attainment, 40)  # type: ignore[arg-type]
    assert calls == [40, 32, 26, 29, 30]
    calls, attainment = step_at(3)
    find_replicas(attainment, 40, shrink=2.0)  # type: ignore[arg-type]
    assert calls == [40, 20, 10, 5, 3, 2]


def test_limits_report_what_was_not_found() -> None:
    _, attainment = step_at(100)
    ceiling = find_replicas(attainment, 3, most=10)  # type: ignore[arg-type]
    assert ceiling.replicas is None and ceiling.largest_failing == 10
    _, attainment = step_at(1)
    floor = find_replicas(attainment, 5, least=2)  # type: ignore[arg-type]
    assert floor.replicas == 2 and floor.largest_failing is None
    assert min(p.replicas for p in floor.points) == 2  # distserve never runs on one replica


def test_a_growth_below_two_still_moves_by_at_least_one() -> None:
    calls, attainment = step_at(4)
    assert find_replicas(attainment, 1, growth=1.1).replicas == 4  # type: ignore[arg-type]
    assert calls == [1, 2, 3, 4]


def test_a_non_monotone_system_goes_unseen_and_is_not_claimed_checked() -> None:
    """Failing at 5 above passing at 3 and 4: the search stops at 3 without running 5."""
    calls: list[int] = []

    def attainment(n: int) -> float:
        calls.append(n)
        return 0.5 if n == 5 or n < 3 else 0.95

    found = find_replicas(attainment, 4)
    assert (found.replicas, found.largest_failing) == (3, 2) and 5 not in calls
    assert "monotone" not in found.to_dict() and not hasattr(found, "monotone")
    odd = SizingResult(3, 2, 0.9, (SizingPoint(3, 0.95), SizingPoint(5, 0.5), SizingPoint(2, 0.1)))
    assert odd.to_dict()["points"][1] == {"replicas": 5, "attainment": 0.5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 0}, "start must be an integer >= 1"),
        ({"start": 2.5}, "start must be an integer"),
        ({"start": True}, "start must be an integer"),
        ({"start": 70}, r"start=70 must be in \[1, 64\]"),
        ({"start": 1, "least": 2}, r"start=1 must be in \[2, 64\]"),
        ({"start": 1, "target": 0}, "target"),
        ({"start": 1, "growth": 1.0}, "growth"),
        ({"start": 1, "shrink": math.inf}, "shrink"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_replicas(lambda n: 1.0, **kwargs)  # type: ignore[arg-type]


def test_an_attainment_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="attainment with 3 replicas must be in"):
        find_replicas(lambda n: 1.5, 3)


def result(n: int | None) -> SizingResult:
    return SizingResult(n, None, 0.9, ())


def test_summary_counts_gpus_and_what_slos_saves() -> None:
    sizing = {
        "chatbot": {
            "12": {
                "slos": result(3),
                "vllm": result(5),
                "sarathi": result(4),
                "distserve": result(6),
            },
            "24": {"slos": result(5), "vllm": result(9), "sarathi": result(8)},
        },
        "coder": {"12": {"slos": result(7), "vllm": result(None), "sarathi": result(10)}},
        "summarizer": {"12": {"slos": result(None), "sarathi": result(2)}},
    }
    bound = {"chatbot": {"12": 3, "24": 5}, "coder": {"12": 1}, "summarizer": {"12": 1}}
    summary = summarize_sizing(sizing, 64, 2, bound)
    assert summary["work_bound_replicas"] == bound
    assert summary["replicas"]["chatbot"]["12"] == {
        "slos": 3,
        "vllm": 5,
        "sarathi": 4,
        "distserve": 6,
    }
    assert summary["gpus"]["chatbot"]["24"]["slos"] == 10
    assert summary["gpus"]["coder"]["12"]["vllm"] is None
    chat = summary["slos_saves"]["chatbot"]
    assert chat["12"]["vs_best_baseline"] == {"replicas": 4, "replicas_saved": 1, "ratio": 4 / 3}
    assert chat["12"]["vs_distserve"] == {"replicas": 6, "replicas_saved": 3, "ratio": 2.0}
    assert chat["24"] == {"vs_best_baseline": {"replicas": 8, "replicas_saved": 3, "ratio": 1.6}}
    # A baseline that found no count leaves the ratio unknown, not flattering.
    assert summary["slos_saves"]["coder"]["12"] == {}
    assert summary["slos_saves"]["summarizer"]["12"] == {}
    table = sizing_table(summary)
    assert "Replicas at 90% attainment (2 GPU(s) each)" in table
    assert "| scenario | req/s in all | work bound | slos | vllm | sarathi | distserve |" in table
    assert "| chatbot | 12 | 3 | 3 | 5 | 4 | 6 | 1.33x |" in table
    assert "| chatbot | 24 | 5 | 5 | 9 | 8 | - | 1.60x |" in table
    assert "| coder | 12 | 1 | 7 | >64 | 10 | - | n/a |" in table
    assert "| summarizer | 12 | 1 | >64 | - | 2 | - | n/a |" in table
