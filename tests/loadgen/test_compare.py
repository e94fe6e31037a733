"""`slos-serve compare`: options checked before any server starts, the configs read as Ray
Serve runs them, sarathi held to the workload's tightest TPOT, the summary's ratio, and one
end-to-end comparison of two shipped configs through the real front door."""

from __future__ import annotations

import argparse
import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import SchedulerKind
from loadgen import cli, compare, run_load
from loadgen.workloads import SLOTargets
from replica.profiles import load_profile
from tests.deploy.test_serve_run import free_port, with_ports

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "deploy" / f"serve-cpu{s}.yaml" for s in ("", "-vllm", "-sarathi")]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slos-serve compare")
    compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def configs_arg(*paths: Path) -> str:
    return ",".join(str(p) for p in paths)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--configs", configs_arg(*SHIPPED[:2]), "--target", "http://x:1"], "--target"),
        (["--configs", configs_arg(SHIPPED[0])], "two or more"),
        (["--configs", configs_arg(SHIPPED[0], Path("/nonexistent.yaml"))], "nonexistent"),
        (["--configs", configs_arg(SHIPPED[0], SHIPPED[0])], "file names must differ"),
        (["--configs", configs_arg(SHIPPED[2], SHIPPED[0]), "--zero-load", "probe"], "first"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--settle", "-1"], "--settle"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--startup-timeout", "0"], "--startup-timeout"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--rate", "0"], "--rate"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--capacity"], "--rates"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--plot", "/nonexistent/p.png"], "--plot"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--plot", "p.pnj"], "no 'pnj' files"),
        (["--configs", configs_arg(*SHIPPED[:2]), "--rounds", "0"], "--rounds"),
    ],
)
def test_bad_options_fail_before_any_server_starts(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", "--rate", "1", *argv])
    assert named in str(exc.value.code) + capsys.readouterr().err  # ours, or argparse's


def test_a_config_without_a_cluster_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"http_options": {"port": 1}, "applications": [{"args": {}}]}))
    with pytest.raises(ValueError, match=r"bad\.yaml.*applications\[0\]\.args\.cluster"):
        compare.ServeConfig.load(bad)
    wrong = tmp_path / "wrong.yaml"
    data = yaml.safe_load(SHIPPED[0].read_text())
    data["applications"][0]["args"]["cluster"]["scheduler"] = "fcfs"
    wrong.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"wrong\.yaml.*fcfs"):
        compare.ServeConfig.load(wrong)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", " is empty"),
        ("[1]", "the file must be a mapping, got list"),
        ("http_options: {port: 1}\napplications: []\n", "one application in applications, got 0"),
        ("http_options: {port: 1}\n", "one application in applications, got none"),
        ("applications: [{args: null}]\n", "has no applications[0].args"),
        ("applications: [{args: {cluster: {model: m, draft: d}}}]\n", "has no http_options"),
        (
            "http_options: {port: x}\napplications: [{args: {cluster: {model: m, draft: d}}}]\n",
            "http_options.port must be an integer, got 'x'",
        ),
    ],
)
def test_a_config_that_is_not_a_serve_config_is_named(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(
        ValueError, match=re.escape(f"--configs: '{path}'") + ".*" + re.escape(message)
    ):
        compare.ServeConfig.load(path)


def test_shipped_configs_are_read_as_serve_runs_them() -> None:
    slos, vllm, sarathi = (compare.ServeConfig.load(p) for p in SHIPPED)
    assert [c.cluster.scheduler for c in (slos, vllm, sarathi)] == list(SchedulerKind)
    assert slos.target("http") == "http://127.0.0.1:8000"
    assert slos.target("grpc") == "127.0.0.1:50051"
    assert slos.ports() == (("127.0.0.1", 8000), ("127.0.0.1", 50051))
    assert [c.label for c in (slos, vllm, sarathi)] == [p.stem for p in SHIPPED]


def test_sarathi_runs_with_tier_tpots_lowered_to_the_workloads_tightest() -> None:
    sarathi = compare.ServeConfig.load(SHIPPED[2])
    before = [t.tpot_ms for t in sarathi.cluster.tiers]
    lowered = sarathi.with_tpot_cap(300.0)["applications"][0]["args"]["cluster"]["tiers"]
    assert [t["tpot_ms"] for t in lowered] == [min(x, 300.0) for x in before]
    assert min(before) < 300.0 < max(before)  # the cap only lowers
    assert [t.tpot_ms for t in sarathi.cluster.tiers] == before  # the original is untouched


@pytest.mark.parametrize(("scenario", "level"), [("mixed", "tight"), ("chatbot", "loose")])
def test_the_workloads_tightest_tpot_is_its_tightest_slo_level(scenario: str, level: str) -> None:
    args = parse("--configs", configs_arg(*SHIPPED[:2]), "--rate", "2", "--scenario", scenario)
    perf = load_profile("--profile", args.profile)
    _, targets = run_load.zero_load_and_targets(args, perf, None)
    assert isinstance(targets, SLOTargets)
    expected = getattr(targets, f"{level}_tpot_ms")
    assert compare.workload_tightest_tpot_ms(args, None) == pytest.approx(expected)


def test_a_mix_files_tightest_tpot_caps_sarathi(tmp_path: Path) -> None:
    """With a mix file the cap is the tightest TPOT its classes ask for, absolute or a stage's."""
    mix = tmp_path / "mix.yaml"
    loose = "prompt: 20, output: 4, ttft: loose, tpot: loose"
    mix.write_text(
        "classes:\n"
        f"  - {{name: a, share: 1, {loose}}}\n"
        f"  - {{name: b, share: 1, {loose}, stages: [{{tokens: 3, tpot_ms: 7.5}}]}}\n"
    )
    args = parse("--configs", configs_arg(*SHIPPED[:2]), "--rate", "2", "--scenario", str(mix))
    assert compare.workload_tightest_tpot_ms(args, None) == pytest.approx(7.5)


def result(
    label: str, scheduler: str, capacity: float | None, replicas: int = 2, round_: int = 1
) -> dict[str, Any]:
    per_replica = None if capacity is None else capacity / replicas
    return {
        "label": label,
        "round": round_,
        "scheduler": scheduler,
        "summary": {"capacity_rps": capacity or 0.0, "capacity_per_replica": per_replica},
    }


def test_the_ratio_is_the_best_slos_config_over_the_best_baseline() -> None:
    results = [
        result("slos", "slos", 8.0),
        result("slos-nospec", "slos", 9.0),
        result("vllm", "vllm", 6.0),
        result("sarathi", "sarathi", 4.0),
    ]
    summary = compare.summarize(results)
    assert summary["capacity_per_replica"] == {
        "slos": 4.0,
        "slos-nospec": 4.5,
        "vllm": 3.0,
        "sarathi": 2.0,
    }
    assert summary["capacity_ratio"] == pytest.approx(1.5)
    no_baseline = compare.summarize([result("slos", "slos", 8.0), result("vllm", "vllm", 0.0)])
    assert no_baseline["capacity_ratio"] is None
    point = {"label": "a", "scheduler": "slos", "summary": {"attainment": 0.5}}
    assert compare.summarize([point]) == {"attainment": {"a": 0.5}}


def test_a_capacity_at_a_search_limit_is_listed_and_left_out_of_the_ratio() -> None:
    """Two configs that both passed the search's ceiling compared as 1.00x (metrics QA):
    a ratio to a limit compares the searches, not the schedulers."""
    ceiling = result("slos", "slos", 8.0)
    ceiling["summary"]["bound"] = {"at_least": 8.0}
    summary = compare.summarize([ceiling, result("vllm", "vllm", 8.0)])
    assert summary["capacity_per_replica"] == {"slos": 4.0, "vllm": 4.0}
    assert summary["capacity_ratio"] is None
    assert summary["capacity_bounds"] == {"slos": [{"at_least": 8.0}], "vllm": [None]}
    assert "capacity_bounds" not in compare.summarize([result("slos", "slos", 8.0)])


def test_rounds_summarize_by_median_with_every_rounds_ratio() -> None:
    rounds = [
        (1, {"slos": 10.0, "vllm": 12.0, "sarathi": 8.0}),
        (2, {"slos": 12.0, "vllm": 8.0, "sarathi": 8.0}),
        (3, {"slos": 11.0, "vllm": 10.0, "sarathi": 12.0}),
    ]
    results = [
        result(label, label, capacity, replicas=1, round_=n)
        for n, capacities in rounds
        for label, capacity in capacities.items()
    ]
    summary = compare.summarize(results)
    assert summary["capacity_per_replica"] == {"slos": 11.0, "vllm": 10.0, "sarathi": 8.0}
    assert summary["capacity_ratio"] == pytest.approx(1.1)  # medians: 11 over max(10, 8)
    assert summary["capacity_per_replica_by_round"]["vllm"] == [12.0, 8.0, 10.0]
    assert summary["capacity_ratio_by_round"] == pytest.approx([10 / 12, 12 / 8, 11 / 12])


def on_free_ports(source: Path, dest: Path) -> Path:
    data = with_ports(yaml.safe_load(source.read_text()), free_port(), free_port())
    dest.write_text(yaml.safe_dump(data))
    return dest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_shipped_configs_compared_through_the_front_door(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # serve run resolves the configs' model paths from here
    paths = [on_free_ports(SHIPPED[0], tmp_path / "slos.yaml")]
    paths.append(on_free_ports(SHIPPED[2], tmp_path / "sarathi.yaml"))
    out = tmp_path / "cmp.json"
    argv = ["compare", "--configs", configs_arg(*paths), "--rate", "2", "--duration", "3"]
    argv += ["--seed", "1", "--no-progress", "--request-timeout", "30", "--settle", "0"]
    assert cli.main([*argv, "--records", str(tmp_path / "rec.jsonl"), "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    slos, sarathi = document["configs"]
    assert (slos["label"], slos["scheduler"]) == ("slos", "slos")
    assert (sarathi["label"], sarathi["scheduler"]) == ("sarathi", "sarathi")
    args = parse("--configs", configs_arg(*paths), "--rate", "2", "--duration", "3")
    tightest = compare.workload_tightest_tpot_ms(args, None)
    assert sarathi["sarathi_tpot_ms"] == pytest.approx(tightest)
    for config in (slos, sarathi):
        assert config["summary"]["requests"] == 6
        assert (tmp_path / f"cmp.{config['label']}.serve.log").stat().st_size > 0
        assert len((tmp_path / f"rec.{config['label']}.jsonl").read_text().splitlines()) == 6
    assert set(document["summary"]["attainment"]) == {"slos", "sarathi"}
    for path in paths:  # both servers are gone
        port = yaml.safe_load(path.read_text())["http_options"]["port"]
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
