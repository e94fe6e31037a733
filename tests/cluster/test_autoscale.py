"""The autoscaler's decisions on hand-made samples: delays, proportional steps, the learned
full load, and Ray Serve's ongoing-requests rule."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.autoscale import AutoscaleConfig, Autoscaler, ScaleSample, ScaleSignal

SLO = AutoscaleConfig(
    min_replicas=1, max_replicas=8, look_back_s=10.0, upscale_delay_s=5.0, downscale_delay_s=20.0
)


def feed(
    scaler: Autoscaler,
    start: float,
    seconds: int,
    *,
    decided_per_s: int,
    declined_per_s: int,
    held: int,
    replicas: int,
    base: tuple[int, int] = (0, 0),
) -> tuple[int, tuple[int, int]]:
    """One sample a second; returns the last target and the cumulative counts."""
    decided, declined = base
    target = scaler.target
    for k in range(seconds):
        decided += decided_per_s
        declined += declined_per_s
        sample = ScaleSample(start + k, decided, declined, held, held, replicas)
        target = scaler.observe(sample)
    return target, (decided, declined)


def test_declines_add_replicas_in_proportion_after_the_upscale_delay() -> None:
    scaler = Autoscaler(SLO, 2)
    # 25% declined: 2 / 0.75 -> 3 replicas, once the desire (from t=0) held for 5 s.
    target, base = feed(scaler, 0.0, 5, decided_per_s=8, declined_per_s=2, held=10, replicas=2)
    assert target == 2
    target, _ = feed(
        scaler, 5.0, 1, decided_per_s=8, declined_per_s=2, held=10, replicas=2, base=base
    )
    assert target == 3
    # It learned what a full replica holds: 10 admitted over 2 replicas.
    assert scaler.full_load == pytest.approx(5.0)


def test_no_replica_is_added_while_one_starts() -> None:
    scaler = Autoscaler(SLO, 2)
    _, base = feed(scaler, 0.0, 6, decided_per_s=8, declined_per_s=2, held=10, replicas=2)
    assert scaler.target == 3
    # The third replica is loading (2 routable): the declines meanwhile add none.
    target, base = feed(
        scaler, 6.0, 30, decided_per_s=8, declined_per_s=2, held=10, replicas=2, base=base
    )
    assert target == 3
    # Up, it still sees declines: one more after the delay.
    target, base = feed(
        scaler, 36.0, 5, decided_per_s=8, declined_per_s=2, held=15, replicas=3, base=base
    )
    assert target == 3
    target, _ = feed(
        scaler, 41.0, 1, decided_per_s=8, declined_per_s=2, held=15, replicas=3, base=base
    )
    assert target == 4


def test_a_replica_that_never_comes_up_is_given_up_once_the_load_is_gone() -> None:
    scaler = Autoscaler(SLO, 2)
    _, base = feed(scaler, 0.0, 6, decided_per_s=8, declined_per_s=2, held=10, replicas=2)
    assert scaler.target == 3
    # The third never takes requests (no GPU to place it on); the traffic ends.
    target, _ = feed(
        scaler, 6.0, 40, decided_per_s=0, declined_per_s=0, held=0, replicas=2, base=base
    )
    assert target == 2


def test_declines_below_the_threshold_keep_the_count() -> None:
    scaler = Autoscaler(SLO, 4)
    target, _ = feed(scaler, 0.0, 60, decided_per_s=100, declined_per_s=1, held=20, replicas=4)
    assert target == 4


def test_a_quiet_cluster_steps_down_one_replica_per_downscale_delay() -> None:
    scaler = Autoscaler(SLO, 4)
    # Nothing learned yet: a window of half the look-back (t=5) with no declines wants one
    # fewer, and the desire must hold 20 s.
    target, base = feed(scaler, 0.0, 25, decided_per_s=5, declined_per_s=0, held=4, replicas=4)
    assert target == 4
    target, base = feed(
        scaler, 25.0, 1, decided_per_s=5, declined_per_s=0, held=4, replicas=4, base=base
    )
    assert target == 3
    # The window restarts when the count does (t=26): the next step comes 25 s after.
    target, base = feed(
        scaler, 26.0, 25, decided_per_s=5, declined_per_s=0, held=4, replicas=3, base=base
    )
    assert target == 3
    target, _ = feed(
        scaler, 51.0, 1, decided_per_s=5, declined_per_s=0, held=4, replicas=3, base=base
    )
    assert target == 2


def test_the_learned_full_load_stops_a_removal_that_would_overload_the_rest() -> None:
    scaler = Autoscaler(SLO, 2)
    _, base = feed(scaler, 0.0, 6, decided_per_s=10, declined_per_s=3, held=12, replicas=2)
    assert scaler.target == 3 and scaler.full_load == pytest.approx(6.0)
    # 3 replicas hold 12 admitted, no declines: 2 would hold 6 each, above 0.8 x 6.
    target, base = feed(
        scaler, 6.0, 60, decided_per_s=10, declined_per_s=0, held=12, replicas=3, base=base
    )
    assert target == 3
    # At 6 admitted, 2 replicas would hold 3 each: below 4.8, so one goes.
    target, _ = feed(
        scaler, 66.0, 30, decided_per_s=10, declined_per_s=0, held=6, replicas=3, base=base
    )
    assert target == 2


def test_a_lone_decline_at_a_trickle_does_not_keep_a_replica_for_good() -> None:
    """Soak QA: one decline at 0.1 req/s (a loaded machine) taught a full replica 0.2
    admitted requests, the window's mean after it, and the second replica stayed as long as
    one request was held. Declines teach the load at their moment, above one a replica."""
    scaler = Autoscaler(dataclasses.replace(SLO, max_replicas=2), 2)
    _, base = feed(scaler, 0.0, 1, decided_per_s=2, declined_per_s=1, held=1, replicas=2)
    assert scaler.full_load is None  # half a request a replica: the SLO or the machine
    target, _ = feed(
        scaler, 1.0, 40, decided_per_s=1, declined_per_s=0, held=1, replicas=2, base=base
    )
    assert target == 1


def test_the_full_load_is_the_load_when_requests_were_declined() -> None:
    """Declines under a burst, then a quiet window: the quiet seconds after the last decline
    do not pull the learned load down."""
    scaler = Autoscaler(SLO, 2)
    _, base = feed(scaler, 0.0, 4, decided_per_s=10, declined_per_s=3, held=16, replicas=2)
    feed(scaler, 4.0, 9, decided_per_s=1, declined_per_s=0, held=2, replicas=2, base=base)
    assert scaler.full_load == pytest.approx(8.0)


def test_the_count_stays_within_its_bounds() -> None:
    bounded = AutoscaleConfig(min_replicas=2, max_replicas=3, upscale_delay_s=0.0)
    scaler = Autoscaler(bounded, 3)
    target, _ = feed(scaler, 0.0, 10, decided_per_s=10, declined_per_s=9, held=30, replicas=3)
    assert target == 3
    quiet = Autoscaler(AutoscaleConfig(min_replicas=2, max_replicas=3, downscale_delay_s=0.0), 2)
    target, _ = feed(quiet, 0.0, 60, decided_per_s=1, declined_per_s=0, held=0, replicas=2)
    assert target == 2
    assert Autoscaler(bounded, 9).target == 3


def test_ongoing_follows_ray_serves_rule() -> None:
    config = AutoscaleConfig(
        min_replicas=1,
        max_replicas=10,
        signal=ScaleSignal.ONGOING,
        target_ongoing_requests=4.0,
        look_back_s=10.0,
        upscale_delay_s=3.0,
        downscale_delay_s=3.0,
    )
    scaler = Autoscaler(config, 2)
    # 21 ongoing over 4 per replica: ceil(5.25) = 6, whatever declines there are (none).
    target, _ = feed(scaler, 0.0, 4, decided_per_s=0, declined_per_s=0, held=21, replicas=2)
    assert target == 6
    target, _ = feed(scaler, 4.0, 30, decided_per_s=0, declined_per_s=0, held=3, replicas=6)
    assert target == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": 0}, "autoscale.min_replicas must be >= 1, got 0"),
        ({"max_replicas": 2.5}, "autoscale.max_replicas must be an integer, got 2.5"),
        ({"max_replicas": "4"}, "autoscale.max_replicas must be an integer, got '4'"),
        ({"min_replicas": 3, "max_replicas": 2}, r"max_replicas \(2\) must be >= min_replicas"),
        ({"signal": "queue"}, "autoscale.signal must be one of slo, ongoing, got 'queue'"),
        ({"look_back_s": 0.0}, "autoscale.look_back_s must be finite and > 0"),
        ({"look_back_s": "30"}, "autoscale.look_back_s must be a number, got '30'"),
        ({"upscale_delay_s": -1.0}, "autoscale.upscale_delay_s must be finite and >= 0, got -1"),
        ({"downscale_delay_s": float("inf")}, "autoscale.downscale_delay_s must be finite and "),
        ({"downscale_delay_s": "5"}, "autoscale.downscale_delay_s must be a number, got '5'"),
        ({"max_declined": 1.0}, r"autoscale.max_declined must be in \[0, 1\)"),
        ({"max_declined": None}, "autoscale.max_declined must be a finite number, got None"),
        ({"headroom": 0.0}, "autoscale.headroom must be finite and > 0"),
        ({"headroom": 1.5}, r"autoscale.headroom must be in \(0, 1\]"),
        ({"target_ongoing_requests": 0.0}, "autoscale.target_ongoing_requests must be finite"),
        ({"target_ongoing_requests": float("inf")}, "autoscale.target_ongoing_requests must"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscaleConfig(**kwargs)  # type: ignore[arg-type]
