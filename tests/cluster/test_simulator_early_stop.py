"""Early stop (SimConfig.stop_below): a run ends once it cannot reach the target, exactly the
runs that fail when run to the end, and never changes a run that passes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.simulator import Policy, SimConfig, Simulator
from loadgen import simulate
from loadgen.arrivals import poisson_arrivals
from loadgen.metrics import report
from loadgen.workloads import WorkloadConfig, WorkloadRequest, generate_workload
from loadgen.workloads import zero_load_ttft_from as zero_load
from replica.perf_model import PerfModel
from replica.profiles import resolve_profile

A100 = PerfModel.load(resolve_profile("a100-40gb-opt-7b-tp1"))


def workload(scenario: str, rate: float) -> list[WorkloadRequest]:
    config = WorkloadConfig(zero_load(A100))
    return generate_workload(scenario, poisson_arrivals(rate, 60, 2), config, 2)


@pytest.mark.parametrize("policy", [Policy.SLOS, Policy.VLLM, Policy.SARATHI, Policy.DISTSERVE])
@pytest.mark.parametrize(
    ("scenario", "rate"), [("chatbot", 3.0), ("chatbot", 14.0), ("coder", 40.0)]
)
def test_a_run_stops_early_exactly_when_it_fails(
    policy: Policy, scenario: str, rate: float
) -> None:
    requests = workload(scenario, rate)
    config = SimConfig(policy=policy, replicas=2, num_kv_blocks=2048)
    full = Simulator(A100, simulate.sim_requests(requests), config).run()
    attained = report(simulate.records(requests, full)).overall.attainment
    fast = Simulator(A100, simulate.sim_requests(requests), replace(config, stop_below=0.9)).run()
    if attained >= 0.9:
        assert fast.stopped is None
        assert (fast.outcomes, fast.steps, fast.end_s) == (full.outcomes, full.steps, full.end_s)
    else:
        assert fast.stopped is not None and fast.outcomes == ()
        assert fast.stopped.requests == 60
        # Only certain misses count: the bound holds the full run's attainment.
        assert attained <= fast.stopped.attainment_at_most < 0.9
        assert fast.steps <= full.steps and fast.end_s <= full.end_s


def test_an_overloaded_run_stops_long_before_its_end() -> None:
    requests = workload("chatbot", 40.0)
    config = SimConfig(policy=Policy.VLLM, replicas=1, num_kv_blocks=2048)
    full = Simulator(A100, simulate.sim_requests(requests), config).run()
    fast = Simulator(A100, simulate.sim_requests(requests), replace(config, stop_below=0.9)).run()
    assert fast.stopped is not None and fast.stopped.missed == 7  # 7 of 60: 53/60 < 0.9
    assert fast.steps < full.steps / 4


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_stop_below_must_be_a_fraction(value: float) -> None:
    with pytest.raises(ValueError, match="stop_below must be in"):
        SimConfig(stop_below=value)
