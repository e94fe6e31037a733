"""The planner and controller benchmarks run end to end and write their documented summary;
bad options of every bench end with one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen import cli
from replica import compiled


def run_bench(name: str, out: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    assert cli.main(["bench", name, "--quick", "--json", str(out), *extra]) == 0
    return dict(json.loads(out.read_text()))


def test_bench_planner_quick(tmp_path: Path) -> None:
    result = run_bench("planner", tmp_path / "planner.json")
    assert {"p50_ms", "p99_ms"} <= set(result["summary"])
    assert result["summary"]["p50_ms"] > 0
    assert len(result["cases"]) >= 1
    assert result["compiled_planner"] is compiled.active()


def test_bench_controller_quick_without_ray(tmp_path: Path) -> None:
    result = run_bench("controller", tmp_path / "controller.json", "--no-ray")
    assert result["summary"]["decisions_per_s"] > 0


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["bench", "planner", "--calls", "0"], "--calls"),
        (["bench", "frontend", "--rounds", "0"], "--rounds"),
        (["bench", "frontend", "--duration", "nan"], "--duration"),
        (["bench", "planner", "--json", "/proc/planner.json"], "--json"),
        (["bench", "controller", "--no-ray", "--rates", "0"], "--rates"),
    ],
)
def test_a_bad_option_ends_with_one_error_line(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused as the command line is read: no run, no Ray."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"slos-serve bench {argv[1]}: error: argument {option}:")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["engine", "--target", "/nonexistent"], "--target: no model at /nonexistent"),
        (["engine", "--draft", "/nonexistent"], "--draft: no model at /nonexistent"),
        (["specserve", "--target", "/nonexistent"], "--target: no model at /nonexistent"),
        (["adaserve", "--draft", "/nonexistent"], "--draft: no model at /nonexistent"),
        (["prefix", "--target", "/nonexistent"], "--target: no model at /nonexistent"),
    ],
)
def test_a_missing_model_ends_with_one_error_line(argv: list[str], message: str) -> None:
    """Named before anything loads, as `demo` and `profile` name theirs."""
    with pytest.raises(SystemExit, match=f"^slos-serve bench {argv[0]}: error: {message} "):
        cli.main(["bench", *argv, "--quick"])


@pytest.mark.parametrize("bench", ["specserve", "adaserve"])
def test_a_policy_bench_names_a_bad_profile_before_the_models(bench: str) -> None:
    """--profile takes a name as the other commands do, and one that is no profile is named
    first: the models, which are missing here, are not looked for."""
    with pytest.raises(
        SystemExit,
        match=f"^slos-serve bench {bench}: error: --profile: profile 'cpu-dmeo' is neither a "
        r"file nor one of .* \(did you mean 'cpu-demo'\?\)",
    ):
        cli.main(["bench", bench, "--quick", "--profile", "cpu-dmeo", "--target", "/nonexistent"])
