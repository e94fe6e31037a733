"""`slos-serve simulate` options: --paper-table, --ablation, errors naming the option, and one
tiny end-to-end paper table with its figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.simulator import Policy
from loadgen import cli, simulate
from loadgen.workloads import Scenario


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slos-serve simulate")
    simulate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_paper_table_fixes_the_comparison_and_sizes_it_to_minutes() -> None:
    p = simulate.plan(parse("--paper-table"))
    assert p.profile == "a100-40gb-opt-7b-tp1"
    assert p.scenarios == list(Scenario)
    assert p.policies == [Policy.SLOS, Policy.VLLM, Policy.SARATHI, Policy.DISTSERVE]
    assert p.replica_counts == [1] and p.rate is None
    assert (p.arrivals, p.duration_s, p.rel_tol) == ("trace", 300.0, 0.1)
    # Reasoning runs longer: at its capacity 300 s would hold about a dozen requests.
    assert p.scenario_durations_s == {s: 300.0 for s in Scenario} | {Scenario.REASONING: 1200.0}
    assert p.start_rates == simulate.START_RATES
    # The run at the start rate lasts the duration: reasoning 0.1 req/s x 1200 s.
    assert p.requests_per_replica(Scenario.REASONING) == 120
    assert p.timeline_scenario is Scenario.CODER
    short = simulate.plan(parse("--paper-table", "--duration", "5", "--start-rate", "0.5"))
    assert short.duration_s == 5.0
    assert set(short.scenario_durations_s.values()) == {5.0}
    assert set(short.start_rates.values()) == {0.5}


def test_defaults_and_ablation() -> None:
    p = simulate.plan(parse("--capacity", "--scenario", "coder,chatbot", "--replicas", "1,4"))
    assert p.scenarios == [Scenario.CODER, Scenario.CHATBOT]
    assert p.policies == [Policy.SLOS, Policy.VLLM, Policy.SARATHI]
    assert p.replica_counts == [1, 4]
    assert (p.arrivals, p.duration_s, p.rel_tol) == ("poisson", 600.0, 0.05)
    assert p.scenario_durations_s == {Scenario.CODER: 600.0, Scenario.CHATBOT: 600.0}
    assert p.timeline_scenario is Scenario.CODER
    assert p.start_rates == {s: simulate.START_RATES[s] for s in p.scenarios}
    assert not p.same_window
    ablation = simulate.plan(parse("--capacity", "--ablation"))
    assert ablation.policies == [
        Policy.SLOS,
        Policy.SLOS_NOROUTE,
        Policy.SLOS_NOSPEC,
        Policy.SLOS_NOADMIT,
    ]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (("--paper-table", "--scenario", "coder"), "--scenario"),
        (("--paper-table", "--replicas", "2"), "--replicas"),
        (("--paper-table", "--ablation"), "--ablation"),
        (("--paper-table", "--same-window"), "--same-window"),
        (("--capacity", "--same-window", "--replicas", "2,2"), "--same-window"),
        (("--capacity", "--ablation", "--policies", "slos"), "--policies"),
        (("--capacity", "--policies", "slos,orca"), "--policies"),
        (("--capacity", "--scenario", "chat"), "--scenario"),
        (("--capacity", "--replicas", "1,0"), "--replicas"),
        (("--capacity", "--replicas", "two"), "--replicas"),
        (("--rate", "-1"), "--rate"),
        (("--capacity", "--rel-tol", "0"), "--rel-tol"),
        (("--capacity", "--min-rate", "nan"), "--min-rate"),
        (("--capacity", "--min-rate", "2", "--max-rate", "1"), "--max-rate"),
        (("--capacity", "--scenario", "chatbot", "--timeline-scenario", "coder"), "--timeline"),
    ],
)
def test_bad_options_are_named(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        simulate.plan(parse(*argv))


def test_the_command_reports_a_bad_option_without_a_traceback() -> None:
    with pytest.raises(SystemExit, match="slos-serve simulate: error: --same-window"):
        cli.main(["simulate", "--capacity", "--same-window", "--replicas", "4"])


def test_paper_table_excludes_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--paper-table", "--rate", "1")
    assert "--rate" in capsys.readouterr().err


def test_tiny_paper_table_writes_summary_table_and_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "paper.json", tmp_path / "paper.png"
    tiny = ("--duration", "2", "--rel-tol", "1", "--start-rate", "1", "--min-rate", "0.5")
    args = parse("--paper-table", *tiny, "--max-rate", "2", "--json", str(out), "--plot", str(png))
    assert simulate.run(args) == 0
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert set(summary["capacity"]) == {s.value for s in Scenario}
    for by_policy in summary["capacity"].values():
        assert set(by_policy) == {p.value for p in simulate.PAPER_POLICIES}
        assert all(set(by_n) == {"1"} for by_n in by_policy.values())
    assert {"capacity_ratio_geomean", "capacity_ratio", "capacity_ratio_vs_distserve"} <= set(
        summary
    )
    assert data["scenario_duration_s"] == {s.value: 2.0 for s in Scenario}
    assert data["timeline"]["scenario"] == "coder"
    assert set(data["timeline"]["policies"]) == {"slos", "vllm", "sarathi"}
    for name in ("attainment", "capacity", "timeline"):
        path = Path(data["plots"][name])
        assert path.parent == tmp_path and path.stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "| scenario | replicas | slos | vllm | sarathi | distserve |" in printed


def test_timeline_runs_at_slos_capacity_else_the_highest() -> None:
    capacity = {"coder": {"slos": {"1": 2.0}, "vllm": {"1": 3.0}}, "chatbot": {"vllm": {"1": 0.0}}}
    assert simulate.timeline_rate(capacity, Scenario.CODER, 1) == 2.0
    capacity["coder"]["slos"]["1"] = 0.0
    assert simulate.timeline_rate(capacity, Scenario.CODER, 1) == 3.0
    assert simulate.timeline_rate(capacity, Scenario.CHATBOT, 1) is None
