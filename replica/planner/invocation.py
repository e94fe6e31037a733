"""When to replan, and how a request that fell behind is planned.

The planner re-solves admission and the batch budget on a timer, when enough requests arrived
or finished, and when the plan drifted from reality: a batch overran the batch period, or a
decoder's next token is due before the next batch could end (it lost the lead the plan keeps;
a decoder already behind at the last report does not call again).
A request behind its line is planned with a tighter TPOT, so the budget gives it a token more
often (or longer speculation) until it is back on track.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from replica.planner.config import InvocationConfig

Times = TypeVar("Times", float, np.ndarray)


def lags(next_deadline_s: Times, now: float, period_s: float) -> Times:
    """Whether a decoder's next token is due before a full batch from now could deliver it
    (elementwise for arrays): it lost the lead the plan keeps and is planned tighter."""
    return next_deadline_s < now + period_s * (1.0 - 1e-9)


class InvocationPolicy:
    """Counts the triggers since the last plan."""

    def __init__(self, config: InvocationConfig) -> None:
        self.config = config
        self.last_plan_s: float | None = None
        self.new_requests = 0
        self.finished_requests = 0
        self.drifted = False
        self.lagging: set[str] = set()
        """Decoders behind their line after the last batch (`note_lagging`)."""

    def note_new(self) -> None:
        self.new_requests += 1

    def note_finished(self, count: int) -> None:
        self.finished_requests += count

    def note_batch(self, period_s: float, measured_s: float) -> None:
        """Every planned batch is predicted to end within the period; the plan's guarantees
        hold as long as it does, so only overrunning the period counts as drift."""
        if measured_s > period_s * (1.0 + self.config.drift_fraction):
            self.drifted = True

    def note_lagging(self, request_ids: set[str]) -> None:
        """The decoders behind their line after a batch: only one that was not behind after
        the previous batch counts as drift, since the plan already holds the others tighter."""
        if not request_ids <= self.lagging:
            self.drifted = True
        self.lagging = request_ids

    def due(self, now: float) -> bool:
        cfg = self.config
        return (
            self.last_plan_s is None
            or now - self.last_plan_s >= cfg.interval_s
            or self.new_requests >= cfg.new_requests
            or self.finished_requests >= cfg.finished_requests
            or self.drifted
        )

    def planned(self, now: float) -> None:
        self.last_plan_s = now
        self.new_requests = 0
        self.finished_requests = 0
        self.drifted = False
