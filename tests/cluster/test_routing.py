"""First hop, sequential hops, route limit and backup policy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.routing import BackupPolicy, FirstHop, Router, RouteState


def test_round_robin_skips_dead_replicas() -> None:
    r = Router()
    alive = [True, False, True]
    assert [r.first([0, 0, 0], alive) for _ in range(4)] == [0, 2, 0, 2]


def test_least_load_breaks_ties_by_index() -> None:
    r = Router(first_hop=FirstHop.LEAST_LOAD)
    assert r.first([3.0, 1.0, 1.0], [True, True, True]) == 1
    assert r.first([3.0, 1.0, 1.0], [True, False, True]) == 2


def test_no_replica_up() -> None:
    r = Router()
    assert r.first([0.0], [False]) is None
    backup = r.backup(RouteState(), [0.0], [False])
    assert backup.best_effort_replica is None and "no replica" in backup.reason


def test_hops_are_sequential_and_bounded_by_route_limit() -> None:
    r = Router(route_limit=3)
    alive = [True] * 5
    state = RouteState(visited=[3])
    hops = []
    while (nxt := r.next_hop(state, alive)) is not None:
        hops.append(nxt)
        state.visited.append(nxt)
    assert hops == [4, 0]
    assert state.hops == 3


@given(st.lists(st.booleans(), min_size=1, max_size=8), st.integers(1, 8))
def test_next_hop_never_revisits_or_picks_dead(alive: list[bool], limit: int) -> None:
    r = Router(route_limit=limit)
    first = r.first([0.0] * len(alive), alive)
    if first is None:
        return
    state = RouteState(visited=[first])
    while (nxt := r.next_hop(state, alive)) is not None:
        assert alive[nxt] and nxt not in state.visited
        state.visited.append(nxt)
    assert state.hops == min(limit, sum(alive))


def test_backup_best_effort_and_reject() -> None:
    state = RouteState(visited=[0, 1])
    be = Router(backup_policy=BackupPolicy.BEST_EFFORT).backup(state, [5.0, 2.0], [True, True])
    assert be.best_effort_replica == 1
    rej = Router(backup_policy="reject", retry_after_s=2.5).backup(state, [5, 2], [True, True])  # type: ignore[arg-type]
    assert rej.best_effort_replica is None
    assert "2 hop" in rej.reason and rej.retry_after_s == 2.5


def test_invalid_router_settings() -> None:
    with pytest.raises(ValueError, match="route_limit"):
        Router(route_limit=0)
    with pytest.raises(ValueError):
        Router(backup_policy="drop")  # type: ignore[arg-type]


def test_the_prefix_first_hop_takes_the_longest_cached_prefix() -> None:
    r = Router(first_hop=FirstHop.PREFIX)
    alive = [True, True, True]
    assert r.first([9.0, 0.0, 0.0], alive, [0, 64, 16]) == 1
    assert r.first([0.0, 0.0, 0.0], [True, False, True], [0, 64, 16]) == 2
    assert [r.first([0.0] * 3, alive, [32, 0, 32]) for _ in range(3)] == [0, 2, 0]
    assert [r.first([0.0] * 3, alive, [0, 0, 0]) for _ in range(3)] == [1, 2, 0]
    assert [r.first([0.0] * 3, alive) for _ in range(2)] == [1, 2]


def test_the_prefix_first_hop_passes_over_a_replica_loaded_past_the_imbalance() -> None:
    r = Router(first_hop=FirstHop.PREFIX, prefix_imbalance=2)
    alive = [True, True, True]
    assert r.first([3.0, 1.0, 1.0], alive, [64, 16, 0]) == 0
    assert r.first([4.0, 1.0, 1.0], alive, [64, 16, 0]) == 1
    assert r.first([4.0, 1.0, 1.0], alive, [64, 0, 0]) == 2  # no prefix near: round robin
    with pytest.raises(ValueError, match="prefix_imbalance must be >= 0"):
        Router(prefix_imbalance=-1)
