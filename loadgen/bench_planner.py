"""`slos-serve bench planner`: planning latency of the SLOs-Serve scheduler.

For each case (new requests, running requests, TPOT tiers) a replica is brought to `running`
admitted requests mid-decode (by executing its own plans on the perf model), then timed over
many randomized calls: one admission decision over `new` fresh requests (budget choice + DP)
plus the formation of the next batch. Times are wall-clock, single-threaded Python; the
thread's CPU time is reported next to them because on a shared machine the wall-clock tail
mostly measures time slices lost to other processes (the load average is recorded too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from replica import compiled
from replica.arguments import non_negative_int, output_file, positive_int
from replica.perf_model import PerfModel
from replica.planner.base import CacheBudget
from replica.planner.config import InvocationConfig, PlannerConfig
from replica.planner.executor import PerfExecutor
from replica.planner.slos import SlosScheduler
from replica.profiles import load_profile
from replica.request import SLO, Request, SamplingParams

CASES: tuple[tuple[int, int, int], ...] = ((1, 32, 2), (10, 100, 2), (10, 200, 3), (50, 500, 3))
SUMMARY_CASE = (10, 200, 3)
TPOTS_S = (0.1, 0.15, 0.25)
"""Tiers loose enough that 500 decoders fit a 7B model's batch on an A100 (KV reads)."""
DEFAULT_PROFILE = (
    Path(__file__).resolve().parent.parent / "deploy/profiles/a100-40gb-opt-7b-tp1.json"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=output_file, help="write results here")
    parser.add_argument(
        "--profile", default=str(DEFAULT_PROFILE), help="perf profile: a path or a name"
    )
    parser.add_argument("--calls", type=positive_int, default=300, help="timed calls per case")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: few calls, small cases")


def _request(rng: random.Random, rid: str, now: float, tiers: int, ttft_s: float) -> Request:
    return Request(
        rid,
        [1] * rng.randint(16, 128),
        SamplingParams(max_tokens=rng.randint(16, 96), ignore_eos=True),
        SLO(ttft_ms=ttft_s * 1e3, tpot_ms=rng.choice(TPOTS_S[:tiers]) * 1e3),
        arrival_time=now,
    )


def _warm_replica(
    perf: PerfModel, running: int, tiers: int, rng: random.Random
) -> tuple[SlosScheduler, float]:
    """A replica with `running` admitted requests, all decoding; returns it and the time."""
    config = PlannerConfig(invocation=InvocationConfig(interval_s=3600.0, finished_requests=10**6))
    scheduler = SlosScheduler(perf, CacheBudget(num_blocks=200_000, block_size=16), config)
    executor = PerfExecutor(perf, scheduler.queues.budget)
    now = 0.0
    for i in range(running):
        request = _request(rng, f"run-{i}", now, tiers, ttft_s=60.0)
        executor.add(request)
        scheduler.add_admitted(request, now)
    while any(not s.is_decoding for s in scheduler.queues.states.values()):
        plan = scheduler.schedule(now)
        if plan is None:
            break
        outcome, duration = executor.execute(plan, now)
        now += duration
        scheduler.update_from_outcome(plan, outcome, now)
    return scheduler, now


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_case(
    perf: PerfModel, new: int, running: int, tiers: int, calls: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    scheduler, now = _warm_replica(perf, running, tiers, rng)
    samples_ms: list[float] = []
    cpu_ms: list[float] = []
    admitted = 0
    for call in range(calls):
        at = now + rng.uniform(0.0, 0.01)
        fresh = [
            _request(rng, f"new-{call}-{i}", at, tiers, ttft_s=rng.uniform(0.5, 3.0))
            for i in range(new)
        ]
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = scheduler.plan_admission(fresh, at)
        scheduler.schedule(at)
        samples_ms.append((time.perf_counter() - start) * 1e3)
        cpu_ms.append((time.thread_time() - start_cpu) * 1e3)
        admitted += len(result.admitted)
    return {
        "new": new,
        "running": running,
        "tiers": tiers,
        "calls": calls,
        "p50_ms": statistics.median(samples_ms),
        "p99_ms": _percentile(samples_ms, 0.99),
        "mean_ms": statistics.fmean(samples_ms),
        "max_ms": max(samples_ms),
        "cpu_p50_ms": statistics.median(cpu_ms),
        "cpu_p99_ms": _percentile(cpu_ms, 0.99),
        "admitted_fraction": admitted / max(1, new * calls),
    }


def run(args: argparse.Namespace) -> int:
    perf = load_profile("--profile", args.profile)
    calls = min(args.calls, 20) if args.quick else args.calls
    cases = CASES[:3] if args.quick else CASES
    results = []
    for new, running, tiers in cases:
        result = bench_case(perf, new, running, tiers, calls, args.seed)
        results.append(result)
        print(
            f"new={new:3d} running={running:4d} tiers={tiers}: "
            f"p50 {result['p50_ms']:.3f} ms  p99 {result['p99_ms']:.3f} ms  "
            f"(cpu p50 {result['cpu_p50_ms']:.3f} p99 {result['cpu_p99_ms']:.3f})  "
            f"admitted {result['admitted_fraction']:.0%}"
        )
    summary = next(r for r in results if (r["new"], r["running"], r["tiers"]) == SUMMARY_CASE)
    out = {
        "bench": "planner",
        "profile": str(args.profile),
        "quick": bool(args.quick),
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "compiled_planner": compiled.active(),
        "summary": {
            "case": list(SUMMARY_CASE),
            "p50_ms": summary["p50_ms"],
            "p99_ms": summary["p99_ms"],
        },
        "cases": results,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0
