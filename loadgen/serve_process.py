"""A Ray Serve application started as `serve run CONFIG` and stopped again, for measurements.

`slos-serve compare` runs one config after another on the same machine, so each must start
from nothing (no Ray cluster or port left by the previous one, nothing of the user's taken
over) and leave nothing behind: the process runs in a session of its own, and `serve run
--address local` (RAY_ADDRESS unset) starts a private Ray cluster rather than joining one the
user runs; on the way out, whatever happened inside, serve run is interrupted and then its
whole process group killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

POLL_S = 1.0
_WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
"""Runs the command with SIGINT at its default: a shell's background job (a CI runner's, a
nohup'd script's) ignores SIGINT and its children inherit that, while serve run stops cleanly
only on its Ctrl-C path; without this every stop would wait out `stop_timeout_s`."""


class ServeError(RuntimeError):
    """The application did not come up (the message names the config and its log)."""


@dataclass(frozen=True)
class ServeCommand:
    """How to start one application; `argv` (the config path is appended) defaults to this
    environment's `serve run --address local`."""

    config: Path
    health_url: str
    ports: tuple[tuple[str, int], ...]
    """(host, port) pairs the application listens on: they must be free before it starts and
    are free again once it stopped."""
    log: Path
    cwd: Path
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    argv: tuple[str, ...] = ()

    def command(self) -> list[str]:
        serve = str(Path(sys.executable).parent / "serve")
        argv = self.argv or (serve, "run", "--address", "local")
        return [sys.executable, "-c", _WITH_SIGINT, *argv, str(self.config)]


def local_address(host: str) -> str:
    """Where to reach a server listening on `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((local_address(host), port), timeout=1.0):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGINT to serve run alone (its Ctrl-C shutdown: Serve, then the Ray cluster it started;
    interrupting Ray's own processes too can leave it waiting on them), then SIGKILL to
    whatever of the group is still there, serve run included if it hung."""
    proc.send_signal(signal.SIGINT)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def served(cmd: ServeCommand) -> Iterator[subprocess.Popen[bytes]]:
    """The application up and answering `health_url` inside the block (its process, which
    the block may stop itself), stopped after it."""
    for host, port in cmd.ports:
        if _answers(host, port):
            raise ServeError(
                f"{cmd.config}: {host}:{port} is already taken; stop what listens there (or "
                "change the config's ports) first"
            )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with cmd.log.open("wb") as log:
        proc = subprocess.Popen(
            cmd.command(),
            cwd=cmd.cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + cmd.startup_timeout_s
            while not _healthy(cmd.health_url):
                if proc.poll() is not None:
                    raise ServeError(
                        f"{cmd.config}: serve run exited with {proc.returncode} before "
                        f"{cmd.health_url} answered; log {cmd.log}:\n{_tail(cmd.log)}"
                    )
                if time.monotonic() > deadline:
                    raise ServeError(
                        f"{cmd.config}: {cmd.health_url} did not answer within "
                        f"{cmd.startup_timeout_s:g} s; log {cmd.log}:\n{_tail(cmd.log)}"
                    )
                time.sleep(POLL_S)
            yield proc
        finally:
            _stop(proc, cmd.stop_timeout_s)
    deadline = time.monotonic() + cmd.stop_timeout_s
    while any(_answers(h, p) for h, p in cmd.ports):
        if time.monotonic() > deadline:
            raise ServeError(f"{cmd.config}: its ports still answer after the stop")
        time.sleep(POLL_S)
