"""The simulator with an autoscaler: replicas that start late, drain before they stop, and
the GPU time they cost."""

from __future__ import annotations

import pytest

from cluster.api import Verdict
from cluster.autoscale import AutoscaleConfig, ScaleSignal
from cluster.simulator import Policy, SimConfig, SimRequest, Simulator
from replica.perf_model import PerfModel
from replica.request import SLO, Request, SamplingParams

LINEAR = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})
"""A step takes 10 ms + 1 ms per query token."""


def sim_request(rid: str, prompt: int, arrival: float, output_len: int, slo: SLO) -> SimRequest:
    request = Request(rid, [0] * prompt, SamplingParams(max_tokens=output_len), slo)
    request.arrival_time = arrival
    return SimRequest(request, output_len)


def ongoing(target: float, max_replicas: int = 2) -> AutoscaleConfig:
    """Ray Serve's rule with no delays, over a one-second window."""
    return AutoscaleConfig(
        min_replicas=1,
        max_replicas=max_replicas,
        signal=ScaleSignal.ONGOING,
        target_ongoing_requests=target,
        look_back_s=1.0,
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
    )


def test_a_fixed_cluster_counts_every_replica_for_the_whole_run() -> None:
    requests = [sim_request("a", 10, 0.0, 3, SLO(1000.0, 100.0))]
    result = Simulator(LINEAR, requests, SimConfig(policy=Policy.VLLM, replicas=3)).run()
    assert result.replica_s == pytest.approx(3 * result.end_s)
    assert result.scaling == ()


def test_a_started_replica_takes_requests_only_once_up_and_stops_once_drained() -> None:
    # Ten long requests in the first second hold one replica: at the first evaluation (t=1)
    # 10 ongoing over 4 a replica wants 3, bounded to 2; the second starts then and is up at
    # t=2. The two requests of t=2.5 go one to each. Once the first ten are done, 2 ongoing
    # want 1 replica: the second (the later of two equally loaded) drains, finishing its
    # request, then stops; the first serves to the end.
    roomy = SLO(60_000.0, 1000.0)
    early = [sim_request(f"e{i}", 10, 0.1 * i, 200, roomy) for i in range(10)]
    late = [sim_request(f"l{i}", 10, 2.5 + 0.01 * i, 300, roomy) for i in range(2)]
    config = SimConfig(
        policy=Policy.VLLM, replicas=1, autoscale=ongoing(4.0), replica_startup_s=1.0
    )
    result = Simulator(LINEAR, early + late, config).run()
    where = {o.request_id: o.replica for o in result.outcomes}
    assert {where[f"e{i}"] for i in range(10)} == {0}
    assert (where["l0"], where["l1"]) == (1, 0)
    assert result.scaling[:3] == ((0.0, 1, 1), (1.0, 2, 1), (2.0, 2, 2))
    (drain_at, *draining), (stop_at, *stopped) = result.scaling[3:]
    assert (draining, stopped) == ([2, 1], [1, 1])
    last_early = max(o.token_times_s[-1] for o in result.outcomes if o.request_id[0] == "e")
    l0_end = next(o.token_times_s[-1] for o in result.outcomes if o.request_id == "l0")
    assert last_early < drain_at < l0_end == stop_at < result.end_s
    assert result.replica_s == pytest.approx(result.end_s + (stop_at - 1.0))
    assert result.end_s == max(o.token_times_s[-1] for o in result.outcomes)
    assert all(o.verdict is Verdict.ADMITTED for o in result.outcomes)


def test_a_replica_stopped_while_it_starts_never_serves() -> None:
    # A burst wants 2 replicas at t=1; by t=2 it is over (one long request is left) and the
    # count goes back to 1 before the second is up (startup 5 s): it is stopped, having cost
    # its GPU one second.
    roomy = SLO(60_000.0, 1000.0)
    burst = [sim_request(f"b{i}", 10, 0.01 * i, 100, roomy) for i in range(8)]
    burst.append(sim_request("tail", 10, 1.5, 400, roomy))
    config = SimConfig(
        policy=Policy.VLLM, replicas=1, autoscale=ongoing(2.0), replica_startup_s=5.0
    )
    result = Simulator(LINEAR, burst, config).run()
    assert {o.replica for o in result.outcomes} == {0}
    (up_at, _, _), (down_at, running, routable) = result.scaling[1], result.scaling[2]
    assert (up_at, result.scaling[1][1:]) == (1.0, (2, 1))
    assert (down_at, running, routable) == (2.0, 1, 1) and len(result.scaling) == 3
    assert result.replica_s == pytest.approx(result.end_s + (down_at - 1.0))


def test_admission_declines_start_a_replica_that_then_admits() -> None:
    # slos: prompts of 400 tokens (0.41 s of prefill each) with a 1-s TTFT arrive 4 a second:
    # one replica admits about two a second and serves the rest best-effort. The declines
    # start a second replica, which admits from the time it is up.
    tight = SLO(1000.0, 100.0)
    requests = [sim_request(f"r{i}", 400, 0.25 * i, 4, tight) for i in range(40)]
    scale = AutoscaleConfig(min_replicas=1, max_replicas=2, look_back_s=2.0, upscale_delay_s=0.0)
    config = SimConfig(
        policy=Policy.SLOS_NOSPEC, replicas=1, autoscale=scale, replica_startup_s=1.0
    )
    result = Simulator(LINEAR, requests, config).run()
    up = next(t for t, _, routable in result.scaling if routable == 2)
    fixed = Simulator(LINEAR, requests, SimConfig(policy=Policy.SLOS_NOSPEC, replicas=1)).run()
    declined = sum(o.verdict is Verdict.BEST_EFFORT for o in result.outcomes)
    assert 0 < declined < sum(o.verdict is Verdict.BEST_EFFORT for o in fixed.outcomes)
    second = [o for o in result.outcomes if o.replica == 1]
    assert second and all(o.token_times_s[0] > up for o in second)
    assert any(o.verdict is Verdict.ADMITTED for o in second)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"policy": Policy.VLLM, "autoscale": AutoscaleConfig(max_replicas=2)},
            "autoscale signal slo follows admission's declines; vllm declines nothing",
        ),
        (
            {"policy": Policy.SLOS_NOADMIT, "autoscale": AutoscaleConfig(max_replicas=2)},
            "slos-noadmit declines nothing",
        ),
        (
            {"policy": Policy.DISTSERVE, "replicas": 2, "autoscale": ongoing(2.0, 4)},
            "distserve's pools are simulated at a fixed size",
        ),
        (
            {"replicas": 3, "autoscale": AutoscaleConfig(max_replicas=2)},
            r"replicas \(3\) must be within autoscale's bounds \[1, 2\]",
        ),
        (
            {"autoscale": AutoscaleConfig(max_replicas=2), "replica_startup_s": -1.0},
            "replica_startup_s must be >= 0",
        ),
    ],
    ids=["vllm-slo", "noadmit-slo", "distserve", "bounds", "startup"],
)
def test_bad_autoscale_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)  # type: ignore[arg-type]


def test_a_cancelled_starts_event_does_not_bring_up_a_later_start() -> None:
    # The first start (t=1, due t=6) is stopped at t=2; the second wave starts the slot again
    # at t=4, due t=9: it is up at 9, not at the first start's 6.
    roomy = SLO(60_000.0, 1000.0)
    wave1 = [sim_request(f"a{i}", 10, 0.01 * i, 100, roomy) for i in range(8)]
    tail = [sim_request("tail", 10, 1.5, 900, roomy)]
    wave2 = [sim_request(f"b{i}", 10, 3.0 + 0.01 * i, 600, roomy) for i in range(8)]
    config = SimConfig(
        policy=Policy.VLLM, replicas=1, autoscale=ongoing(2.0), replica_startup_s=5.0
    )
    result = Simulator(LINEAR, wave1 + tail + wave2, config).run()
    assert result.scaling[:5] == (
        (0.0, 1, 1),
        (1.0, 2, 1),
        (2.0, 1, 1),
        (4.0, 2, 1),
        (9.0, 2, 2),
    )


def test_a_replica_started_again_keeps_its_first_lifes_counts() -> None:
    # Slot 1 serves the t=2.5 wave, drains and stops; the t=20 wave starts it again, from an
    # empty replica, and it serves the t=23 wave. Every decode of both lives is counted: one
    # per token after the first.
    roomy = SLO(60_000.0, 1000.0)
    early = [sim_request(f"e{i}", 10, 0.1 * i, 200, roomy) for i in range(10)]
    mid = [sim_request(f"m{i}", 10, 2.5 + 0.01 * i, 300, roomy) for i in range(2)]
    late = [sim_request(f"l{i}", 10, 20.0 + 0.01 * i, 300, roomy) for i in range(10)]
    later = [sim_request(f"n{i}", 10, 23.0 + 0.01 * i, 100, roomy) for i in range(2)]
    config = SimConfig(
        policy=Policy.VLLM, replicas=1, autoscale=ongoing(4.0), replica_startup_s=1.0
    )
    result = Simulator(LINEAR, early + mid + late + later, config).run()
    ups = [t for t, _, routable in result.scaling if routable == 2]
    assert len(ups) == 2 and ups[1] > 20.0  # up twice
    on_second = {o.request_id for o in result.outcomes if o.replica == 1}
    assert on_second & {"m0", "m1"} and on_second & {"n0", "n1"}
    decodes = sum(len(o.token_times_s) - 1 for o in result.outcomes)
    assert result.decode_steps == decodes


def test_slos_noadmit_drains_a_replica_only_once_its_queued_arrivals_ran() -> None:
    # slos-noadmit queues arrivals at their first hop until their KV fits; a replica drained
    # with arrivals still queued admits and finishes them before it stops.
    roomy = SLO(60_000.0, 1000.0)
    burst = [sim_request(f"b{i}", 600, 0.01 * i, 100, roomy) for i in range(12)]
    config = SimConfig(
        policy=Policy.SLOS_NOADMIT,
        replicas=2,
        num_kv_blocks=64,
        autoscale=ongoing(100.0),
        replica_startup_s=1.0,
    )
    result = Simulator(LINEAR, burst, config).run()
    drained_at = next(t for t, running, routable in result.scaling if running > routable)
    stopped_at = next(t for t, running, _ in result.scaling if t > drained_at and running == 1)
    last_on_one = max(o.token_times_s[-1] for o in result.outcomes if o.replica == 1)
    assert stopped_at == last_on_one
    assert result.replica_s == pytest.approx(result.end_s + stopped_at)
