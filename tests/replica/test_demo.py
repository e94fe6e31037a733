"""`slos-serve demo` (what `make serve` ran before the cluster): every scheduler serves the
prompts and the SLOs-Serve planner admits them at the demo's loose SLO."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from replica import demo
from replica.arguments import OptionError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("scheduler", ["slos", "sarathi", "vllm"])
def test_demo_serves_every_prompt(
    scheduler: str, target_dir: Path, draft_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(
        "--target", str(target_dir), "--draft", str(draft_dir), "--scheduler", scheduler,
        "--prompts", "3", "--max-tokens", "6", "--threads", "1",
    )  # fmt: skip
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("6 tokens, finish length") == 3
    assert "tokens/s" in out
    if scheduler == "slos":
        assert out.count(", admitted") == 3


def test_demo_refuses_a_profile_for_a_split_model() -> None:
    split = Path(demo.DEPLOY) / "profiles" / "cpu-demo-tp2.json"
    with pytest.raises(OptionError, match="--profile is for tensor parallelism 2"):
        demo.run(parse("--profile", str(split), "--prompts", "1", "--max-tokens", "2"))


def test_demo_takes_a_profile_by_name(
    target_dir: Path, draft_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As simulate, loadgen and the benches do: a name in deploy/profiles, or a deploy
    config's short name."""
    pair = ("--target", str(target_dir), "--draft", str(draft_dir))
    for name in ("cpu-demo", "cpu"):
        args = parse(*pair, "--profile", name, "--prompts", "1", "--max-tokens", "2")
        assert demo.run(args) == 0
    assert capsys.readouterr().out.count("scheduler slos") == 2
    with pytest.raises(OptionError, match="--profile: profile 'cpu-dem' is neither a file"):
        demo.run(parse(*pair, "--profile", "cpu-dem", "--prompts", "1", "--max-tokens", "2"))


def test_demo_names_missing_models(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"--target: no model at .*make models"):
        demo.run(parse("--target", str(tmp_path)))
