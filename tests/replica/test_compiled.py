"""The mypyc build of the planner: keyed by its sources, loaded only for them, and planning
exactly as the Python source does. The build itself is made by `make test` (`make compile`);
the tests that need it skip without one."""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replica import compiled
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget
from replica.planner.budget import BatchBudget

PROFILE = compiled.ROOT / "deploy" / "profiles" / "a100-40gb-opt-7b-tp1.json"
BUILD = compiled.build_dir(compiled.source_key())
needs_build = pytest.mark.skipif(
    not (BUILD / "complete").exists(), reason="no compiled planner for these sources: make compile"
)


def _copy_sources(root: Path) -> None:
    for module in compiled.MODULES:
        source = compiled.source_path(compiled.ROOT, module)
        target = compiled.source_path(root, module)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def test_key_follows_every_compiled_source(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    assert compiled.source_key(tmp_path) == compiled.source_key()
    keys = {compiled.source_key()}
    for module in compiled.MODULES:
        source = compiled.source_path(tmp_path, module)
        text = source.read_text()
        source.write_text(text + "\n")
        keys.add(compiled.source_key(tmp_path))
        source.write_text(text)
    assert len(keys) == len(compiled.MODULES) + 1


def _python(code: str, cache: Path, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "XDG_CACHE_HOME": str(cache), compiled.DISABLE_ENV: "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=compiled.ROOT,
    )
    return result.stdout.strip()


WHICH = "from replica import compiled; print(compiled.active())"


@needs_build
def test_the_build_loads_only_under_its_sources_key(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    builds = cache / "slos-serve" / "mypyc"
    shutil.copytree(BUILD, builds / BUILD.name)
    assert _python(WHICH, cache) == "True"
    assert _python(WHICH, cache, SLOS_SERVE_COMPILED="0") == "False"
    # Built from other sources (an edit since): the process runs the Python source.
    (builds / BUILD.name).rename(builds / ("0" * 20))
    assert _python(WHICH, cache) == "False"


@needs_build
def test_compiled_and_source_plan_the_same_simulation(tmp_path: Path) -> None:
    """Every batch of a short 2-replica simulation, as the JSON of its run reports it."""
    outputs = []
    for flag in ("1", "0"):
        out = tmp_path / f"run-{flag}.json"
        subprocess.run(
            [
                sys.executable, "-m", "loadgen.cli", "simulate", "--scenario", "mixed",
                "--replicas", "2", "--policies", "slos,vllm", "--rate", "3", "--duration", "20",
                "--json", str(out),
            ],
            env={**os.environ, "SLOS_SERVE_COMPILED": flag, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            timeout=300,
            check=True,
            cwd=compiled.ROOT,
        )  # fmt: skip
        outputs.append(json.loads(out.read_text()))
    fast, slow = outputs
    assert (fast["compiled_planner"], slow["compiled_planner"]) == (True, False)
    for run in (*fast["runs"], *slow["runs"]):
        del run["wall_s"]
    del fast["compiled_planner"], slow["compiled_planner"]
    assert fast == slow


def test_frozen_planner_types_copy_and_pickle_whole() -> None:
    """Under mypyc a frozen class is rebuilt through its constructor (`reduce_frozen`): the
    profile is pickled to worker processes; budgets and verdicts may cross processes too."""
    perf = PerfModel.load(PROFILE)
    budget = BatchBudget(0.05, 256, 8, 2048, 4096, 0.7, 4, 3, 8, min_spec_len=1)
    for value in (perf, perf.terms[0], CacheBudget(64, 16), budget):
        assert pickle.loads(pickle.dumps(value)) == value
        assert copy.deepcopy(value) == value
    assert pickle.loads(pickle.dumps(perf.terms[0])).nonzero == perf.terms[0].nonzero


def test_without_a_c_compiler_the_command_says_so_and_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compiled.run(argparse.Namespace()) == 0
    assert "no C compiler" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()


def test_prune_keeps_the_builds_made_or_asked_for_last(tmp_path: Path) -> None:
    for age, key in enumerate(["new", "recent", "old", "oldest", "ancient"]):
        marker = tmp_path / key / "complete"
        marker.parent.mkdir()
        marker.touch()
        os.utime(marker, (1e9 - age, 1e9 - age))
    (tmp_path / ".build-unfinished").mkdir()
    compiled.prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".build-unfinished",
        "new",
        "old",
        "recent",
    ]
