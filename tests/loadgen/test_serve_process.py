"""loadgen.serve_process: an application process comes up, is stopped with everything it
started, and fails clearly (naming the config, with its log) when it cannot come up.

The application here is a small HTTP server script run as the `serve run` command would be:
what is under test is the process handling, which must not depend on Ray to be checked."""

from __future__ import annotations

import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loadgen.serve_process import ServeCommand, ServeError, served
from tests.deploy.test_serve_run import free_port

pytestmark = pytest.mark.timeout(60)

APP = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    mode, port = open(sys.argv[-1]).read().split()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    if mode == "crash":
        sys.exit("cannot load the model")
    if mode == "sick":
        time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    try:
        http.server.HTTPServer(("127.0.0.1", int(port)), Health).serve_forever()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    """
)


def command(tmp_path: Path, mode: str, port: int, timeout_s: float = 20.0) -> ServeCommand:
    app = tmp_path / "app.py"
    app.write_text(APP)
    config = tmp_path / f"{mode}.yaml"
    config.write_text(f"{mode} {port}")
    return ServeCommand(
        config=config,
        health_url=f"http://127.0.0.1:{port}/health",
        ports=(("127.0.0.1", port),),
        log=tmp_path / f"{mode}.log",
        cwd=tmp_path,
        startup_timeout_s=timeout_s,
        stop_timeout_s=10.0,
        argv=(sys.executable, str(app)),
    )


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie awaiting its reaper is gone


def alive(pid: int) -> bool:
    """Still running 5 s on: a killed process dies asynchronously, within milliseconds."""
    deadline = time.monotonic() + 5.0
    while running(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def child_pid(log: Path) -> int:
    line = next(x for x in log.read_text().splitlines() if x.startswith("child "))
    return int(line.split()[1])


def test_up_inside_the_block_and_nothing_left_after_it(tmp_path: Path) -> None:
    port = free_port()
    cmd = command(tmp_path, "ok", port)
    with served(cmd):
        assert answers(port)
        child = child_pid(cmd.log)
        assert running(child)
    assert not answers(port)
    assert not alive(child)  # what the application started goes with it
    assert "interrupted" in cmd.log.read_text().splitlines()  # stopped, not killed


def test_stopped_even_when_the_block_fails(tmp_path: Path) -> None:
    port = free_port()
    cmd = command(tmp_path, "ok", port)
    with pytest.raises(KeyError), served(cmd):
        raise KeyError("the measurement failed")
    assert not answers(port)
    assert not alive(child_pid(cmd.log))


def test_an_application_that_exits_names_its_config_and_shows_its_log(tmp_path: Path) -> None:
    cmd = command(tmp_path, "crash", free_port())
    with pytest.raises(ServeError, match=r"crash\.yaml.*exited") as err, served(cmd):
        pytest.fail("the block must not run")
    assert "cannot load the model" in str(err.value)
    assert not alive(child_pid(cmd.log))


def test_one_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    cmd = command(tmp_path, "sick", free_port(), timeout_s=3.0)
    with pytest.raises(ServeError, match=r"sick\.yaml.*did not answer within 3 s"), served(cmd):
        pytest.fail("the block must not run")
    assert not alive(child_pid(cmd.log))


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        cmd = command(tmp_path, "ok", port)
        with pytest.raises(ServeError, match=f"127.0.0.1:{port} is already taken"), served(cmd):
            pytest.fail("the block must not run")
    assert not cmd.log.exists()


def test_stopped_by_its_ctrl_c_path_even_where_sigint_is_ignored(tmp_path: Path) -> None:
    """A background job of a shell ignores SIGINT, and children inherit that: the application
    must still get its Ctrl-C, not wait out the stop timeout and be killed."""
    cmd = command(tmp_path, "ok", free_port())
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with served(cmd):
            pass
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted" in cmd.log.read_text().splitlines()
