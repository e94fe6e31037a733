"""How many replicas to run: SLO-driven autoscaling, and Ray Serve's ongoing-requests rule.

Ray Serve scales a deployment to keep `target_ongoing_requests` per replica, a number the user
must tune per workload: too high and bursts miss their SLOs, too low and GPUs idle. The
controller knows better what a replica can take: admission declines a request exactly when no
replica can guarantee it. So the `slo` signal adds replicas when the share of SLO requests
declined over the look-back window exceeds `max_declined` (in proportion to it), and learns
from the moments of its declines how many admitted requests a replica holds when it is full.
It removes a replica when nothing was declined and the admitted requests would fit the
replicas left within `headroom` of that learned load; before any decline it has learned
nothing, so it steps down until one shows it where the load is.

Replicas being started count toward the running count, and `slo` adds none while fewer
replicas take requests than the target (one starting, or restarting after a failure): the
declines meanwhile are the ones the missing replicas are for. It may still step down then, so
a replica that never comes up (no GPU to place it on) is given up once the load is gone.
Both signals act as Ray Serve's autoscaler does: every evaluation computes a desired count
from the look-back window, and the count changes once the desire has pointed the same way for
`upscale_delay_s` (up) or `downscale_delay_s` (down). Pure and clock-injected: the live
controller and the simulator feed it the same samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from cluster.choices import member
from replica.planner.config import check_fraction, check_int, check_non_negative, check_positive

SCALE_PERIOD_S = 1.0
"""How often the autoscaler is fed a sample."""


class ScaleSignal(StrEnum):
    SLO = "slo"
    """Admission's declines (slos only: the baselines admit everything)."""
    ONGOING = "ongoing"
    """Ray Serve's rule: requests held per replica against `target_ongoing_requests`."""


@dataclass(frozen=True)
class AutoscaleConfig:
    """`cluster.autoscale`: the replica count follows the load between the two bounds."""

    min_replicas: int = 1
    max_replicas: int = 1
    signal: ScaleSignal = ScaleSignal.SLO
    look_back_s: float = 30.0
    """Window each desired count is computed over."""
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    max_declined: float = 0.02
    """slo: declined share of SLO requests in the window above which replicas are added."""
    headroom: float = 0.8
    """slo: the share of a full replica's admitted load the replicas left may carry after a
    removal."""
    target_ongoing_requests: float = 8.0
    """ongoing: requests held (admitted or best-effort) per replica to aim for."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "signal", member(ScaleSignal, "autoscale.signal", self.signal))
        for name in ("min_replicas", "max_replicas"):
            check_int(f"autoscale.{name}", getattr(self, name))
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscale.max_replicas ({self.max_replicas}) must be >= min_replicas "
                f"({self.min_replicas})"
            )
        for name in ("look_back_s", "target_ongoing_requests"):
            check_positive(f"autoscale.{name}", getattr(self, name))
        for name in ("upscale_delay_s", "downscale_delay_s"):
            check_non_negative(f"autoscale.{name}", getattr(self, name))
        check_fraction("autoscale.max_declined", self.max_declined, low=0.0, high=1.0)
        if self.max_declined == 1:
            raise ValueError(f"autoscale.max_declined must be in [0, 1), got {self.max_declined!r}")
        check_positive("autoscale.headroom", self.headroom)
        if self.headroom > 1:
            raise ValueError(f"autoscale.headroom must be in (0, 1], got {self.headroom!r}")

    def bounded(self, count: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, count))

    def check_start(self, replicas: int) -> None:
        """A cluster starts with a count within the bounds (the config's `replicas`)."""
        if not self.min_replicas <= replicas <= self.max_replicas:
            raise ValueError(
                f"replicas ({replicas}) must be within autoscale's bounds "
                f"[{self.min_replicas}, {self.max_replicas}]"
            )


@dataclass(frozen=True)
class ScaleSample:
    """What the cluster looked like at one evaluation; counts are cumulative since start."""

    time: float
    decided: int
    """SLO requests given a verdict."""
    declined: int
    """Of those, the ones no replica could guarantee (served best-effort or rejected)."""
    admitted_held: int
    """Admitted requests the routable replicas hold now."""
    ongoing: int
    """Requests held or waiting for a verdict now, best-effort ones included."""
    replicas: int
    """Routable replicas now."""


@dataclass(frozen=True)
class _Period:
    """One sample and the verdicts given since the sample before it."""

    sample: ScaleSample
    decided: int
    declined: int


class Autoscaler:
    """Feed it a sample per evaluation; it says how many replicas to run."""

    def __init__(self, config: AutoscaleConfig, replicas: int) -> None:
        self.config = config
        self.target = config.bounded(replicas)
        self.full_load: float | None = None
        """slo: admitted requests a replica held when requests were declined: an exponential
        average over the samples with declines (`_learn`). Not the window's mean while it
        held a decline: that learned the quiet after a lone decline (0.2 at a trickle), and
        no removal passed while one request was held."""
        self._window: deque[_Period] = deque()
        """The look-back window, since the routable count last changed (a window of another
        count says nothing of this one)."""
        self._counts = (0, 0)
        """(decided, declined) at the last sample."""
        self._wanted_since: tuple[int, float] | None = None
        """(direction, since when) the desired count has pointed away from the target."""

    def observe(self, sample: ScaleSample) -> int:
        """The replica count to run from now on."""
        period = _Period(
            sample, sample.decided - self._counts[0], sample.declined - self._counts[1]
        )
        self._counts = (sample.decided, sample.declined)
        if period.declined:
            self._learn(sample)
        if self._window and self._window[-1].sample.replicas != sample.replicas:
            self._window.clear()
        self._window.append(period)
        while self._window[0].sample.time <= sample.time - self.config.look_back_s:
            self._window.popleft()
        desired = self.config.bounded(self._desired())
        direction = (desired > self.target) - (desired < self.target)
        if direction == 0:
            self._wanted_since = None
            return self.target
        if self._wanted_since is None or self._wanted_since[0] != direction:
            self._wanted_since = (direction, sample.time)
        delay = self.config.upscale_delay_s if direction > 0 else self.config.downscale_delay_s
        if sample.time - self._wanted_since[1] >= delay:
            self.target = desired
            self._wanted_since = None
            self._window.clear()
        return self.target

    def _desired(self) -> int:
        samples = [p.sample for p in self._window]
        if not samples:
            return self.target
        first, last = samples[0], samples[-1]
        if self.config.signal is ScaleSignal.ONGOING:
            mean = sum(s.ongoing for s in samples) / len(samples)
            return math.ceil(mean / self.config.target_ongoing_requests)
        decided = sum(p.decided for p in self._window)
        declined = sum(p.declined for p in self._window)
        served = [s.admitted_held / s.replicas for s in samples if s.replicas]
        per_replica = sum(served) / len(served) if served else 0.0
        if declined:
            if last.replicas < self.target:  # the missing replicas are for these declines
                return self.target
            share = declined / max(decided, 1)
            if share > self.config.max_declined:
                return max(self.target + 1, math.ceil(self.target / (1 - min(share, 0.5))))
            return self.target
        if self.target <= 1 or last.time - first.time < self.config.look_back_s / 2:
            return self.target
        left = per_replica * self.target / (self.target - 1)
        if self.full_load is not None and left > self.config.headroom * self.full_load:
            return self.target
        return self.target - 1

    def _learn(self, sample: ScaleSample) -> None:
        """A decline while the replicas held under one admitted request each teaches nothing:
        no load made it (an SLO an idle replica misses, a slowed machine), and a full replica
        learned so small would keep every replica for good."""
        per_replica = sample.admitted_held / sample.replicas if sample.replicas else 0.0
        if per_replica < 1:
            return
        if self.full_load is None:
            self.full_load = per_replica
        else:
            self.full_load = 0.8 * self.full_load + 0.2 * per_replica


@dataclass(frozen=True)
class Resize:
    """How to reach a target count from the replicas as they are."""

    start: int = 0
    """Empty slots to start a replica in."""
    cancel: tuple[int, ...] = ()
    """Replicas still starting to stop (the highest-numbered first)."""
    undrain: tuple[int, ...] = ()
    """Draining replicas to take back: they are warm, so before any new one."""
    drain: tuple[int, ...] = ()
    """Serving replicas to drain: they finish what they hold, then stop."""


def plan_resize(
    target: int,
    serving: Sequence[int],
    starting: Sequence[int],
    draining: Sequence[int],
    load: Callable[[int], float],
) -> Resize:
    """The changes that bring the replicas counted (serving and starting) to `target`: the
    busiest draining replicas are taken back before a new one starts; starting replicas (the
    highest-numbered first) stop before a serving one drains, and the least loaded (the
    higher-numbered of equals) drains first, as it has the least to finish."""
    counted = len(serving) + len(starting)
    if counted < target:
        back = sorted(draining, key=lambda i: (-load(i), i))[: target - counted]
        return Resize(start=target - counted - len(back), undrain=tuple(back))
    excess = counted - target
    cancel = tuple(sorted(starting, reverse=True)[:excess])
    drain = sorted(serving, key=lambda i: (load(i), -i))[: excess - len(cancel)]
    return Resize(cancel=cancel, drain=tuple(drain))
