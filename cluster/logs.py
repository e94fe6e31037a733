"""The project's log lines in Ray's worker processes.

Ray configures its own loggers only. In its actors (the controller, the replicas) and Serve's
replicas (the front door) nothing handles the project's loggers (cluster.*, replica.*,
router.*): Python's last resort prints their warnings without level or time, and drops every
INFO line, the autoscaler's decisions and replica starts among them. Where the root logger
has a handler (Serve's, a test run's, an application's embedding the cluster) the lines go to
it, at this level.
"""

from __future__ import annotations

import logging
import os
from typing import TextIO

LOG_LEVEL_ENV = "SLOS_SERVE_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PACKAGES = ("cluster", "replica", "router")
FORMAT = "%(asctime)s %(levelname)s %(name)s -- %(message)s"


class _Handler(logging.StreamHandler[TextIO]):
    """Ours, so that a second call adds no second handler."""


def configure_logging() -> None:
    """Send the project's log lines at SLOS_SERVE_LOG_LEVEL (INFO by default) and above to
    stderr, which Ray writes to the worker's log and streams to the driver."""
    raw = os.environ.get(LOG_LEVEL_ENV, "INFO")
    level = raw.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV} must be one of {', '.join(LEVELS)}, got {raw!r}")
    handled = bool(logging.getLogger().handlers)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not handled and not any(isinstance(h, _Handler) for h in logger.handlers):
            handler = _Handler()
            handler.setFormatter(logging.Formatter(FORMAT))
            logger.addHandler(handler)
