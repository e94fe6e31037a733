from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replica.engine import Engine
from replica.perf_fit import Sample, fit_profile
from replica.perf_model import BatchShape, PerfModel
from replica.profiler import (
    GridPoint,
    add_arguments,
    default_grid,
    plot_fit,
    profile_engine,
    quick_grid,
    run,
    spread,
)

TINY_GRID = [
    GridPoint(prefills=((8, 0),)),
    GridPoint(prefills=((4, 12),)),
    GridPoint(decodes=(5, 9)),
    GridPoint(decodes=(6,), prefills=((3, 0),)),
    GridPoint(decodes=(7, 7), spec_tokens=2),
]


@pytest.fixture(scope="module")
def engine(target_dir: Path, draft_dir: Path) -> Engine:
    return Engine.from_dirs(target_dir, draft_dir, num_blocks=64)


def test_profile_engine_times_the_requested_shapes(engine: Engine) -> None:
    torch.set_num_threads(1)
    samples = profile_engine(engine, TINY_GRID, repeats=1, passes=2, clock="cpu", progress=False)
    assert len(samples) == len(TINY_GRID)
    assert all(math.isfinite(s.seconds) and s.seconds > 0 for s in samples)
    prefill, on_context, decodes, mixed, speculative = (s.features for s in samples)
    assert (prefill.num_tokens, prefill.num_requests, prefill.attn_tokens) == (8, 1, 36)
    assert (on_context.num_tokens, on_context.kv_tokens) == (4, 16)
    assert (decodes.num_tokens, decodes.num_requests) == (2, 2)
    assert decodes.kv_tokens >= 5 + 9 + 2
    assert (mixed.num_tokens, mixed.num_requests) == (4, 2)
    assert speculative.draft_steps == 2 and speculative.draft_batch == 2
    assert speculative.num_tokens == 6
    assert engine.num_free_blocks == 64, "every profiling request must be released"


def test_profile_engine_refuses_what_the_engine_cannot_run(target_dir: Path) -> None:
    plain = Engine.from_dirs(target_dir, num_blocks=16)
    with pytest.raises(ValueError, match="no draft model"):
        profile_engine(plain, [GridPoint(decodes=(4,), spec_tokens=1)], progress=False)
    with pytest.raises(ValueError, match="exceeds the model context"):
        profile_engine(plain, [GridPoint(prefills=((8, plain.max_model_len),))], progress=False)
    with pytest.raises(ValueError, match="passes must be >= 1"):
        profile_engine(plain, [GridPoint(prefills=((8, 0),))], passes=0, progress=False)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_engine(plain, [GridPoint(prefills=((8, 0),))], repeats=0, progress=False)
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="use it with 1 torch thread"):
        profile_engine(plain, [GridPoint(prefills=((8, 0),))], clock="cpu", progress=False)


def test_grid_points_validate() -> None:
    with pytest.raises(ValueError, match="at least one prefill or decode"):
        GridPoint()
    with pytest.raises(ValueError, match="needs decodes"):
        GridPoint(prefills=((4, 0),), spec_tokens=2)
    with pytest.raises(ValueError, match="decode contexts must be >= 1"):
        GridPoint(decodes=(0,))


def test_spread_contexts_around_the_mean() -> None:
    assert spread(100, 1) == (100,)
    contexts = spread(100, 5)
    assert contexts == (50, 75, 100, 125, 150)
    assert len(set(spread(8, 4))) == 4


def test_grids_cover_every_batch_kind() -> None:
    for grid in (default_grid(speculative=True), quick_grid(speculative=True)):
        assert any(p.prefills and not p.decodes for p in grid)
        assert any(p.decodes and not p.prefills and not p.spec_tokens for p in grid)
        assert any(p.decodes and p.prefills for p in grid)
        assert any(p.spec_tokens for p in grid)
    assert not any(p.spec_tokens for p in default_grid(speculative=False))
    assert all(p.longest() <= 512 for p in default_grid(speculative=True, max_len=512))
    assert all(p.kv_tokens() <= 4096 for p in default_grid(speculative=True, max_kv_tokens=4096))


def test_cli_writes_a_measured_profile(target_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "profile.json"
    args = parser.parse_args(
        [
            "--model",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--out",
            str(out),
            "--quick",
            "--repeats",
            "1",
            "--passes",
            "1",
            "--no-progress",
            "--note",
            "smoke run",
        ]
    )
    assert run(args) == 0
    data = json.loads(out.read_text())
    assert data["source"] == "measured"
    assert math.isfinite(data["r2"]) and math.isfinite(data["mape"])
    assert data["fit"]["num_test"] >= 1
    model = PerfModel.load(out)
    assert model.info.draft == draft_dir.name
    assert model.info.notes[-1] == "smoke run"
    assert len(data["fit"]["samples"]) == len(quick_grid(speculative=True))
    # 6 layers x K and V x 4 KV heads x 32 dims x 4 bytes
    assert data["assumptions"] == {"kv_bytes_per_token_per_gpu": 6144}


def test_cli_names_a_missing_gpu_and_a_clock_blind_to_it(target_dir: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(target_dir), "--out", str(tmp_path / "p.json"), "--quick"]
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="the cpu clock does not see time spent on a GPU"):
            run(parser.parse_args([*base, "--device", "cuda", "--clock", "cpu"]))
    else:
        with pytest.raises(SystemExit, match="--device cuda, but torch in this process sees no"):
            run(parser.parse_args([*base, "--device", "cuda"]))


def test_cli_refuses_a_plot_it_could_not_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the profile is measured, not when its figure is drawn."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--out", str(tmp_path / "p.json"), "--plot", "fit.pnj"])
    assert "argument --plot: 'fit.pnj': matplotlib writes no 'pnj' files" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]


def test_cli_profiles_a_target_split_over_two_processes(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tp2.json"
    command = [sys.executable, "-m", "loadgen.cli", "profile", "--model", str(target_dir)]
    command += ["--draft", str(draft_dir), "--out", str(out), "--tensor-parallel", "2"]
    command += ["--clock", "wall", "--quick", "--repeats", "3", "--passes", "2", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model = PerfModel.load(out)
    assert model.info.tp == 2
    assert model.info.assumptions == {"kv_bytes_per_token_per_gpu": 3072}  # one rank's heads
    assert len(model.info.fit["samples"]) == len(quick_grid(speculative=True))


def test_cli_refuses_a_split_it_cannot_time_or_make(target_dir: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(target_dir), "--out", str(tmp_path / "p.json"), "--quick"]
    with pytest.raises(SystemExit, match="the cpu clock sees this process only"):
        run(parser.parse_args([*base, "--tensor-parallel", "2"]))
    with pytest.raises(SystemExit, match=r"tensor parallelism over 3 needs num_heads \(8\)"):
        run(parser.parse_args([*base, "--tensor-parallel", "3", "--clock", "wall"]))
    with pytest.raises(SystemExit, match="--draft: "):
        run(parser.parse_args([*base, "--draft", str(tmp_path / "none"), "--clock", "wall"]))
    assert not (tmp_path / "p.json").exists()


WATCHED = """
import multiprocessing, sys, time
from replica.profiler import _exit_if_a_rank_fails
if __name__ == "__main__":
    ranks = [multiprocessing.Process(target=time.sleep, args=(3,), name="rank 1"),
             multiprocessing.Process(target=sys.exit, args=(3,), name="rank 2")]
    for rank in ranks:
        rank.start()
    _exit_if_a_rank_fails(ranks)
    print("not reached")
"""


def test_a_rank_that_dies_ends_the_profile_naming_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WATCHED], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "rank 2 exited with code 3" in done.stderr
    assert "not reached" not in done.stdout


def test_plot_fit_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    samples = [
        Sample(BatchShape((n,), (c,)).features(), 0.002 + 1e-5 * n + 1e-8 * n * c)
        for n in (1, 8, 64, 256)
        for c in (0, 100, 1000)
    ]
    model = fit_profile(samples, backend="test", device="cpu", model="toy")
    path = tmp_path / "fit.png"
    plot_fit(model, samples, path)
    assert path.read_bytes().startswith(b"\x89PNG")
