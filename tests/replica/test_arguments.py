"""Command-line values refused as they are read, naming the option: numbers out of range, and
output files that could not be written at the end of a run (figures in a format matplotlib
does not write)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from replica.arguments import (
    fraction,
    model_length,
    non_negative_float,
    non_negative_int,
    output_file,
    plot_file,
    positive_float,
    positive_int,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slos-serve test", exit_on_error=False)
    p.add_argument("--count", type=positive_int)
    p.add_argument("--seed", type=non_negative_int)
    p.add_argument("--tick", type=positive_float)
    p.add_argument("--temperature", type=non_negative_float)
    p.add_argument("--holdout", type=fraction)
    p.add_argument("--json", type=output_file)
    p.add_argument("--plot", type=plot_file)
    p.add_argument("--max-model-len", type=model_length)
    return p


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "0"], "argument --count: must be an integer >= 1, got '0'"),
        (["--count", "1.5"], "argument --count: not an integer: '1.5'"),
        (["--tick", "fast"], "argument --tick: not a number: 'fast'"),
        (["--seed", "-1"], "argument --seed: must be an integer >= 0"),
        (["--tick", "nan"], "argument --tick: must be finite, got 'nan'"),
        (["--tick", "0"], "argument --tick: must be > 0"),
        (["--temperature", "-0.5"], "argument --temperature: must be >= 0"),
        (["--holdout", "1"], r"argument --holdout: must be in \(0, 1\)"),
        (["--max-model-len", "1"], "argument --max-model-len: must be an integer >= 2, got '1'"),
        (["--max-model-len", "-5"], "argument --max-model-len: must be an integer >= 2"),
    ],
)
def test_numbers_out_of_range_name_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=message):
        parser().parse_args(argv)


def test_an_output_file_is_tried_before_the_run(tmp_path: Path) -> None:
    p = parser()
    for bad, message in [
        (tmp_path, "is a directory"),
        (tmp_path / "none" / "x.json", "does not exist"),
        (Path("/proc/slos-serve.json"), "cannot write"),
    ]:
        with pytest.raises(argparse.ArgumentError, match=f"argument --json: .*{message}"):
            p.parse_args(["--json", str(bad)])
    fresh = tmp_path / "out.json"
    assert p.parse_args(["--json", str(fresh)]).json == fresh and not fresh.exists()
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    assert p.parse_args(["--json", str(kept)]).json == kept and kept.read_text() == "old"
    args = p.parse_args(["--count", "3", "--seed", "0", "--tick", "2.5", "--holdout", "0.25"])
    assert (args.count, args.seed, args.tick, args.holdout) == (3, 0, 2.5, 0.25)


def test_a_plot_is_refused_in_a_format_matplotlib_does_not_write(tmp_path: Path) -> None:
    p = parser()
    with pytest.raises(argparse.ArgumentError, match=r"argument --plot: .*cap.pnj.*'pnj' files"):
        p.parse_args(["--plot", str(tmp_path / "cap.pnj")])
    with pytest.raises(argparse.ArgumentError, match=r"argument --plot: .*does not exist"):
        p.parse_args(["--plot", str(tmp_path / "none" / "cap.png")])
    for name in ("cap.png", "cap.PDF", "cap.svg", "cap"):  # no suffix: matplotlib's PNG
        assert p.parse_args(["--plot", str(tmp_path / name)]).plot == tmp_path / name
    assert p.parse_args(["--max-model-len", "2"]).max_model_len == 2
