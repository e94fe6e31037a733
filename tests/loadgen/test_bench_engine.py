"""`slos-serve bench engine --quick` runs end to end and writes the documented JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.cli import main


def test_quick_bench_writes_summary_and_tables(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--quick", "--threads", "1", "--json", str(out)]
    argv += ["--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    summary = data["summary"]
    for key in (
        "decode_ratio_vs_hf_b32",
        "spec_speedup_b1",
        "spec_acceptance_b1",
        "spec_best_k_b1",
    ):
        assert key in summary
    assert summary["decode_ratio_vs_hf_b32"] > 0
    assert 0.0 <= summary["spec_acceptance_b1"] <= 1.0
    assert {r["proposer"] for r in data["spec"]} == {"none", "draft", "ngram"}
    assert {r["batch"] for r in data["throughput"]} == {r["batch"] for r in data["hf"]}
    for row in data["spec"]:
        assert abs(sum(row["time_split"].values()) - 1.0) < 1e-6
        assert row["tok_s"] > 0 and row["prefill_tok_s"] > 0
    by_dtype = summary["spec_b1_by_dtype"]["float32"]
    assert set(by_dtype) == {"none", "draft", "ngram"}
    assert by_dtype["none"]["k"] == 0 and by_dtype["none"]["speedup"] == 1.0
    for section, key in (("shaping", "shaped_over_plain"), ("structured", "structured_over_plain")):
        assert set(summary[key]) == {"none_b1", "draft_b1"}
        for row in data[section]:
            assert row["plain_tok_s"] > 0 and row["shaped_tok_s"] > 0
