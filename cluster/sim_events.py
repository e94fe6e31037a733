"""The simulator's event heap: ordered by (time, kind, sequence number).

Events at the same instant run in EventKind order, then in the order they were pushed, so a
run never depends on heap internals. The kind order is chosen so that what happened at an
instant is visible to what decides at it: a step's tokens are out (and its memory freed)
before a KV transfer landing at that instant is placed, both before a replica started by the
autoscaler comes up, all of them before requests arriving at that instant are queued, and
those before the planning tick; the autoscaler looks last, at the instant as it ended.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple


class EventKind(IntEnum):
    STEP_DONE = 0
    """A replica's step ends: tokens out, outcome folded into its scheduler."""
    TRANSFER_DONE = 1
    """A prompt's KV cache reached a decode replica (policy distserve)."""
    REPLICA_UP = 2
    """A replica the autoscaler started has loaded its model and takes requests."""
    ARRIVAL = 3
    """A request reaches the cluster."""
    TICK = 4
    """The controller's planning tick (admission and routing)."""
    SCALE = 5
    """The autoscaler's evaluation (SimConfig.autoscale)."""


class Event(NamedTuple):
    """A tuple, so the heap compares events in C (a run pushes one per step)."""

    time: float
    kind: EventKind
    seq: int
    target: int
    """Replica index (STEP_DONE, REPLICA_UP), workload index (ARRIVAL, TRANSFER_DONE), tick
    number (TICK), evaluation number (SCALE)."""


@dataclass
class EventQueue:
    """A min-heap of events; `seq` numbers pushes so equal (time, kind) keep push order."""

    _heap: list[Event] = field(default_factory=list)
    _pushed: int = 0

    def push(self, time: float, kind: EventKind, target: int) -> None:
        heapq.heappush(self._heap, Event(time, kind, self._pushed, target))
        self._pushed += 1

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
