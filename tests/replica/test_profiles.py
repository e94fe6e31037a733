"""Perf profiles by name, path or a deploy config's short name; a broken one is named with the
option that gave it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from replica.arguments import OptionError
from replica.profiles import DEPLOY, load_profile, resolve_profile


def test_short_profile_names_are_the_deploy_configs_profiles() -> None:
    """`a100-opt7b` (the issue's and the deploy config's name) is the paper's A100-40GB setup, and
    every short name is the profile its `serve-<name>.yaml` serves with."""
    assert resolve_profile("a100-opt7b").stem == "a100-40gb-opt-7b-tp1"
    assert resolve_profile("a100-opt7b.json").stem == "a100-40gb-opt-7b-tp1"
    configs = sorted(DEPLOY.glob("serve-*.yaml"))
    assert len(configs) >= 3
    for config in configs:
        (app,) = yaml.safe_load(config.read_text())["applications"]
        short = config.stem.removeprefix("serve-")
        assert resolve_profile(short) == DEPLOY.parent / app["args"]["cluster"]["profile"]
    with pytest.raises(ValueError, match="did you mean 'a100-opt7b'"):
        resolve_profile("a100-opt-7b")


def test_a_broken_profile_is_named_with_its_option(tmp_path: Path) -> None:
    termless = tmp_path / "termless.json"
    data = json.loads(resolve_profile("cpu-demo").read_text())
    del data["terms"]
    termless.write_text(json.dumps(data))
    with pytest.raises(OptionError, match=r"^--profile: not a perf profile: it has no terms$"):
        load_profile("--profile", str(termless))
    with pytest.raises(OptionError, match=r"^--baseline-profile: profile 'gpu' is neither"):
        load_profile("--baseline-profile", "gpu")
    assert load_profile("--profile", "cpu-demo").info.model
