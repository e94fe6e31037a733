"""Front-door leases on an injected clock: lapsed doors lose their requests, others keep
theirs; the last door out closes the cluster, except right after a controller restart or when
it hands the cluster over (a Serve update); an abandoned cluster is noticed."""

from __future__ import annotations

from cluster.leases import ABANDONED_MIN_S, HANDOVER_WAIT_S, Leases


def test_a_lapsed_door_loses_only_its_own_requests() -> None:
    leases = Leases(lease_s=10.0, booted=0.0)
    assert leases.renew("a", [], now=0.0) and leases.renew("b", [], now=0.0)
    leases.own("a1", "a", now=1.0)
    leases.own("b1", "b", now=1.0)
    leases.renew("b", [], now=9.0)
    assert leases.expire(now=10.5) == []  # a renewed at 1.0 (its submit): 9.5 s ago
    assert leases.expire(now=11.5) == ["a"]
    assert leases.orphans(known={"a1", "b1"}) == ["a1"]
    assert leases.owners == {"b1": "b"}
    assert leases.orphans(known=set()) == []  # b1 ended: forgotten, not aborted
    assert leases.owners == {}


def test_a_renewal_names_the_requests_a_restarted_controller_forgot() -> None:
    leases = Leases(lease_s=10.0, booted=100.0, restarted=True)
    assert leases.renew("a", ["r1", "r2"], now=101.0)
    assert leases.owners == {"r1": "a", "r2": "a"}
    assert leases.expire(now=112.0) == ["a"]
    assert sorted(leases.orphans(known={"r1", "r2"})) == ["r1", "r2"]


def test_requests_no_door_claims_a_lease_after_a_restart_end_once() -> None:
    """A door that died while the controller restarted never names its requests."""
    leases = Leases(lease_s=10.0, booted=100.0, restarted=True)
    leases.renew("a", ["r1"], now=102.0)
    running = {"r1", "lost"}
    assert leases.unclaimed(running, now=109.0) == []  # b may still renew
    assert leases.unclaimed(running, now=110.5) == ["lost"]
    assert leases.unclaimed(running | {"later"}, now=120.0) == []  # only once
    assert Leases(lease_s=10.0, booted=0.0).unclaimed({"x"}, now=50.0) == []  # not restarted


def test_a_request_briefly_unknown_after_a_restart_stays_claimed() -> None:
    """Its replica's mirror was rebuilt between renewals: orphans() forgot its owner, but
    its door did name it."""
    leases = Leases(lease_s=10.0, booted=100.0, restarted=True)
    leases.renew("b", ["r3"], now=108.0)
    assert leases.orphans(known=set()) == []
    assert leases.unclaimed({"r3"}, now=110.1) == []


def test_the_last_door_out_closes_the_cluster_and_no_door_attaches_after() -> None:
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("a", [], now=0.0)
    leases.renew("b", [], now=0.0)
    assert not leases.release("a", now=1.0) and not leases.closing
    assert leases.release("b", now=2.0) and leases.closing
    assert not leases.renew("c", [], now=3.0)
    assert leases.doors == {}


def test_a_lapsed_door_does_not_keep_the_cluster_open() -> None:
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("dead", [], now=0.0)
    leases.renew("a", [], now=15.0)
    assert leases.release("a", now=15.0)


def test_a_restarted_controller_does_not_close_before_hearing_from_every_door() -> None:
    leases = Leases(lease_s=10.0, booted=50.0, restarted=True)
    leases.renew("a", [], now=51.0)
    assert not leases.release("a", now=52.0) and not leases.closing  # b may renew at 57
    leases.renew("a", [], now=61.0)
    assert leases.release("a", now=61.0)


def test_a_cluster_without_doors_is_abandoned_after_the_grace() -> None:
    short = Leases(lease_s=10.0, booted=0.0)
    assert short.abandoned_after_s == ABANDONED_MIN_S
    assert not short.abandoned(now=ABANDONED_MIN_S)  # no door ever: counted from boot
    assert short.abandoned(now=ABANDONED_MIN_S + 1)
    short.renew("a", [], now=100.0)
    assert not short.abandoned(now=100.0 + ABANDONED_MIN_S + 1)  # a holds a lease
    short.expire(now=111.0)
    assert not short.abandoned(now=100.0 + ABANDONED_MIN_S)
    assert short.abandoned(now=100.0 + ABANDONED_MIN_S + 1)
    long = Leases(lease_s=100.0, booted=0.0)
    assert long.abandoned_after_s == 200.0 and not long.abandoned(now=150.0)


def test_a_door_handing_over_leaves_the_cluster_open_for_the_next() -> None:
    """A Serve update's old door leaves without closing: the next door attaches; if none
    comes, the cluster is abandoned after HANDOVER_WAIT_S (it stopped after 60 s while Serve
    took 4.5 min to start the next door on a loaded machine, which then loaded the models
    again); once a door renewed, the usual grace again."""
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("old", [], now=0.0)
    leases.own("r1", "old", now=1.0)
    assert not leases.release("old", now=2.0, handover=True) and not leases.closing
    assert leases.doors == {}
    assert leases.orphans(known={"r1"}) == ["r1"]  # its requests end with it
    assert leases.abandoned_after_s == HANDOVER_WAIT_S > ABANDONED_MIN_S
    assert not leases.abandoned(now=2.0 + HANDOVER_WAIT_S - 1)
    assert leases.abandoned(now=2.0 + HANDOVER_WAIT_S)
    assert leases.renew("new", [], now=3.0)
    assert leases.abandoned_after_s == ABANDONED_MIN_S
    leases.release("new", now=4.0)
    assert leases.closing  # the last door out, not handing over: the cluster stops


def test_live_doors_are_those_whose_lease_has_not_lapsed() -> None:
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("a", [], now=0.0)
    leases.renew("b", [], now=5.0)
    assert leases.live(now=10.0) == ["a", "b"]
    assert leases.live(now=12.0) == ["b"]
    assert leases.doors.keys() == {"a", "b"}  # nothing dropped: expire() logs the lapse


def test_a_renewal_that_arrives_after_its_door_left_takes_no_lease() -> None:
    """Ray does not order an async actor's calls: a renewal sent before the release may land
    after it, and would have kept the door (and a cluster it was the last of) a lease more."""
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("a", [], now=0.0)
    leases.renew("b", [], now=0.0)
    assert not leases.release("a", now=1.0)
    assert not leases.renew("a", [], now=1.5)
    leases.own("r1", "a", now=1.6)
    assert leases.live(now=2.0) == ["b"]
    assert leases.release("b", now=3.0)  # the last one out closes it


def test_a_restarted_controller_is_still_hearing_from_its_doors_for_a_lease() -> None:
    leases = Leases(lease_s=10.0, booted=100.0, restarted=True)
    assert leases.hearing(now=105.0) and not leases.live(now=105.0)
    assert not leases.hearing(now=110.0)
    assert not Leases(lease_s=10.0, booted=100.0).hearing(now=101.0)


def test_time_the_controller_could_not_hear_does_not_count_against_a_lease() -> None:
    """Its loop held up 8 s (a loaded host): the renewals queued behind it, and a door that
    renewed 4 s before is not taken for dead; one silent for longer still lapses."""
    leases = Leases(lease_s=10.0, booted=0.0)
    leases.renew("alive", [], now=4.0)
    leases.renew("dead", [], now=-20.0)
    leases.excuse(8.0, now=16.0)
    assert leases.expire(now=16.0) == ["dead"]
    assert leases.doors == {"alive": 12.0}
    leases.renew("alive", [], now=14.0)
    leases.excuse(8.0, now=15.0)
    assert leases.doors == {"alive": 15.0}  # never renewed in the future
