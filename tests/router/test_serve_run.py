"""`slos-serve serve` refuses what serve run would take for an import path (tests/deploy runs
it for real, and stops it with SIGTERM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.cli import main


def test_a_config_that_is_no_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "serve-cpu.yml"
    with pytest.raises(SystemExit, match=f"{missing} is not a file"):
        main(["serve", str(missing)])
