"""`slos-serve simulate`: SLO attainment and serving capacity per policy, in simulation.

Generates a paper scenario's workload, runs it through `cluster.simulator` for each policy and
replica count, and judges the records with loadgen.metrics (deadline semantics). `--rate` is
requests per second per replica; `--capacity` searches the highest such rate with >= 90%
attainment (loadgen.capacity) and summarizes slos against the best baseline as a geometric
mean of capacity ratios. Arrivals: Poisson, or the scenario's Azure trace rescaled to the rate.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

from cluster.simulator import Policy, SimConfig, SimRequest, SimResult, Simulator
from loadgen.arrivals import poisson_arrivals, trace_arrivals
from loadgen.capacity import find_capacity
from loadgen.metrics import RunReport, report
from loadgen.records import RequestRecord, Verdict
from loadgen.traces import Trace, load_trace
from loadgen.workloads import (
    TRACE_FILES,
    Scenario,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    zero_load_ttft_from,
)
from replica.perf_model import PerfModel

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "deploy" / "profiles"
TRACE_DIR = ROOT.parent / "shared" / "data" / "azure-llm-inference-2023"
BASELINES = (Policy.VLLM, Policy.SARATHI)


@cache
def scenario_trace(scenario: Scenario) -> Trace:
    """The scenario's Azure trace, parsed once per process (a capacity search replays it often)."""
    return load_trace(TRACE_DIR / TRACE_FILES[scenario])


def resolve_profile(name: str) -> Path:
    """A profile path, or a name in deploy/profiles (with or without .json)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = PROFILES / (name if name.endswith(".json") else f"{name}.json")
    if shipped.is_file():
        return shipped
    known = sorted(p.stem for p in PROFILES.glob("*.json"))
    raise ValueError(f"profile {name!r} is neither a file nor one of {known}")


def kv_blocks(perf: PerfModel, default: int, block_size: int = 16) -> int:
    """KV blocks per replica: the profile's `kv_capacity_tokens` assumption when it has one."""
    tokens = perf.info.assumptions.get("kv_capacity_tokens")
    return int(tokens) // block_size if isinstance(tokens, int | float) else default


def sim_requests(workload: Sequence[WorkloadRequest]) -> list[SimRequest]:
    """The cluster's view (max_tokens only) plus the engine's truth (output_len)."""
    return [
        SimRequest(
            w.to_request([0] * w.prompt_len, arrival_time=w.arrival_s),
            w.output_len,
            w.follows,
            w.delay_s,
        )
        for w in workload
    ]


def records(workload: Sequence[WorkloadRequest], result: SimResult) -> list[RequestRecord]:
    out = []
    for w, o in zip(workload, result.outcomes, strict=True):
        out.append(
            RequestRecord.for_request(
                w,
                verdict=Verdict(o.verdict.value),
                token_times_s=o.token_times_s,
                arrival_s=o.arrival_s,
                replica=None if o.replica is None else str(o.replica),
                hops=max(0, o.hops - 1),
            )
        )
    return out


def simulate_workload(
    perf: PerfModel, workload: Sequence[WorkloadRequest], config: SimConfig
) -> tuple[RunReport, SimResult, list[RequestRecord]]:
    """Run a workload and judge it: the report, the raw result, the per-request records."""
    result = Simulator(perf, sim_requests(workload), config).run()
    recs = records(workload, result)
    return report(recs), result, recs


@dataclass(frozen=True)
class Setup:
    """Everything fixed across the rates of one search."""

    perf: PerfModel
    scenario: Scenario
    arrivals: str
    duration_s: float
    seed: int
    num_kv_blocks: int
    tick_interval_s: float
    route_limit: int

    def workload(self, rate: float, replicas: int) -> list[WorkloadRequest]:
        """Requests of a `duration_s` run at `rate` per replica."""
        cluster_rate = rate * replicas
        n = max(2, round(cluster_rate * self.duration_s))
        config = WorkloadConfig(zero_load_ttft_from(self.perf))
        if self.arrivals == "trace":
            rows = trace_arrivals(scenario_trace(self.scenario), cluster_rate, n, self.seed)
            times = [r.time_s for r in rows]
        else:
            times = list(poisson_arrivals(cluster_rate, n, self.seed))
        return generate_workload(self.scenario, times, config, self.seed)

    def run(self, policy: Policy, replicas: int, rate: float) -> tuple[RunReport, SimResult]:
        config = SimConfig(
            policy=policy,
            replicas=replicas,
            num_kv_blocks=self.num_kv_blocks,
            tick_interval_s=self.tick_interval_s,
            route_limit=self.route_limit,
        )
        run_report, result, _ = simulate_workload(self.perf, self.workload(rate, replicas), config)
        return run_report, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="a100-40gb-opt-7b-tp1", help="name or path")
    parser.add_argument(
        "--scenario", default="chatbot", help=f"comma list of {[s.value for s in Scenario]}"
    )
    parser.add_argument("--policies", default="slos,vllm,sarathi", help="comma list")
    parser.add_argument("--replicas", default="1", help="comma list of replica counts")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="requests per second per replica")
    mode.add_argument("--capacity", action="store_true", help="search the capacity per policy")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    parser.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson")
    parser.add_argument("--start-rate", type=float, default=1.0, help="capacity search start")
    parser.add_argument("--rel-tol", type=float, default=0.05, help="capacity search tolerance")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="if the profile has none")
    parser.add_argument("--tick-ms", type=float, default=10.0)
    parser.add_argument("--route-limit", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def capacity_ratio_geomean(capacity: dict[str, dict[str, dict[str, float]]]) -> float | None:
    """Geometric mean over (scenario, replicas) of slos / max(vllm, sarathi) capacity; None
    when no pair has slos and a non-zero baseline."""
    ratios = []
    for by_policy in capacity.values():
        for replicas, slos in by_policy.get(Policy.SLOS.value, {}).items():
            best = max(by_policy.get(b.value, {}).get(replicas, 0.0) for b in BASELINES)
            if best > 0 and slos > 0:
                ratios.append(slos / best)
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def run(args: argparse.Namespace) -> int:
    perf = PerfModel.load(resolve_profile(args.profile))
    scenarios = [Scenario(s) for s in _split(args.scenario)]
    policies = [Policy(p) for p in _split(args.policies)]
    replica_counts = [int(n) for n in _split(args.replicas)]
    runs: list[dict[str, Any]] = []
    capacity: dict[str, dict[str, dict[str, float]]] = {}
    searches: list[dict[str, Any]] = []
    print(f"{'scenario':<11}{'policy':<9}{'replicas':>8}{'rate/rep':>10}{'attain':>8}{'wall s':>8}")
    for scenario in scenarios:
        setup = Setup(
            perf,
            scenario,
            args.arrivals,
            args.duration,
            args.seed,
            kv_blocks(perf, args.kv_blocks),
            args.tick_ms / 1e3,
            args.route_limit,
        )
        for policy in policies:
            for n in replica_counts:
                attainment = partial(_evaluate, setup, policy, n, runs)
                if not args.capacity:
                    attainment(args.rate)
                    continue
                found = find_capacity(attainment, args.start_rate, rel_tol=args.rel_tol)
                capacity.setdefault(scenario.value, {}).setdefault(policy.value, {})[str(n)] = (
                    found.capacity
                )
                searches.append(
                    {
                        "scenario": scenario.value,
                        "policy": policy.value,
                        "replicas": n,
                        **found.to_dict(),
                    }
                )
                print(f"  capacity {scenario.value} {policy.value} x{n}: {found.capacity:.3f}")
    out: dict[str, Any] = {
        "profile": str(args.profile),
        "arrivals": args.arrivals,
        "duration_s": args.duration,
        "seed": args.seed,
        "runs": runs,
    }
    if args.capacity:
        out["capacity_searches"] = searches
        out["summary"] = {
            "capacity": capacity,
            "capacity_ratio_geomean": capacity_ratio_geomean(capacity),
        }
        print(json.dumps(out["summary"]))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _evaluate(
    setup: Setup, policy: Policy, replicas: int, runs: list[dict[str, Any]], rate: float
) -> float:
    """Attainment at one rate; the run is printed and appended to `runs`."""
    run_report, result = setup.run(policy, replicas, rate)
    attainment = run_report.overall.attainment
    print(
        f"{setup.scenario.value:<11}{policy.value:<9}{replicas:>8}{rate:>10.3f}"
        f"{attainment:>8.3f}{result.wall_s:>8.1f}"
    )
    runs.append(
        {
            "scenario": setup.scenario.value,
            "policy": policy.value,
            "replicas": replicas,
            "rate_per_replica": rate,
            "attainment": attainment,
            "paper_attainment": run_report.overall.paper_attainment,
            "steps": result.steps,
            "simulated_s": result.end_s,
            "wall_s": result.wall_s,
            "report": run_report.to_dict(),
        }
    )
    return attainment


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
