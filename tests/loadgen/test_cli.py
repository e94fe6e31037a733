"""The `slos-serve` command: help and version work without loading torch or Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadgen import cli


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadgen.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_version_prints_package_version() -> None:
    out = run_cli("version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"slos-serve {cli.package_version()}"
    assert cli.package_version() != "unknown"


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for name in ("version", "demo", "profile", "bench"):
        assert name in out.stdout


def test_version_does_not_import_torch() -> None:
    code = (
        "import sys; from loadgen import cli; cli.main(['version']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout


def test_unknown_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2
    assert "frobnicate" in capsys.readouterr().err


def test_version_takes_no_arguments() -> None:
    with pytest.raises(SystemExit):
        cli.main(["version", "--bogus"])
