"""`slos-serve demo` (what `make serve` ran before the cluster): every scheduler serves the
prompts and the SLOs-Serve planner admits them at the demo's loose SLO."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from replica import demo
from replica.arguments import OptionError
from replica.perf_model import PerfModel
from replica.planner.base import Scheduler
from replica.planner.slos import SlosScheduler


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
    target_dir: Path, draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As simulate, loadgen and the benches do: a name in deploy/profiles, or a deploy
    config's short name. The no-draft profile, not the default, is what the planner gets."""
    drafts: list[str | None] = []
    make_scheduler = demo.make_scheduler

    def planned_with(*args: Any) -> Scheduler:
        made = make_scheduler(*args)
        assert isinstance(made, SlosScheduler) and isinstance(made.perf, PerfModel)
        drafts.append(made.perf.info.draft)
        return made

    monkeypatch.setattr(demo, "make_scheduler", planned_with)
    pair = ("--target", str(target_dir), "--draft", str(draft_dir))
    for name in ("cpu-demo-nodraft", "cpu-nodraft"):
        args = parse(*pair, "--profile", name, "--prompts", "1", "--max-tokens", "2")
        assert demo.run(args) == 0
    assert drafts == [None, None]  # the default profile's is demo-draft
    with pytest.raises(OptionError, match="--profile: profile 'cpu-dem' is neither a file"):
        demo.run(parse(*pair, "--profile", "cpu-dem", "--prompts", "1", "--max-tokens", "2"))


def test_demo_names_missing_models(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"--target: no model at .*make models"):
        demo.run(parse("--target", str(tmp_path)))
