"""Front-door leases: who reads each request, and when a cluster has no reader left.

A front door (a `ClusterHandle`) renews its lease every quarter of `door_lease_s` and names
the requests it streams, from a thread of its own. A door that stops renewing has died: no
one reads its requests any more, so the controller ends them. A detached cluster that no
door has renewed for `abandoned_after_s` (the door that would stop it died before it could,
or a door handed it over to a next one that never came: HANDOVER_WAIT_S then) stops itself.
Pure and clock-injected, like the planner: the controller feeds it `time.monotonic()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

ABANDONED_MIN_S = 60.0
"""A cluster outlives every door by at least this long: time for Serve to start the next one."""
HANDOVER_WAIT_S = 600.0
"""How long a cluster handed over (a Serve update) waits for the next door: Serve schedules
and starts it in minutes on a loaded machine (4.5 min once, at load ~150, when the cluster
stopped after 60 s, and the next door launched another, models loaded again)."""


@dataclass
class Leases:
    lease_s: float
    booted: float
    """When this controller (re)started: its first lease period may not have heard from every
    live door yet."""
    restarted: bool = False
    doors: dict[str, float] = field(default_factory=dict)
    """Door id -> when it last renewed."""
    owners: dict[str, str] = field(default_factory=dict)
    """Request id -> the door that streams it."""
    closing: bool = False
    released: set[str] = field(default_factory=set)
    """Doors that left: a renewal one sent before it left may arrive after (Ray does not order
    an async actor's calls), and must not take its lease again."""
    last_renewal: float | None = None
    claimed: set[str] | None = None
    """After a restart, until `unclaimed` has counted: the requests a door named since.
    Unlike `owners`, never pruned meanwhile, so a request briefly unknown (its replica's
    mirror rebuilt) still counts as claimed. None otherwise."""
    handed_over: bool = False
    """The last door to leave handed the cluster over, and no door has renewed since."""

    def __post_init__(self) -> None:
        if self.restarted:
            self.claimed = set()

    def renew(self, door: str, requests: Iterable[str], now: float) -> bool:
        """Take or renew `door`'s lease, owning `requests` (a restarted controller learns its
        owners again this way); False once the cluster is closing, or to a door that left."""
        if self.closing or door in self.released:
            return False
        self.doors[door] = self.last_renewal = now
        self.handed_over = False
        for request_id in requests:
            self.owners.setdefault(request_id, door)
            if self.claimed is not None:
                self.claimed.add(request_id)
        return True

    def own(self, request_id: str, door: str, now: float) -> None:
        """A door submits or resumes a request: a sign of life too."""
        self.owners[request_id] = door
        if self.claimed is not None:
            self.claimed.add(request_id)
        if not self.closing and door not in self.released:
            self.doors[door] = self.last_renewal = now

    def release(self, door: str, now: float, *, handover: bool = False) -> bool:
        """`door` leaves. True when it was the last one: the cluster is closing from now on
        (no door may attach) and the caller stops it. A controller restarted less than a lease
        ago answers False: another door may not have renewed with it yet. A door `handover`
        (a Serve update replaces it) never closes: the next door attaches to the cluster or
        replaces it, and a cluster no door comes to is abandoned."""
        self.doors.pop(door, None)
        self.released.add(door)
        self.expire(now)
        if handover:
            self.handed_over = True
            return False
        if self.hearing(now):
            return False
        self.closing = not self.doors
        return self.closing

    def excuse(self, deaf_s: float, now: float) -> None:
        """The controller heard nothing for `deaf_s` (its own loop held up, the renewals
        queued behind it): that time does not count against the doors' leases."""
        for door, renewed in self.doors.items():
            self.doors[door] = min(now, renewed + deaf_s)

    def hearing(self, now: float) -> bool:
        """Restarted less than a lease ago: a live door may not have renewed with it yet."""
        return self.restarted and now - self.booted < self.lease_s

    def live(self, now: float) -> list[str]:
        """The doors whose lease has not lapsed (unlike `expire`, nothing is dropped)."""
        return [door for door, renewed in self.doors.items() if not self._lapsed(renewed, now)]

    def expire(self, now: float) -> list[str]:
        """Drop the doors whose lease lapsed; their ids."""
        gone = [door for door, renewed in self.doors.items() if self._lapsed(renewed, now)]
        for door in gone:
            del self.doors[door]
        return gone

    def _lapsed(self, renewed: float, now: float) -> bool:
        return now - renewed > self.lease_s

    def orphans(self, known: set[str]) -> list[str]:
        """Requests still running (`known`) whose door is gone, to be aborted; the owners of
        requests that ended are forgotten."""
        ended = [
            rid for rid, door in self.owners.items() if rid not in known or door not in self.doors
        ]
        orphaned = [rid for rid in ended if rid in known]
        for rid in ended:
            del self.owners[rid]
        return orphaned

    @property
    def settling(self) -> bool:
        """A restarted controller has not yet counted the requests no door claimed."""
        return self.claimed is not None

    def unclaimed(self, known: set[str], now: float) -> list[str]:
        """Once, a lease after a restart, when every live door has renewed with this
        controller and named its requests: the running requests (`known`) none claimed,
        whose door died before it could; to be aborted. Empty at any other call."""
        if self.claimed is None or now - self.booted <= self.lease_s:
            return []
        unclaimed, self.claimed = known - self.claimed, None
        return sorted(unclaimed)

    def abandoned(self, now: float) -> bool:
        """No door has renewed for `abandoned_after_s`, since boot or the last renewal."""
        since = self.booted if self.last_renewal is None else self.last_renewal
        return not self.doors and now - since > self.abandoned_after_s

    @property
    def abandoned_after_s(self) -> float:
        wait = HANDOVER_WAIT_S if self.handed_over else ABANDONED_MIN_S
        return max(wait, 2 * self.lease_s)
