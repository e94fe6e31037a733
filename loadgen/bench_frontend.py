"""`slos-serve bench frontend`: what the front doors add on top of the in-process cluster API.

One local cluster of the demo pair, both doors on 127.0.0.1 (router.local: uvicorn and
grpc.aio on the cluster handle's event loop, no Ray Serve proxy). Latency: rounds of three
1-token greedy requests, one per path (in-process `ClusterHandle.submit`, HTTP
/v1/completions, gRPC Generate via the SDK), in rotating order; the added latency of a door is
its time minus the in-process time of the same round (paired, so drift of the shared machine
cancels). Throughput: closed-loop clients with `--concurrency` requests in flight for
`--duration` seconds per path; the client runs on the same 2-core machine, so the figure is a
lower bound of what the door sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import ray

from cluster.api import FinalRecord
from replica.arguments import output_file, positive_float, positive_int
from replica.request import Request, SamplingParams, Tier
from router.client import AsyncClient, Client
from router.config import FrontDoorConfig
from router.local import HOST, LocalFrontDoor

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Hello"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    demo = Path(os.environ.get("SLOS_DEMO_DIR", ROOT / "deploy" / "models"))
    parser.add_argument("--json", type=output_file, help="write results here")
    parser.add_argument("--target", type=Path, default=demo / "demo-target")
    parser.add_argument("--draft", type=Path, default=demo / "demo-draft")
    parser.add_argument("--profile", type=Path, help="perf profile (default: the cluster's)")
    parser.add_argument("--rounds", type=positive_int, default=200, help="latency rounds")
    parser.add_argument("--concurrency", type=positive_int, default=16)
    parser.add_argument(
        "--duration", type=positive_float, default=10.0, help="seconds per rate test"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 rounds, 2 s rates")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _config(args: argparse.Namespace) -> FrontDoorConfig:
    cluster: dict[str, Any] = {
        "model": str(args.target),
        "draft": str(args.draft),
        "replicas": 1,
        "spec_policy": "none",
    }
    if args.profile is not None:
        cluster["profile"] = str(args.profile)
    return FrontDoorConfig.from_args({"cluster": cluster, "http": {"port": 0}, "grpc": {"port": 0}})


def _request(front: LocalFrontDoor, prompt_ids: list[int]) -> Request:
    return Request(
        f"bench-{uuid.uuid4().hex}",
        prompt_ids,
        SamplingParams(max_tokens=1, temperature=0.0),
        slo=front.door.schema.default_slo,
        tier=Tier.SLO,
        arrival_time=time.time(),
    )


async def _direct_once(front: LocalFrontDoor, prompt_ids: list[int]) -> float:
    started = time.perf_counter()
    async for item in front.handle.submit(_request(front, prompt_ids)):
        if isinstance(item, FinalRecord):
            break
    return time.perf_counter() - started


def measure_latency(front: LocalFrontDoor, rounds: int) -> dict[str, list[float]]:
    prompt_ids = front.door.codec.encode(PROMPT)
    body = {"model": front.door.model_name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    samples: dict[str, list[float]] = {"direct": [], "http": [], "grpc": []}
    with (
        httpx.Client(base_url=front.http_url, timeout=60) as http,
        Client(front.grpc_target) as rpc,
    ):

        def http_once() -> float:
            started = time.perf_counter()
            http.post("/v1/completions", json=body).raise_for_status()
            return time.perf_counter() - started

        def grpc_once() -> float:
            started = time.perf_counter()
            rpc.complete(PROMPT, max_tokens=1, temperature=0.0)
            return time.perf_counter() - started

        paths: dict[str, Callable[[], float]] = {
            "direct": lambda: front.run(_direct_once(front, prompt_ids)),
            "http": http_once,
            "grpc": grpc_once,
        }
        order = list(paths)
        for path in order * 3:
            paths[path]()
        for i in range(rounds):
            for path in order[i % 3 :] + order[: i % 3]:
                samples[path].append(paths[path]())
    return samples


async def _closed_loop(
    once: Callable[[], Awaitable[None]], concurrency: int, duration: float
) -> float:
    done = 0
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await once()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


def measure_rates(front: LocalFrontDoor, concurrency: int, duration: float) -> dict[str, float]:
    prompt_ids = front.door.codec.encode(PROMPT)
    body = {"model": front.door.model_name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}

    async def direct_once() -> None:
        await _direct_once(front, prompt_ids)

    async def doors() -> dict[str, float]:
        limits = httpx.Limits(max_connections=concurrency)
        async with (
            httpx.AsyncClient(base_url=front.http_url, timeout=60, limits=limits) as http,
            AsyncClient(front.grpc_target) as rpc,
        ):

            async def http_once() -> None:
                (await http.post("/v1/completions", json=body)).raise_for_status()

            async def grpc_once() -> None:
                await rpc.complete(PROMPT, max_tokens=1, temperature=0.0)

            return {
                "http": await _closed_loop(http_once, concurrency, duration),
                "grpc": await _closed_loop(grpc_once, concurrency, duration),
            }

    direct = front.run(_closed_loop(direct_once, concurrency, duration), duration + 120)
    return {"direct": direct, **asyncio.run(doors())}


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(values, 0.5) * 1e3,
        "p99_ms": percentile(values, 0.99) * 1e3,
        "mean_ms": statistics.fmean(values) * 1e3,
    }


def run(args: argparse.Namespace) -> int:
    rounds = min(args.rounds, 20) if args.quick else args.rounds
    duration = min(args.duration, 2.0) if args.quick else args.duration
    if not ray.is_initialized():
        ray.init(include_dashboard=False, _node_ip_address=HOST, log_to_driver=False)
    with LocalFrontDoor(_config(args)) as front:
        samples = measure_latency(front, rounds)
        rates = measure_rates(front, args.concurrency, duration)
    added = {
        door: [a - b for a, b in zip(samples[door], samples["direct"], strict=True)]
        for door in ("http", "grpc")
    }
    paths = {name: _stats(values) for name, values in samples.items()}
    summary = {
        "direct_p50_ms": paths["direct"]["p50_ms"],
        "http_p50_added_ms": percentile(added["http"], 0.5) * 1e3,
        "http_p99_added_ms": percentile(added["http"], 0.99) * 1e3,
        "grpc_p50_added_ms": percentile(added["grpc"], 0.5) * 1e3,
        "grpc_p99_added_ms": percentile(added["grpc"], 0.99) * 1e3,
        "direct_max_rps": rates["direct"],
        "http_max_rps": rates["http"],
        "grpc_max_rps": rates["grpc"],
    }
    for name, value in summary.items():
        print(f"{name:>20s}: {value:9.2f}")
    out = {
        "bench": "frontend",
        "quick": bool(args.quick),
        "rounds": rounds,
        "concurrency": args.concurrency,
        "duration_s": duration,
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "summary": summary,
        "paths": paths,
        "rates_rps": rates,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0
