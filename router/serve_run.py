"""`slos-serve serve CONFIG`: `serve run CONFIG`, stopped without cutting a stream.

Serve's shutdown, serve run's Ctrl-C, stops the HTTP proxies at once, and with them every
response they stream; SIGTERM (docker stop, systemd, a process manager) skips even that, as
Ray's handler exits the process. Here either signal first deletes the applications, which Serve
drains as on `serve delete`: new requests are refused while each front door finishes its
streams (its graceful_shutdown_timeout_s, router.app.DRAIN_S, at most), then Serve shuts
down. A second signal stops at once. A Ray that does not start (or cannot be reached), or an
application that fails to deploy, ends the process with exit code 1, naming why.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType

import ray
from ray import serve
from ray._private.node import Node
from ray.serve.exceptions import RayServeException
from ray.serve.schema import ApplicationStatus
from ray.serve.scripts import cli

from replica.arguments import OptionError

SERVE_NAMESPACE = "serve"
"""The Ray namespace serve run starts Serve in."""
WATCH_S = 1.0

log = logging.getLogger("slos_serve.serve_run")


class _Stop:
    """The SIGINT and SIGTERM handler: the first interrupts the wait (`run` then drains and
    shuts Serve down), a second the drain."""

    def __init__(self) -> None:
        self.signalled = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled:
            log.warning("stopping now")
            raise KeyboardInterrupt
        self.signalled = True
        log.warning(
            "%s: draining the applications' streams before stopping (signal again to stop now)",
            signal.Signals(signum).name,
        )
        raise KeyboardInterrupt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "serve run CONFIG, stopped on SIGINT or SIGTERM once its streams ended"
    parser.add_argument(
        "config", nargs="?", default="deploy/serve-cpu.yaml", help="a Ray Serve config file"
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to run on (default: RAY_ADDRESS, or a new local one)",
    )


def run(args: argparse.Namespace) -> int:
    if not Path(args.config).is_file():
        raise OptionError(f"{args.config} is not a file (give a Serve config, as to serve run)")
    logging.basicConfig(format="%(asctime)s slos-serve: %(message)s", stream=sys.stderr)
    # Before serve run, which then keeps this Ray instance, so this handler replaces Ray's.
    try:
        ray.init(address=args.address, namespace=SERVE_NAMESPACE)
    except Exception as exc:  # the start's timeout is a bare Exception
        _stop_half_started(exc)
        log.error("Ray did not start or could not be reached: %s", " ".join(str(exc).split()))
        return 1
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        cli.main(["run", "--non-blocking", args.config], prog_name="serve", standalone_mode=False)
        failed = _until_one_fails_to_deploy()
    except KeyboardInterrupt:
        _drain()
        serve.shutdown()
        return 0
    log.error("application %r failed to deploy: %s", *failed)
    serve.shutdown()
    return 1


def _stop_half_started(exc: Exception) -> None:
    """Stop the processes of the head node a failed ray.init was starting (its 30-s wait for
    the raylet to register runs out on a loaded machine). ray.init drops that node, so
    ray.shutdown cannot stop them; the raylet dies with this process, but the agents it
    started outlive it, orphaned. The node is still the `self` of its frames in the
    traceback."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        node = frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=True)
            return


def _drain() -> None:
    """Delete the applications, which Serve drains, and wait until it has: each door's
    graceful_shutdown_timeout_s bounds it (router.app.DRAIN_S). Not serve.delete's own wait,
    which gives up after 60 s with a TimeoutError (Ray 2.60), and so cut every stream still
    open then and skipped Serve's shutdown. A second signal stops the wait."""
    try:
        names = list(serve.status().applications)
        for name in names:
            serve.delete(name, _blocking=False)
        while any(_present(name) for name in names):
            time.sleep(WATCH_S)
    except (RayServeException, KeyboardInterrupt):  # Serve is not up yet, or a second signal
        return


def _present(name: str) -> bool:
    app = serve.status().applications.get(name)
    return app is not None and app.status != ApplicationStatus.NOT_STARTED


def _until_one_fails_to_deploy() -> tuple[str, str]:
    """Block as serve run does, but return the first application that fails to deploy before
    it ever ran, and the last line of Serve's message (the exception), where serve run would
    go on serving nothing: a process manager or a container must see the start fail (a
    keys file with no key, a missing model directory). An update that fails later leaves
    the running version serving; that is Serve's to report."""
    ran: set[str] = set()
    while True:
        time.sleep(WATCH_S)
        for name, app in serve.status().applications.items():
            if app.status == ApplicationStatus.RUNNING:
                ran.add(name)
            elif app.status == ApplicationStatus.DEPLOY_FAILED and name not in ran:
                lines = [line for line in app.message.splitlines() if line.strip()]
                return name, lines[-1] if lines else "no message"
