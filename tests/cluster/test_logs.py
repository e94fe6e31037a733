"""The project's log lines reach stderr in a process nobody configured logging in (a Ray
worker's), at the level SLOS_SERVE_LOG_LEVEL names; a configured process keeps its setup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.logs import LOG_LEVEL_ENV, configure_logging

LOGS = """
import logging
from cluster.logs import configure_logging
configure_logging()
configure_logging()
logging.getLogger("cluster.controller").info("autoscaler: starting replica 1")
logging.getLogger("router.handle").warning("replica 0 is down")
logging.getLogger("cluster.controller").debug("a detail")
logging.getLogger("elsewhere").info("not ours")
"""


def _stderr(level: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    if level is not None:
        env[LOG_LEVEL_ENV] = level
    done = subprocess.run(
        [sys.executable, "-c", LOGS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_info_lines_reach_stderr_once_with_their_level_and_logger() -> None:
    lines = _stderr(None)
    assert [line.split(" ", 2)[2] for line in lines] == [
        "INFO cluster.controller -- autoscaler: starting replica 1",
        "WARNING router.handle -- replica 0 is down",
    ]


def test_the_level_comes_from_the_environment() -> None:
    assert [line.split(" ", 3)[3] for line in _stderr("warning")] == [
        "router.handle -- replica 0 is down"
    ]
    assert len(_stderr("DEBUG")) == 3


def test_a_level_logging_does_not_know_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match=r"SLOS_SERVE_LOG_LEVEL must be one of DEBUG, .*'loud'"):
        configure_logging()
