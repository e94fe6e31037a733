"""`slos-serve bench controller`: routing and admission decisions per second, and Ray's cost.

Part 1 drives the controller's decision core (`cluster.control.ControlPlane`: 8 virtual
replicas, the router, the DP per replica per tick) against simulated replicas: each executes
its mirror's plans on `PerfExecutor`, with the perf model as the clock, and reports back like
a real replica. Requests arrive as a Poisson process. Throughput is decisions over the wall
time spent deciding (submit + ticks); the time spent folding reports and forming batches is
reported next to it, since the real controller does that work too. The thread's CPU time is
reported beside wall time: on a shared machine the difference is time slices lost to others.

Part 2 measures what the Ray hop adds: the same decision (submit, ticks until the verdict)
made in-process versus through a Ray actor call that hosts an identical control plane.

Each DP call costs about the same whatever it decides, so decisions per second fall as load
grows: more requests held per replica (a larger DP) and more declined ones taking hops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.control import ControlPlane, Decision
from cluster.controller import build_plane
from cluster.messages import StepReport
from cluster.replica_launch import start_actor
from replica.arguments import non_negative_int, output_file, positive_float, positive_int
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget
from replica.planner.executor import PerfExecutor
from replica.profiles import load_profile
from replica.request import SLO, Request, SamplingParams

DEFAULT_PROFILE = (
    Path(__file__).resolve().parent.parent / "deploy/profiles/a100-40gb-opt-7b-tp1.json"
)
TIERS_MS = ((600.0, 100.0), (1500.0, 150.0))
"""(TTFT, TPOT) of the two SLO tiers requests are drawn from."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=output_file, help="write results here")
    parser.add_argument(
        "--profile", default=str(DEFAULT_PROFILE), help="perf profile: a path or a name"
    )
    parser.add_argument("--replicas", type=positive_int, default=8)
    parser.add_argument("--requests", type=positive_int, default=2000, help="simulated arrivals")
    parser.add_argument(
        "--rates",
        type=positive_float,
        nargs="+",
        default=[80.0, 200.0, 400.0],
        help="arrival rates (cluster, per second); the summary reports the first",
    )
    parser.add_argument("--tick-ms", type=positive_float, default=10.0, help="planning tick period")
    parser.add_argument(
        "--ray-calls", type=positive_int, default=200, help="decisions timed via Ray"
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray-path measurement")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: few requests and calls")


def _config(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        model="simulated",
        draft="simulated-draft",
        replicas=args.replicas,
        profile=str(args.profile),
        tick_interval_ms=args.tick_ms,
        num_kv_blocks=4096,
    )


def _request(rng: random.Random, rid: str, arrival: float) -> Request:
    ttft, tpot = rng.choice(TIERS_MS)
    return Request(
        rid,
        [1] * rng.randint(32, 512),
        SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True),
        SLO(ttft_ms=ttft, tpot_ms=tpot),
        arrival_time=arrival,
    )


def _arrivals(rng: random.Random, count: int, rate: float) -> list[Request]:
    t = 0.0
    out = []
    for i in range(count):
        t += rng.expovariate(rate)
        out.append(_request(rng, f"r{i}", t))
    return out


class _SimReplica:
    """A replica whose engine is the perf model: runs its mirror's plans back to back."""

    def __init__(self, plane: ControlPlane, index: int, perf: PerfModel, cache: CacheBudget):
        self.vr = plane.replicas[index]
        self.executor = PerfExecutor(perf, cache)
        self.clock = 0.0

    def run_until(self, until: float) -> int:
        steps = 0
        while self.clock < until:
            plan = self.vr.next_plan(self.clock)
            if plan is None:
                self.clock = until
                break
            outcome, duration = self.executor.execute(plan, self.clock)
            self.clock += duration
            report = StepReport(self.vr.index, "", self.vr.seq + 1, plan, outcome, self.clock)
            self.vr.apply(report)
            steps += 1
        return steps


def simulate(args: argparse.Namespace, perf: PerfModel, rate: float) -> dict[str, Any]:
    plane = build_plane(_config(args))
    cache = CacheBudget(4096)
    sims = [_SimReplica(plane, i, perf, cache) for i in range(args.replicas)]
    pending = _arrivals(random.Random(args.seed), args.requests, rate)
    tick = args.tick_ms / 1e3
    decisions: list[Decision] = []
    decide_s = decide_cpu_s = execute_s = 0.0
    steps = 0
    now = 0.0
    nxt = 0
    while nxt < len(pending) or any(plane.num_pending(i) for i in range(args.replicas)):
        now += tick
        started = time.perf_counter()
        cpu_started = time.thread_time()
        while nxt < len(pending) and pending[nxt].arrival_time <= now:
            decision = plane.submit(pending[nxt], now)
            if decision is not None:
                decisions.append(decision)
            nxt += 1
        decided = plane.tick(now)
        decide_s += time.perf_counter() - started
        decide_cpu_s += time.thread_time() - cpu_started
        started = time.perf_counter()
        for decision in decided:
            replica = decision.binding.replica
            if replica is not None:
                sims[replica].executor.add(decision.request)
        steps += sum(sim.run_until(now) for sim in sims)
        execute_s += time.perf_counter() - started
        decisions.extend(decided)
    verdicts: dict[str, int] = {}
    for decision in decisions:
        key = str(decision.binding.verdict)
        verdicts[key] = verdicts.get(key, 0) + 1
    hops = [d.binding.hops for d in decisions]
    return {
        "rate": rate,
        "decisions": len(decisions),
        "decide_s": decide_s,
        "decisions_per_s": len(decisions) / decide_s if decide_s > 0 else 0.0,
        "decide_cpu_s": decide_cpu_s,
        "decisions_per_cpu_s": len(decisions) / decide_cpu_s if decide_cpu_s > 0 else 0.0,
        "report_and_plan_s": execute_s,
        "steps": steps,
        "simulated_s": now,
        "verdicts": verdicts,
        "mean_hops": statistics.fmean(hops) if hops else 0.0,
        "counters": dict(plane.metrics.counters),
    }


class DecisionHost:
    """A control plane behind one call per decision: the Ray path's unit of work."""

    def __init__(self, config: ClusterConfig) -> None:
        self.plane = build_plane(config)

    def decide(self, request: Request) -> Decision:
        return decide_once(self.plane, request)


def decide_once(plane: ControlPlane, request: Request) -> Decision:
    """Submit, tick until the verdict, then forget the request (the state stays steady)."""
    now = request.arrival_time
    decision = plane.submit(request, now)
    while decision is None:
        decision = next(
            (d for d in plane.tick(now) if d.request.request_id == request.request_id), None
        )
    plane.abort(request.request_id)
    return decision


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


def ray_overhead(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    config = _config(args)
    rng = random.Random(args.seed + 1)
    requests = [_request(rng, f"q{i}", 1.0 + i) for i in range(args.ray_calls)]
    local = DecisionHost(config)
    in_process = []
    for request in requests:
        started = time.perf_counter()
        local.decide(request)
        in_process.append(time.perf_counter() - started)
    host = start_actor(DecisionHost, config, num_cpus=0)

    async def timed() -> list[float]:
        await host.decide.remote(_request(rng, "warm", 0.5))
        out = []
        for request in requests:
            started = time.perf_counter()
            await host.decide.remote(request)
            out.append(time.perf_counter() - started)
        return out

    via_ray = asyncio.run(timed())
    ray.kill(host)
    local_p = _percentiles(in_process)
    ray_p = _percentiles(via_ray)
    return {
        "calls": len(requests),
        "in_process": local_p,
        "ray": ray_p,
        "added_p50_ms": ray_p["p50_ms"] - local_p["p50_ms"],
    }


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests = min(args.requests, 200)
        args.ray_calls = min(args.ray_calls, 20)
    perf = load_profile("--profile", args.profile)
    sims = [simulate(args, perf, rate) for rate in args.rates]
    out: dict[str, Any] = {
        "bench": "controller",
        "profile": str(args.profile),
        "replicas": args.replicas,
        "quick": args.quick,
        "load_average": list(os.getloadavg()),
        "simulations": sims,
        "summary": {
            "decisions_per_s": sims[0]["decisions_per_s"],
            "rate": sims[0]["rate"],
            "decisions_per_cpu_s": sims[0]["decisions_per_cpu_s"],
            "decisions_per_s_by_rate": {str(s["rate"]): s["decisions_per_s"] for s in sims},
        },
    }
    if not args.no_ray:
        overhead = ray_overhead(args)
        out["ray_path"] = overhead
        out["summary"]["ray_added_p50_ms"] = overhead["added_p50_ms"]
    print(json.dumps(out["summary"]))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
