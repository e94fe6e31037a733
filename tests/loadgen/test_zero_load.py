"""Zero-load numbers: the fit, their file form, and how SLO levels derive from them or from a
profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadgen.run_load import probe_prompt_lens, zero_load_and_targets
from loadgen.workloads import SLOTargets, zero_load_decode_step_s, zero_load_ttft_from
from loadgen.zero_load import ZeroLoad, fit_zero_load
from replica.perf_model import PerfModel


def test_fit_recovers_a_line_and_the_median_step() -> None:
    lens = [10, 10, 80, 80, 200, 200]
    ttfts = [0.03 + 0.001 * n for n in lens]
    zero = fit_zero_load(lens, ttfts, [0.010, 0.012, 0.011, 0.5], "hand")
    assert zero.ttft_base_s == pytest.approx(0.03)
    assert zero.ttft_per_token_s == pytest.approx(0.001)
    assert zero.decode_step_s == pytest.approx(0.0115)
    assert zero.ttft_s(100) == pytest.approx(0.13)


def test_fit_never_gives_a_negative_slope() -> None:
    zero = fit_zero_load([10, 200], [0.2, 0.1], [0.01], "noisy")
    assert zero.ttft_per_token_s == 0.0 and zero.ttft_base_s == pytest.approx(0.15)


def test_load_reads_a_run_json_or_the_bare_object(tmp_path: Path) -> None:
    zero = ZeroLoad(0.03, 0.001, 0.01, "probe of x")
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"summary": {}, "zero_load": zero.to_dict()}))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(zero.to_dict()))
    assert ZeroLoad.load(run) == zero and ZeroLoad.load(bare) == zero


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("not json", "cannot read"),
        (json.dumps({"summary": {}}), "decode_step_s"),
        (json.dumps({"ttft_base_s": 0.1, "ttft_per_token_s": 0, "decode_step_s": 0}), "decode"),
        (json.dumps({"ttft_base_s": -1, "ttft_per_token_s": 0, "decode_step_s": 1}), "ttft_base"),
    ],
)
def test_bad_files_are_refused_naming_the_problem(tmp_path: Path, content: str, named: str) -> None:
    path = tmp_path / "zero.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=named):
        ZeroLoad.load(path)


def args(**overrides: object) -> argparse.Namespace:
    return argparse.Namespace(**{"length_scale": 0.1, "gpu_slos": False, **overrides})


def test_slo_levels_from_the_profile_scale_its_decode_step(tmp_path: Path) -> None:
    perf = PerfModel.synthetic({"const": 0.002, "tokens": 0.0001, "kv_tokens": 1e-6})
    ttft, targets = zero_load_and_targets(args(), perf, None)
    step = zero_load_decode_step_s(perf, 76)
    assert targets == SLOTargets.for_decode_step(step)
    assert targets.tight_tpot_ms == pytest.approx(3.3 * step * 1e3)
    assert targets.loose_tpot_ms == pytest.approx(6.6 * step * 1e3)
    assert ttft(50) == zero_load_ttft_from(perf)(50)
    _, gpu = zero_load_and_targets(args(gpu_slos=True), perf, None)
    assert (gpu.tight_tpot_ms, gpu.loose_tpot_ms) == (50.0, 100.0)


def test_slo_levels_from_measured_numbers() -> None:
    perf = PerfModel.synthetic({"const": 0.002, "tokens": 0.0001})
    zero = ZeroLoad(0.03, 0.001, 0.01, "probe")
    ttft, targets = zero_load_and_targets(args(), perf, zero)
    assert ttft(100) == pytest.approx(0.13)
    assert targets.tight_tpot_ms == pytest.approx(33.0)


def test_probe_lengths_scale_and_fit_the_context() -> None:
    assert probe_prompt_lens(0.1, None) == [10, 80, 200]
    assert probe_prompt_lens(1.0, 1024) == [100, 800, 1008]
    assert probe_prompt_lens(0.001, None) == [1, 2]
    assert probe_prompt_lens(1.0, 17) == [1]
    with pytest.raises(ValueError, match="16-token context leaves no room"):
        probe_prompt_lens(1.0, 16)
