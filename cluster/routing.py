"""Where a request goes: first hop, sequential SLO-driven hops, route limit, backup policy.

SLOs-Serve section 4.2: a request tries one replica's admission; if that replica cannot
guarantee its SLOs it tries the next, up to `route_limit` replicas; then the backup policy
serves it best-effort or declines it. Pure and deterministic: the controller and the simulator
share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


def least_loaded(loads: Sequence[float], alive: Sequence[bool]) -> int | None:
    """The live replica with the lowest load, the lower index among equals; None if none."""
    up = [i for i, ok in enumerate(alive) if ok]
    return min(up, key=lambda i: (loads[i], i)) if up else None


class FirstHop(StrEnum):
    ROUND_ROBIN = "round_robin"
    """The paper's choice: spreads arrivals evenly, needs no load signal."""
    LEAST_LOAD = "least_load"
    """Lowest planned load first; ties go to the lower index."""
    PREFIX = "prefix"
    """The replica that likely holds the longest cached prefix of the prompt (the history a
    chat or an agent sends back every turn, a document asked about again), so its prefill
    is computed once; round robin among equals, and when no replica holds one. A replica
    holding more than `prefix_imbalance` requests beyond the least loaded is passed over:
    else every request sharing a prefix (a system prompt) would go to the first replica that
    cached it, best-effort ones for good, as they never hop."""


class BackupPolicy(StrEnum):
    BEST_EFFORT = "best_effort"
    REJECT = "reject"


@dataclass(frozen=True)
class Backup:
    """The backup policy's verdict once every allowed hop declined."""

    best_effort_replica: int | None
    """Replica that serves the request best-effort; None when it is rejected."""
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass
class RouteState:
    """The hops one request has made so far."""

    visited: list[int] = field(default_factory=list)

    @property
    def hops(self) -> int:
        return len(self.visited)


@dataclass
class Router:
    """Routing policy over replicas identified by index.

    Caveat: sequential hops cost one planning tick each, so a large route limit trades TTFT for
    admission; the paper found a small limit (a few hops) enough.
    """

    first_hop: FirstHop = FirstHop.ROUND_ROBIN
    route_limit: int = 2
    backup_policy: BackupPolicy = BackupPolicy.BEST_EFFORT
    retry_after_s: float = 1.0
    prefix_imbalance: int = 8
    _next_rr: int = 0

    def __post_init__(self) -> None:
        self.first_hop = FirstHop(self.first_hop)
        self.backup_policy = BackupPolicy(self.backup_policy)
        if self.route_limit < 1:
            raise ValueError(f"route_limit must be >= 1, got {self.route_limit}")
        if self.prefix_imbalance < 0:
            raise ValueError(f"prefix_imbalance must be >= 0, got {self.prefix_imbalance}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

    def first(
        self,
        loads: Sequence[float],
        alive: Sequence[bool],
        cached: Sequence[int] = (),
    ) -> int | None:
        """The first replica to try, or None when no replica is up. `cached`: the prompt's
        tokens each replica likely has cached (the prefix first hop's signal)."""
        up = [i for i, ok in enumerate(alive) if ok]
        if not up:
            return None
        if self.first_hop is FirstHop.LEAST_LOAD:
            return least_loaded(loads, alive)
        if self.first_hop is FirstHop.PREFIX and cached:
            least = min(loads[i] for i in up)
            near = [ok and loads[i] <= least + self.prefix_imbalance for i, ok in enumerate(alive)]
            best = max(cached[i] for i, ok in enumerate(near) if ok)
            if best > 0:
                return self._round_robin([ok and cached[i] == best for i, ok in enumerate(near)])
        return self._round_robin(alive)

    def best_effort_first(
        self,
        loads: Sequence[float],
        alive: Sequence[bool],
        cached: Sequence[int] = (),
    ) -> int | None:
        """Where a request best-effort by choice goes (None when no replica is up). It never
        hops, so a first hop blind to load would bind a burst to a replica busy for minutes
        while another idles: the least loaded, or the prefix first hop's pick, which weighs
        load."""
        if self.first_hop is FirstHop.PREFIX:
            return self.first(loads, alive, cached)
        return least_loaded(loads, alive)

    def _round_robin(self, eligible: Sequence[bool]) -> int:
        n = len(eligible)
        for step in range(n):
            i = (self._next_rr + step) % n
            if eligible[i]:
                self._next_rr = (i + 1) % n
                return i
        raise AssertionError("unreachable: some replica is eligible")

    def next_hop(self, state: RouteState, alive: Sequence[bool]) -> int | None:
        """The next replica after a decline, or None when the route limit is spent."""
        if state.hops >= self.route_limit or not state.visited:
            return None
        n = len(alive)
        last = state.visited[-1]
        for step in range(1, n):
            i = (last + step) % n
            if alive[i] and i not in state.visited:
                return i
        return None

    def backup(self, state: RouteState, loads: Sequence[float], alive: Sequence[bool]) -> Backup:
        """Best-effort on the least loaded live replica, or a clean rejection."""
        least = least_loaded(loads, alive)
        if least is None:
            return Backup(None, "no replica is up", self.retry_after_s)
        if self.backup_policy is BackupPolicy.REJECT:
            return Backup(
                None,
                f"no replica could guarantee the SLO after {state.hops} hop(s)",
                self.retry_after_s,
            )
        return Backup(least)
