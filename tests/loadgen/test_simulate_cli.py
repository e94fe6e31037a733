"""`slos-serve simulate` options: --paper-table, --ablation, errors naming the option, and one
tiny end-to-end paper table with its figures."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from cluster.simulator import Policy
from loadgen import cli, simulate
from loadgen.arrivals import trace_arrivals
from loadgen.traces import AZURE_ATTRIBUTION, load_trace
from loadgen.workloads import CPU_LOOSE_TPOT_FACTOR, CPU_TIGHT_TPOT_FACTOR, Scenario
from loadgen.zero_load import ZeroLoad
from replica.perf_info import Slowdown
from replica.perf_model import PerfModel
from replica.profiles import resolve_profile


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
    assert p.jobs == 1
    # Searches stop failing runs early unless --full-runs; a single --rate run never stops.
    assert p.stop_below == 0.9
    assert simulate.plan(parse("--capacity", "--full-runs")).stop_below is None
    assert simulate.plan(parse("--rate", "2")).stop_below is None
    assert simulate.plan(parse("--size-for", "2")).stop_below == 0.9
    assert simulate.plan(parse("--capacity", "--jobs", "0")).jobs >= 1  # one per CPU
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
        (("--capacity", "--same-window", "--replicas", "2"), "--same-window"),
        (("--capacity", "--replicas", "1,,2"), "--replicas: an empty item"),
        (("--capacity", "--policies", "vllm, vllm"), "--policies: 'vllm' repeats an earlier"),
        (("--capacity", "--policies", ""), "--policies is empty"),
        (("--rate", "1", "--rel-tol", "0.1"), "--rel-tol applies to a search"),
        (("--rate", "1", "--full-runs"), "--full-runs applies to a search"),
        (("--capacity", "--max-replicas", "3"), "--max-replicas applies to --size-for"),
        (("--rate", "1", "--timeline-scenario", "chatbot"), "give --plot"),
        (("--capacity", "--ablation", "--policies", "slos"), "--policies"),
        (("--capacity", "--policies", "slos,orca"), "--policies"),
        (("--capacity", "--scenario", "chat"), "--scenario"),
        (("--capacity", "--replicas", "1,0"), "--replicas"),
        (("--capacity", "--replicas", "two"), "--replicas"),
        (("--rate", "-1"), "--rate"),
        (("--capacity", "--rel-tol", "0"), "--rel-tol"),
        (("--capacity", "--rel-tol", "5"), "--rel-tol must be > 0 and <= 1 .*, got 5.0"),
        (("--capacity", "--rel-tol", "nan"), "--rel-tol must be > 0 and <= 1 .*, got nan"),
        (("--capacity", "--min-rate", "nan"), "--min-rate"),
        (("--capacity", "--min-rate", "2", "--max-rate", "1"), "--max-rate"),
        (
            ("--capacity", "--start-rate", "3", "--max-rate", "1.5"),
            r"--start-rate 3 lies outside the search's range \[--min-rate 0.001, --max-rate 1.5\]",
        ),
        (("--capacity", "--start-rate", "0.1", "--min-rate", "0.5"), "--start-rate 0.1 lies out"),
        (("--capacity", "--scenario", "chatbot", "--timeline-scenario", "coder"), "--timeline"),
        (("--rate", "1", "--replica-slowdown", "0"), "--replica-slowdown"),
        (("--rate", "1", "--replica-slowdown", "inf"), "--replica-slowdown"),
        (("--rate", "1", "--step-overhead-ms", "-1"), "--step-overhead-ms"),
        (("--rate", "1", "--length-scale", "0"), "--length-scale"),
        (("--rate", "1", "--zero-load", "/nonexistent/zero.json"), "--zero-load"),
        (("--capacity", "--jobs", "-1"), "--jobs"),
        (("--capacity", "--policies", "slos+prefix"), "slos\\+prefix .* give --prefix-caching"),
        (("--capacity", "--policies", "distserve", "--prefix-caching"), "--prefix-caching"),
        # Options the run would ignore.
        (("--rate", "1", "--no-prefix-credit"), "--no-prefix-credit applies to --prefix-caching"),
        (("--rate", "1", "--tree-width", "2"), r"--tree-width applies to --policies slos\+"),
        (("--capacity", "--ablation", "--tree-nodes", "3"), "--tree-nodes applies to"),
        (("--rate", "1", "--sibling-acceptance", "0.3"), "--sibling-acceptance applies to"),
    ],
)
def test_bad_options_are_named(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        simulate.plan(parse(*argv))


def test_kv_blocks_are_refused_where_the_profile_sets_the_cache() -> None:
    """A profile with kv_capacity_tokens sizes the cache itself: --kv-blocks would be
    ignored (it has a default, so only one the user gave is refused)."""
    with pytest.raises(SystemExit, match=r"--kv-blocks: the profile sets the KV cache itself"):
        cli.main(["simulate", "--rate", "1", "--profile", "a100-opt7b", "--kv-blocks", "4096"])
    a100 = PerfModel.load(resolve_profile("a100-opt7b"))
    assert simulate.kv_blocks(a100, None) == a100.info.assumptions["kv_capacity_tokens"] // 16
    cpu = PerfModel.load(resolve_profile("cpu-demo"))
    assert simulate.kv_blocks(cpu, None) == simulate.DEFAULT_KV_BLOCKS
    assert simulate.kv_blocks(cpu, 64) == 64


def test_the_command_reports_a_bad_option_without_a_traceback() -> None:
    with pytest.raises(SystemExit, match="slos-serve simulate: error: --same-window"):
        cli.main(["simulate", "--capacity", "--same-window", "--replicas", "4"])


def test_an_unknown_policy_is_answered_with_the_known_ones() -> None:
    known = r"'orca' is not a policy \(slos, slos-noroute, .*distserve\)"
    with pytest.raises(ValueError, match=known):
        simulate.plan(parse("--capacity", "--policies", "slos,orca"))


def test_a_bad_profile_is_named_without_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="slos-serve simulate: error: --baseline-profile"):
        cli.main(["simulate", "--rate", "1", "--baseline-profile", "no-such-gpu"])
    foreign = tmp_path / "foreign.json"
    foreign.write_text("{}")
    with pytest.raises(SystemExit, match="error: --profile: not a perf profile"):
        cli.main(["simulate", "--rate", "1", "--profile", str(foreign)])


def test_baseline_profile_of_another_tensor_parallel_degree_is_refused() -> None:
    with pytest.raises(SystemExit, match="--baseline-profile is for tensor parallelism 2"):
        cli.main(
            ["simulate", "--rate", "1", "--profile", "cpu", "--baseline-profile", "cpu-demo-tp2"]
        )


def test_distserve_on_a_profile_without_kv_bytes_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare.json"
    PerfModel.synthetic({"const": 0.01, "tokens": 0.001}).save(bare)
    argv = ["simulate", "--rate", "1", "--duration", "5", "--profile", str(bare)]
    with pytest.raises(SystemExit, match=r"--policies distserve: profile .* has no kv_bytes"):
        cli.main([*argv, "--policies", "slos,distserve"])
    assert "slos" not in capsys.readouterr().out  # no run printed before the refusal
    assert cli.main([*argv, "--policies", "slos,vllm"]) == 0


def test_a_live_runs_conditions_reach_the_setup(tmp_path: Path) -> None:
    """--zero-load, --length-scale, --baseline-profile and the slowdown replay a live CPU run:
    its measured SLOs and scaled lengths, the no-draft profile for the baselines, and replicas
    slower than the profiles the planners believe."""
    zero = tmp_path / "zero.json"
    zero.write_text(
        json.dumps(
            {"zero_load": {"ttft_base_s": 0.15, "ttft_per_token_s": 0.0, "decode_step_s": 0.008}}
        )
    )
    out = tmp_path / "cpu.json"
    args = parse(
        *("--rate", "1", "--duration", "3", "--scenario", "mixed", "--policies", "slos,vllm"),
        *("--profile", "cpu-demo", "--baseline-profile", "cpu-demo-nodraft"),
        *("--length-scale", "0.1", "--zero-load", str(zero), "--json", str(out)),
        *("--replica-slowdown", "3", "--step-overhead-ms", "5"),
    )
    p = simulate.plan(args)
    assert p.slowdown == Slowdown(3.0, 0.005) and p.length_scale == 0.1
    assert simulate.run(args) == 0
    data = json.loads(out.read_text())
    assert data["baseline_profile"] == "cpu-demo-nodraft"
    assert data["replica_slowdown"] == {"factor": 3.0, "overhead_s": 0.005}
    assert data["zero_load"]["decode_step_s"] == 0.008 and data["length_scale"] == 0.1
    assert {r["policy"] for r in data["runs"]} == {"slos", "vllm"}
    # Busy time per run; the work bound of the slowed no-draft replicas on these requests.
    for r in data["runs"]:
        assert 0 < r["utilization"] <= 1
        assert r["busy_ms_per_request"] == pytest.approx(1e3 * r["busy_s"] / 3)
    bound = data["work_bound"]["mixed"]["1"]
    nodraft_slow = PerfModel.load(resolve_profile("cpu-demo-nodraft")).slowed(Slowdown(3.0, 0.005))
    requests = simulate.Setup(
        nodraft_slow, Scenario.MIXED, "poisson", 3, 0, 1024, 0.01, 2,
        length_scale=0.1, zero_load=ZeroLoad.load(zero),
    ).workload(1.0, 1)  # fmt: skip
    least = nodraft_slow.least_work_seconds((r.prompt_len, r.output_len) for r in requests)
    assert bound["ms_per_request"] == pytest.approx(1e3 * least / 3)
    assert bound["rate_per_replica"] == pytest.approx(1e3 / bound["ms_per_request"])
    (vllm,) = (r for r in data["runs"] if r["policy"] == "vllm")
    assert vllm["busy_ms_per_request"] >= bound["ms_per_request"]

    cpu = PerfModel.load(resolve_profile("cpu-demo"))
    nodraft = PerfModel.load(resolve_profile("cpu-demo-nodraft"))
    setup = simulate.Setup(
        cpu, Scenario.MIXED, "poisson", 20, 0, 1024, 0.01, 2,
        baseline_perf=nodraft, length_scale=0.1, zero_load=ZeroLoad.load(zero),
    )  # fmt: skip
    assert setup.perf_for(Policy.SLOS) is cpu and setup.perf_for(Policy.SLOS_NOROUTE) is cpu
    for policy in (Policy.VLLM, Policy.SARATHI, Policy.DISTSERVE, Policy.SLOS_NOSPEC):
        assert setup.perf_for(policy) is nodraft
    scaled = setup.workload(1.0, 1)
    full = replace(setup, length_scale=1.0).workload(1.0, 1)
    assert sum(r.prompt_len for r in scaled) < sum(r.prompt_len for r in full) / 5
    tpots = sorted({r.slo.tpot_ms for r in scaled})
    assert tpots == pytest.approx([8 * CPU_TIGHT_TPOT_FACTOR, 8 * CPU_LOOSE_TPOT_FACTOR])
    assert {r.zero_load_ttft_s for r in scaled} == {0.15}
    # ToolLLM: later rounds add to a session's cost, not to the arrivals the rate counts.
    tool = replace(setup, scenario=Scenario.TOOLLLM, requests_per_replica=4)
    rounds = tool.workload(1.0, 2)
    least_ms, rate = tool.work_bound(2)
    assert len(rounds) > 8 and sum(r.follows is None for r in rounds) == 8
    assert rate == pytest.approx(8 / (least_ms * len(rounds) / 1e3))


def test_a_default_start_moves_into_the_range_given() -> None:
    p = simulate.plan(parse("--capacity", "--scenario", "chatbot", "--max-rate", "1.5"))
    assert p.start_rates == {Scenario.CHATBOT: 1.5}


def test_a_capacity_passed_on_a_backlog_is_flagged_not_sustained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA's case, tiny: 2 reasoning requests a point pass at every rate up to the ceiling, far
    above the work bound, because they are batched after both arrived."""
    out = tmp_path / "backlog.json"
    argv = ("--scenario", "reasoning", "--policies", "slos", "--capacity", "--duration", "10")
    argv += ("--start-rate", "0.2", "--max-rate", "0.8", "--rel-tol", "1", "--json", str(out))
    assert simulate.run(parse(*argv)) == 0
    data = json.loads(out.read_text())
    for run in data["runs"]:
        assert run["attainment"] >= 0.9
        assert run["backlog_s"] > 10 * run["arrival_window_s"] > 0
        assert run["sustained"] is False
    (search,) = data["capacity_searches"]
    assert search["capacity"] == 0.8 and search["sustained"] is False
    assert data["summary"]["capacity_bounds"] == {"reasoning": {"slos": {"1": {"at_least": 0.8}}}}
    printed = capsys.readouterr().out
    assert "| reasoning | 1 | >=0.80 |" in printed
    (warning,) = [line for line in printed.splitlines() if line.startswith("warning:")]
    assert warning.startswith(
        "warning: reasoning slos x1: capacity 0.8 req/s per replica is not sustained: its 2 "
        "requests arrived within 0.85 s"
    )
    assert warning.endswith("lengthen --duration for more requests per point")
    # Enough requests over the window: the backlog is short and the run sustained.
    steady = tmp_path / "steady.json"
    argv = ("--scenario", "chatbot", "--policies", "vllm", "--rate", "1", "--duration", "20")
    assert simulate.run(parse(*argv, "--json", str(steady))) == 0
    (run,) = json.loads(steady.read_text())["runs"]
    assert run["attainment"] >= 0.9 and run["sustained"] is True
    assert 0 < run["backlog_s"] < run["arrival_window_s"]
    assert "warning:" not in capsys.readouterr().out


def test_figures_credit_the_traces_their_arrivals_replay() -> None:
    azure = {"file": "AzureLLMInferenceTrace_code", "requests": 1, "attribution": AZURE_ATTRIBUTION}
    own = {"file": "ours", "requests": 10, "attribution": ""}
    both = {"traces": {"coder": azure, "chatbot": azure | {"file": "conv"}, "mine": own}}
    assert simulate._credit(both) == f"arrivals: {AZURE_ATTRIBUTION}"
    assert simulate._credit({"traces": {"mine": own}}) == ""
    assert simulate._credit({}) == ""
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    assert "its suffix picks the format" in " ".join(parser.format_help().split())


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
    assert "mixes" not in data  # only runs of mix files describe them
    assert data["timeline"]["scenario"] == "coder"
    assert set(data["timeline"]["policies"]) == {"slos", "vllm", "sarathi"}
    for name in ("attainment", "capacity", "timeline"):
        path = Path(data["plots"][name])
        assert path.parent == tmp_path and path.stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "| scenario | replicas | slos | vllm | sarathi | distserve |" in printed


def test_searches_in_worker_processes_give_the_same_results(tmp_path: Path) -> None:
    """Every run is deterministic, so --jobs changes how long the command takes, not what it
    writes: the runs in the same order, the same capacities (only `wall_s` differs)."""
    tiny = ("--capacity", "--scenario", "coder,chatbot", "--policies", "slos,vllm")
    tiny += ("--duration", "2", "--rel-tol", "1", "--start-rate", "1", "--max-rate", "2")
    outputs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        assert simulate.run(parse(*tiny, "--jobs", jobs, "--json", str(out))) == 0
        data = json.loads(out.read_text())
        for r in data["runs"]:
            del r["wall_s"]
        outputs.append(data)
    serial, parallel = outputs
    assert len(serial["capacity_searches"]) == 4 and len(serial["runs"]) >= 4
    assert parallel == serial


PARALLEL = [sys.executable, "-m", "loadgen.cli", "simulate", "--capacity", "--jobs", "2"]
"""`slos-serve simulate` searching in two worker processes, as a user starts it."""
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_searches_in_worker_processes_end_without_a_warning() -> None:
    """A run whose searches all finish lets its workers end on their own: terminated, they
    left "leaked semaphore objects" to the resource tracker's warning after the table."""
    command = [*PARALLEL, "--scenario", "coder", "--policies", "slos,vllm", "--duration", "20"]
    command += ["--rel-tol", "1"]
    out = subprocess.run(command, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| coder | 1 |" in out.stdout
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_ctrl_c_stops_searches_in_worker_processes_at_once() -> None:
    """Ctrl-C (SIGINT to the terminal's process group) ends `simulate --jobs 2` and its
    workers within seconds, saying so without a traceback, by the signal (so a shell loop
    around it stops too); it used to wait for every queued search, minutes here."""
    command = [*PARALLEL, "--scenario", "coder,chatbot", "--policies", "slos,vllm"]
    command += ["--duration", "3000"]
    proc = subprocess.Popen(
        command,
        env=ONE_THREAD,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        for _ in range(600):  # until both workers have started, leaving SIGINT to the command
            if len(workers := _pool_workers(proc.pid)) == 2 and all(map(_ignores_sigint, workers)):
                break
            time.sleep(0.1)
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == -signal.SIGINT
        assert not [w for w in workers if Path(f"/proc/{w}").exists()]
        assert proc.stderr is not None
        said = proc.stderr.read().decode()
        assert "slos-serve simulate: interrupted" in said and "Traceback" not in said, said
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _pool_workers(pid: int) -> list[str]:
    """The pool's worker processes among `pid`'s children (not multiprocessing's resource
    tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [c for c in children if b"spawn_main" in _cmdline(c)]


def _as_from_a_terminal() -> None:
    """SIGINT as a terminal leaves it: a test run in the background (a CI job started with
    `&`) ignores it, and so would the command, Python keeping an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignores_sigint(pid: str) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    ignored = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn"))
    return bool(int(ignored, 16) & (1 << (signal.SIGINT - 1)))


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def test_timeline_runs_at_slos_capacity_else_the_highest() -> None:
    capacity = {"coder": {"slos": {"1": 2.0}, "vllm": {"1": 3.0}}, "chatbot": {"vllm": {"1": 0.0}}}
    assert simulate.timeline_rate(capacity, Scenario.CODER, 1) == 2.0
    capacity["coder"]["slos"]["1"] = 0.0
    assert simulate.timeline_rate(capacity, Scenario.CODER, 1) == 3.0
    assert simulate.timeline_rate(capacity, Scenario.CHATBOT, 1) is None


def test_a_mix_file_runs_beside_the_scenarios(tmp_path: Path) -> None:
    """--scenario takes mix files (loadgen.mixes) in its list; the mix's name is its label in
    the plan and the JSON, and its classes are the report's SLO classes."""
    mix = tmp_path / "shop.yaml"
    chat = {"name": "chat", "share": 1, "prompt": {"mean": 300, "p99": 900}, "output": 40}
    search = {"name": "search", "share": 1, "prompt": 64, "output": 8}
    classes = [chat | {"ttft": "loose", "tpot": "loose"}, search | {"ttft_ms": 300, "tpot_ms": 60}]
    mix.write_text(yaml.safe_dump({"name": "shop", "classes": classes}))
    p = simulate.plan(
        parse(
            *("--capacity", "--scenario", f"{mix},chatbot", "--timeline-scenario", "shop"),
            *("--plot", str(tmp_path / "shop.png")),
        )
    )
    assert [s.value for s in p.scenarios] == ["shop", "chatbot"]
    assert p.start_rates[p.scenarios[0]] == simulate.MIX_START_RATE
    assert p.timeline_scenario is p.scenarios[0]
    with pytest.raises(ValueError, match=r"--scenario: .*shop\.yaml' repeats an earlier item"):
        simulate.plan(parse("--capacity", "--scenario", f"{mix},{mix}"))
    twin = tmp_path / "twin.yaml"  # another mix under the same name
    twin.write_text(yaml.safe_dump({"name": "shop", "classes": classes[:1]}))
    with pytest.raises(ValueError, match="--scenario: the workloads' names repeat"):
        simulate.plan(parse("--capacity", "--scenario", f"{mix},{twin}"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"classes": [chat | {"ttft": "loose"}]}))
    with pytest.raises(ValueError, match=r"--scenario: mix file .*bad.yaml: class 'chat': give"):
        simulate.plan(parse("--capacity", "--scenario", str(bad)))
    out = tmp_path / "out.json"
    point = ("--rate", "2", "--duration", "5", "--policies", "slos,vllm", "--json", str(out))
    assert simulate.run(parse("--scenario", str(mix), *point)) == 0
    data = json.loads(out.read_text())
    assert data["mixes"]["shop"]["classes"][1]["tpot_ms"] == 60.0  # the run says what it ran
    runs = data["runs"]
    assert [(r["scenario"], r["policy"]) for r in runs] == [("shop", "slos"), ("shop", "vllm")]
    assert set(runs[0]["report"]["by_slo_class"]) == {"chat", "search"}
    assert runs[0]["report"]["overall"]["requests"] == 10


def test_a_tpot_target_under_one_decode_step_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizing QA: a class whose TPOT target was just under the profile's decode step (14 ms
    against 15) made slos need over 64 replicas where vllm needed 4, its requests never
    admitted; nothing said why. Now the class is named before the runs."""
    mix = tmp_path / "fast.yaml"
    fast = {"name": "fast", "share": 1, "prompt": 64, "output": 8, "ttft_ms": 500, "tpot_ms": 10}
    chat = fast | {"name": "chat", "tpot_ms": 60}
    mix.write_text(yaml.safe_dump({"name": "fast", "classes": [fast, chat]}))
    point = ("--rate", "1", "--duration", "5", "--policies", "vllm")
    assert simulate.run(parse("--scenario", str(mix), *point)) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "class fast: a TPOT target of" in warnings[0]
    assert "serves such requests best-effort" in warnings[0]


def test_sizing_replays_the_same_requests_on_every_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--size-for searches the fewest replicas per policy for each total rate: every run of a
    search carries the same requests (the duration's worth at that rate), spread over its
    count."""
    out, png = tmp_path / "size.json", tmp_path / "size.png"
    argv = ("--size-for", "4.5,9", "--scenario", "chatbot", "--policies", "slos,vllm,distserve")
    argv += ("--duration", "6", "--max-replicas", "8", "--json", str(out), "--plot", str(png))
    assert simulate.plan(parse(*argv)).size_for == [4.5, 9.0]
    assert simulate.run(parse(*argv)) == 0
    data = json.loads(out.read_text())
    assert data["size_for"] == [4.5, 9.0] and data["requests"] == {"chatbot": {"4.5": 27, "9": 54}}
    for run in data["runs"]:
        total = run["total_rate"]
        assert run["rate_per_replica"] * run["replicas"] == pytest.approx(total)
        if run["stopped_early"]:  # a failing count, stopped once it could not pass
            assert run["report"] is None and run["attainment"] < 0.9
        else:
            assert run["report"]["overall"]["requests"] == round(6 * total)
    found: dict[str, dict[str, int]] = {}
    for rate, by_policy in data["sizing"]["chatbot"].items():
        fewest = data["work_bound"]["chatbot"][rate]["replicas"]
        assert fewest == math.ceil(
            float(rate) / data["work_bound"]["chatbot"][rate]["rate_per_replica"]
        )
        # Every search starts where the work bound says (distserve: at its 2 replicas at least).
        assert by_policy["slos"]["points"][0]["replicas"] == fewest
        assert by_policy["distserve"]["points"][0]["replicas"] == max(2, fewest)
        for policy, sized in by_policy.items():
            by_count = {pt["replicas"]: pt["attainment"] for pt in sized["points"]}
            n = sized["replicas"]
            assert n is not None and by_count[n] >= 0.9 and "monotone" not in sized
            failing = sized["largest_failing"]
            assert failing is None or (by_count[failing] < 0.9 and failing == n - 1)
            found.setdefault(rate, {})[policy] = n
    assert min(found["9"].values()) >= 2  # 9 req/s is too much for one replica
    assert found["4.5"]["distserve"] >= 2  # a prefill and a decode replica at least
    assert all(found["9"][p] >= found["4.5"][p] for p in found["9"])
    assert data["summary"]["replicas"] == {"chatbot": found}
    assert set(data["plots"]) == {"sizing", "replicas"}
    assert all(Path(where).stat().st_size > 5000 for where in data["plots"].values())
    printed = capsys.readouterr().out
    bound = data["work_bound"]["chatbot"]["9"]["replicas"]
    assert data["summary"]["work_bound_replicas"] == {
        "chatbot": {r: b["replicas"] for r, b in data["work_bound"]["chatbot"].items()}
    }
    assert f"| chatbot | 9 | {bound} | {found['9']['slos']} | {found['9']['vllm']} |" in printed


def test_sizing_compares_each_count_with_autoscalers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--autoscale replays each sizing's requests from the count found, the count left to
    each autoscaler: slo for slos policies only, ongoing:T for every policy."""
    out = tmp_path / "scaled.json"
    argv = ("--size-for", "9", "--scenario", "chatbot", "--policies", "slos,vllm")
    argv += ("--duration", "20", "--max-replicas", "6", "--autoscale", "slo,ongoing:4")
    argv += ("--replica-startup-s", "2", "--json", str(out))
    assert simulate.run(parse(*argv)) == 0
    data = json.loads(out.read_text())
    found = data["summary"]["replicas"]["chatbot"]["9"]
    assert data["autoscale"]["replica_startup_s"] == 2.0
    printed = capsys.readouterr().out
    runs = {(r["policy"], r["signal"]): r for r in data["autoscale"]["runs"]}
    assert set(runs) == {("slos", "slo"), ("slos", "ongoing:4"), ("vllm", "ongoing:4")}
    for (policy, scale_signal), run in runs.items():
        fixed = found[policy]
        assert run["fixed_replicas"] == fixed and run["total_rate"] == 9
        assert 0 <= run["attainment"] <= 1
        assert 1 <= run["mean_replicas"] <= 2 * fixed
        assert run["mean_replicas"] == pytest.approx(run["replica_s"] / run["simulated_s"])
        assert run["gpu_share_of_fixed"] == pytest.approx(run["mean_replicas"] / fixed)
        first = run["scaling"][0]
        assert first == [0.0, fixed, fixed]
        assert all(1 <= n <= 2 * fixed for _, n, _ in run["scaling"])
        summary = data["summary"]["autoscaled"]["chatbot"]["9"][policy][scale_signal]
        assert summary["attainment"] == run["attainment"]
        assert f"| chatbot | 9 | {policy} | {scale_signal} | {run['attainment']:.3f} |" in printed
    assert "warning" not in printed


def test_an_autoscaled_window_of_few_replica_starts_warns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Sizing QA: a 60 s window with 60 s replica starts showed the added replicas' time and
    no gain, and said nothing: they started as the arrivals ended."""
    argv = ("--size-for", "4", "--scenario", "chatbot", "--policies", "vllm", "--duration", "20")
    argv += ("--max-replicas", "2", "--autoscale", "ongoing:4", "--replica-startup-s", "5")
    assert simulate.run(parse(*argv)) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warnings == [
        "warning: chatbot: a replica the autoscaler adds serves 5 s after it is asked for, in a "
        "20 s window: what it adds late counts in the replicas it ran, with little left to "
        "serve (lengthen --duration)"
    ]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (("--rate", "4", "--autoscale", "slo"), "--autoscale compares with a fixed count"),
        (("--size-for", "4", "--replica-startup-s", "5"), "applies to --autoscale only"),
        (("--size-for", "4", "--autoscale", "ongoing"), "'ongoing' is not slo or ongoing:TARGET"),
        (("--size-for", "4", "--autoscale", "slo:3"), "'slo:3' is not slo or ongoing:TARGET"),
        *(
            (
                ("--size-for", "4", "--autoscale", f"ongoing:{target}"),
                f"'ongoing:{target}': the target must be a finite number > 0",
            )
            for target in ("0", "x", "inf", "nan")
        ),
        (("--size-for", "4", "--autoscale", "slo,slo"), "'slo' repeats an earlier item"),
        (
            ("--size-for", "4", "--autoscale", "slo", "--policies", "vllm,sarathi"),
            "--autoscale slo follows admission's declines, and none of --policies declines",
        ),
        (
            ("--size-for", "4", "--autoscale", "slo", "--replica-startup-s", "-1"),
            "--replica-startup-s must be >= 0",
        ),
        (
            ("--size-for", "4", "--autoscale", "ongoing:4", "--policies", "slos,distserve"),
            "distserve's pools are simulated at a fixed size",
        ),
    ],
)
def test_bad_autoscale_options_are_named(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        simulate.plan(parse(*argv))


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (("--size-for", "4", "--replicas", "2"), "drop --replicas"),
        (("--size-for", "4", "--same-window"), "drop --same-window"),
        (("--size-for", "0"), "--size-for: '0' is not a rate > 0"),
        (("--size-for", "4,x"), "--size-for: 'x' is not a rate > 0"),
        (("--size-for", ","), "--size-for is empty"),
        (("--size-for", "4", "--max-replicas", "0"), "--max-replicas must be >= 1"),
    ],
)
def test_bad_sizing_options_are_named(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        simulate.plan(parse(*argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--seed", "-1"), "argument --seed: must be an integer >= 0"),
        (("--tick-ms", "0"), "argument --tick-ms: must be > 0"),
        (("--kv-blocks", "0"), "argument --kv-blocks: must be an integer >= 1"),
        (("--route-limit", "0"), "argument --route-limit: must be an integer >= 1"),
        (("--json", "/proc/slos-serve-sim.json"), "argument --json: cannot write"),
        (("--plot", "/nonexistent/p.png"), "argument --plot: directory '/nonexistent'"),
        (("--plot", "cap.pnj"), "argument --plot: 'cap.pnj': matplotlib writes no 'pnj' files"),
    ],
)
def test_bad_run_options_are_refused_before_any_run(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--rate", "1", "--duration", "5", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "mode", [("--rate", "1"), ("--size-for", "2", "--max-replicas", "2")], ids=["rate", "sizing"]
)
def test_the_results_are_written_before_the_figures_are_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: tuple[str, ...]
) -> None:
    """A figure that fails to draw loses none of the runs' results."""

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("no figure")

    monkeypatch.setattr(simulate, "plot_attainment", broken)
    monkeypatch.setattr(simulate, "plot_sizing", broken)
    out = tmp_path / "r.json"
    argv = (*mode, "--duration", "3", "--policies", "vllm", "--json", str(out))
    with pytest.raises(RuntimeError, match="no figure"):
        simulate.run(parse(*argv, "--plot", str(tmp_path / "r.png")))
    data = json.loads(out.read_text())
    assert data["runs"] and "plots" not in data


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--scenario", "reasoning", "--length-scale", "4"),
            r"--scenario reasoning: request reasoning-\d+ needs \d+ KV blocks at its longest "
            r"\(prompt \d+ \+ max_tokens 42474\), more than a replica's 2278 \(the profile's "
            r"kv_capacity_tokens\): lower --length-scale$",
        ),
        (
            ("--profile", "cpu-demo", "--kv-blocks", "1"),
            r"--scenario chatbot: .*more than a replica's 1 \(--kv-blocks\): lower "
            r"--length-scale or raise --kv-blocks to \d+$",
        ),
        (
            ("--scenario", "long.yaml"),
            r"--scenario long: class 'essay': request essay-\d+ needs 2500 KV blocks .*: "
            r"shorten the class's prompt or max_tokens or lower --length-scale$",
        ),
        (
            ("--scenario", "huge.yaml"),
            r"--scenario huge: class 'novel': slo.ttft_ms must be <= 8.64e\+07",
        ),
    ],
)
@pytest.mark.parametrize("mode", [("--rate", "0.5"), ("--capacity",), ("--size-for", "1")])
def test_a_workload_the_kv_cache_cannot_hold_is_refused_before_any_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    message: str,
    mode: tuple[str, ...],
) -> None:
    """Its longest request (or a mix class whose SLO cannot be set) would raise mid-run in a
    planner: the error says what to change instead."""
    chat = {"name": "chat", "share": 1, "prompt": 100, "output": 10, "ttft": "loose"}
    essay = {"name": "essay", "share": 1, "prompt": 30000, "output": 10000, "ttft_ms": 1e6}
    novel = {"name": "novel", "share": 1, "prompt": 10_000_000, "output": 10, "ttft": "loose"}
    for name, other in (("long", essay), ("huge", novel)):
        classes = [chat | {"tpot": "loose"}, other | {"tpot": "loose"}]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "classes": classes}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=f"^slos-serve simulate: error: {message}"):
        cli.main(["simulate", *mode, "--duration", "20", "--policies", "vllm", *argv])
    assert "attain" not in capsys.readouterr().out  # no run's header, nor a run


def test_trace_arrivals_replay_a_trace_of_your_own(tmp_path: Path) -> None:
    """--trace replays any CSV in the Azure format for every scenario; the JSON says which
    trace each workload replayed, with its attribution (none for a log of your own)."""
    own = tmp_path / "ours.csv"
    stamps = [0.0, 0.1, 0.2, 0.3, 5.0, 5.1, 9.0, 9.05, 9.1, 12.0]  # bursts and lulls
    own.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2024-01-01 00:00:{t:09.6f},100,10\n" for t in stamps)
    )
    out = tmp_path / "own.json"
    argv = ("--rate", "2", "--duration", "4", "--scenario", "chatbot", "--policies", "vllm")
    argv += ("--arrivals", "trace", "--trace", str(own), "--json", str(out))
    p = simulate.plan(parse(*argv))
    assert p.trace == own.resolve()
    assert simulate.run(parse(*argv)) == 0
    data = json.loads(out.read_text())
    assert data["traces"] == {"chatbot": {"file": "ours", "requests": 10, "attribution": ""}}
    perf = PerfModel.load(resolve_profile("a100-40gb-opt-7b-tp1"))
    setup = simulate.Setup(perf, Scenario.CHATBOT, "trace", 8, 0, 2048, 0.01, 2, trace=p.trace)
    times = [r.arrival_s for r in setup.workload(2.0, 1)]
    expected = [r.time_s for r in trace_arrivals(load_trace(own), 2.0, 8, 0)]
    assert times == pytest.approx(expected)
    azure = replace(setup, trace=None).workload(2.0, 1)
    assert [r.arrival_s for r in azure] != pytest.approx(expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--trace", "x.csv"), "--trace applies to --arrivals trace only, not poisson"),
        (("--arrivals", "trace", "--trace", "/nonexistent/x.csv"), "--trace: trace file"),
    ],
)
def test_bad_trace_options_are_named(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate.plan(parse("--rate", "1", *argv))


def test_acceptance_options_and_the_seed_policies_reach_the_runs(tmp_path: Path) -> None:
    out = tmp_path / "seed.json"
    args = parse(
        *("--rate", "1", "--duration", "4", "--scenario", "chatbot"),
        *("--policies", "slos,slos+goodspeed,slos+laps"),
        *("--acceptance", "0.8", "--acceptance-spread", "0.2", "--json", str(out)),
    )
    assert simulate.run(args) == 0
    data = json.loads(out.read_text())
    assert (data["acceptance"], data["acceptance_spread"]) == (0.8, 0.2)
    assert [r["policy"] for r in data["runs"]] == ["slos", "slos+goodspeed", "slos+laps"]
    for run in data["runs"]:
        verdicts = run["report"]["by_verdict"]
        assert verdicts and all("mean" in v["e2e_s"] for v in verdicts.values())
    setup = simulate.Setup(
        PerfModel.load(resolve_profile("a100-opt7b")), Scenario.CHATBOT, "poisson", 4,
        0, 1024, 0.01, 2, acceptance=0.8, acceptance_spread=0.2,
    )  # fmt: skip
    config = setup.config(Policy.SLOS_GOODSPEED, 1)
    assert (config.acceptance, config.acceptance_spread) == (0.8, 0.2)


@pytest.mark.parametrize(
    ("value", "why"),
    [("1.5", "must be in [0, 1]"), ("-0.1", "must be in [0, 1]"), ("nan", "must be finite")],
)
def test_acceptance_options_outside_zero_to_one_are_refused(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for option in ("--acceptance", "--acceptance-spread"):
        with pytest.raises(SystemExit):
            cli.main(["simulate", "--rate", "1", option, value])
        assert f"argument {option}: {why}, got '{value}'" in capsys.readouterr().err


def test_specserve_needs_draft_confidences_and_reports_its_speculation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"slos\+specserve .* give --draft-confidence"):
        simulate.plan(parse("--rate", "1", "--policies", "slos,slos+specserve"))
    with pytest.raises(
        ValueError, match=r"--draft-confidence must be in \[0.001, 1e6\], got 2000000.0"
    ):
        simulate.plan(parse("--rate", "1", "--draft-confidence", "2e6"))
    out = tmp_path / "specserve.json"
    args = parse(
        *("--rate", "2", "--duration", "6", "--scenario", "chatbot"),
        *("--policies", "slos,slos+specserve,vllm", "--draft-confidence", "2"),
        *("--json", str(out)),
    )
    assert simulate.run(args) == 0
    data = json.loads(out.read_text())
    assert data["draft_confidence"] == 2.0
    runs = {r["policy"]: r for r in data["runs"]}
    assert runs["vllm"]["drafts_per_decode"] == 0.0 and runs["vllm"]["draft_acceptance"] is None
    for policy in ("slos", "slos+specserve"):
        assert runs[policy]["drafts_per_decode"] > 0
        assert 0 < runs[policy]["draft_acceptance"] <= 1


def test_tree_constants_reach_slos_adaserve(tmp_path: Path) -> None:
    out = tmp_path / "trees.json"
    argv = ("--rate", "2", "--duration", "5", "--policies", "slos+adaserve")
    argv += ("--tree-width", "2", "--tree-nodes", "3", "--json", str(out))
    assert simulate.run(parse(*argv)) == 0
    data = json.loads(out.read_text())
    assert data["adaserve"] == {"max_width": 2, "max_nodes": 3}
    (run,) = data["runs"]
    assert 0 < run["drafts_per_decode"] <= 3


def test_prefix_caching_runs_and_reports_the_tokens_found_cached(tmp_path: Path) -> None:
    """Agent sessions that send their history back: with --prefix-caching the replicas
    found part of each prompt cached, slos+prefix more of it than round robin."""
    out = tmp_path / "prefix.json"
    mix = Path(simulate.__file__).parent / "mix-examples" / "agents.yaml"
    argv = ("--scenario", str(mix), "--rate", "0.5", "--duration", "10", "--replicas", "2")
    argv += ("--policies", "slos,slos+prefix,vllm", "--prefix-caching", "--json", str(out))
    assert simulate.run(parse(*argv, "--profile", "h100-80gb-llama-31-8b-tp1")) == 0
    data = json.loads(out.read_text())
    assert data["prefix_caching"] is True
    rates = {r["policy"]: r["prefix_hit_rate"] for r in data["runs"]}
    assert 0 < rates["slos"] < rates["slos+prefix"] < 1 and 0 < rates["vllm"] < 1
    # slos's controller counted prefixes its replicas had computed as done, and found them.
    assert data["credit_prefixes"] is True
    missed = {r["policy"]: r["prefix_credit_missed"] for r in data["runs"]}
    assert missed == {"slos": 0.0, "slos+prefix": 0.0, "vllm": None}
