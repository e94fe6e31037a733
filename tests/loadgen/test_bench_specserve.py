"""`slos-serve bench specserve --quick` runs end to end on the demo pair."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.cli import main


def test_quick_bench_measures_calibration_and_both_engines(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "specserve.json"
    argv = ["bench", "specserve", "--quick", "--threads", "1", "--repeats", "1"]
    argv += ["--target", str(target_dir), "--draft", str(draft_dir), "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    calibration = data["calibration"]
    bins = calibration["bins"]
    assert sum(b["judged"] for b in bins) == calibration["judged_drafts"] > 0
    assert all(0 <= b["acceptance"] <= 1 for b in bins)
    assert len(data["learned_chances"]) == 10
    for row in data["speed"]:
        for name in ("slos", "specserve"):
            assert row[name]["tok_s"] > 0
            assert 0 < row[name]["drafts_per_verify"] <= row["k"]
        assert row["specserve_over_slos"] == row["specserve"]["tok_s"] / row["slos"]["tok_s"]
    assert set(data["summary"]["specserve_over_slos"]) == {"b1_k4", "b4_k4"}
