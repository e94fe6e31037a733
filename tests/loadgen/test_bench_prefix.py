"""`slos-serve bench prefix --quick` runs end to end on the demo pair."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.cli import main


def test_quick_bench_computes_the_shared_prefix_once(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "prefix.json"
    argv = ["bench", "prefix", "--quick", "--threads", "1", "--repeats", "1"]
    argv += ["--target", str(target_dir), "--draft", str(draft_dir), "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    # Three requests of 64 shared + 16 own tokens: without the cache all 240 are computed,
    # with it the first's 80 and the others' 16 each.
    assert data["off"]["prompt_tokens_computed"] == 240
    assert data["on"]["prompt_tokens_computed"] == 80 + 2 * 16
    assert data["summary"]["same_outputs"] is True
    assert data["on"]["median_ttft_s"] > 0 and data["off"]["decode_tok_s"] > 0
