"""`slos-serve bench adaserve --quick` runs end to end on the demo pair."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.cli import main


def test_quick_bench_runs_chains_and_trees_side_by_side(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "adaserve.json"
    argv = ["bench", "adaserve", "--quick", "--threads", "1", "--repeats", "1"]
    argv += ["--target", str(target_dir), "--draft", str(draft_dir), "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    for row in data["speed"]:
        for name in ("chains", "trees"):
            assert row[name]["tok_s"] > 0
            assert 0 < row[name]["drafts_per_verify"] <= row["k"]
        assert set(row["learned_chances"]) == {"rank0", "rank1", "rank2"}
        if row["temperature"] == 0:
            assert row["rank_judged"][0] > 0 and 0 <= row["rank_acceptance"][0] <= 1
        assert sum(row["draw_acceptance"]) <= 1
    assert set(data["summary"]["trees_over_chains"]) == {"b1_k4_t0", "b4_k4_t0", "b4_k4_t1"}
    agreement = data["summary"]["rank_agreement"]
    assert len(agreement) == 4 and agreement[0] > 0 and sum(agreement) <= 1
    assert all(0 <= g <= 1 for g in data["summary"]["sibling_acceptance"])
