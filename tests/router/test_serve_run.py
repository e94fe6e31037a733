"""`slos-serve serve` refuses what serve run would take for an import path, and ends in one
line when Ray does not start (tests/deploy runs it for real, and stops it with SIGTERM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray._private.node import Node

from loadgen.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "deploy" / "serve-cpu.yaml")
TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class HalfStarted(Node):
    """A head node whose raylet never registered: Node.__init__'s own timeout."""

    def __init__(self) -> None:
        raise Exception(TIMEOUT)


def test_a_config_that_is_no_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "serve-cpu.yml"
    with pytest.raises(SystemExit, match=f"{missing} is not a file"):
        main(["serve", str(missing)])


@pytest.mark.parametrize(
    ("address", "failure"),
    [
        ("local", Exception(TIMEOUT)),
        ("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster at\n10.0.0.1:6379")),
    ],
)
def test_a_ray_that_does_not_start_ends_it_with_one_line_and_exit_code_1(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    address: str,
    failure: Exception,
) -> None:
    """ray.init's failure ended it with a traceback, on a loaded machine 4 starts of 5."""

    def init(**kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(ray, "init", init)
    assert main(["serve", CONFIG, "--address", address]) == 1
    reason = " ".join(str(failure).split())
    assert [(r.getMessage(), r.exc_info) for r in caplog.records] == [
        (f"Ray did not start or could not be reached: {reason}", None)
    ]


def test_a_ray_that_does_not_start_stops_the_processes_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ray.init drops the node it was starting, whose raylet's agents outlived the process."""
    stopped: list[dict[str, bool]] = []

    def kill_all_processes(self: Node, **kwargs: bool) -> None:
        stopped.append(kwargs)

    def init(**kwargs: object) -> None:
        HalfStarted()

    monkeypatch.setattr(Node, "kill_all_processes", kill_all_processes)
    monkeypatch.setattr(ray, "init", init)
    assert main(["serve", CONFIG, "--address", "local"]) == 1
    assert stopped == [{"check_alive": False, "allow_graceful": True}]
