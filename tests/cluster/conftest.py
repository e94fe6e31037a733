"""Fixtures of the cluster tests: a synthetic perf profile, and a cluster of the demo pair per
module on the session's Ray instance (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.api import ClusterStatus, FinalRecord, TokenChunk
from cluster.autoscale import AutoscaleConfig, ScaleSignal
from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle, launch
from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine
from replica.perf_model import PerfModel
from replica.request import Request, SamplingParams, Tier


def write_profile(
    path: Path,
    *,
    const: float = 0.05,
    tokens: float = 0.04,
    draft_steps: float = 0.05,
    tp: int = 1,
) -> Path:
    """A one-term profile with round numbers, so admission verdicts are predictable: with
    these defaults a replica holds one request of a 100 ms TPOT tier, not two."""
    model = PerfModel.synthetic(
        {"const": const, "tokens": tokens, "draft_steps": draft_steps},
        note="Synthetic coefficients for tests, not a measurement.",
        tp=tp,
    )
    model.save(path)
    return path


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_profile(tmp_path_factory.mktemp("profile") / "synthetic.json")


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    """One event loop per module: a cluster handle lives on the loop that launched it."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="session")
def demo(target_dir: Path, draft_dir: Path, profile_path: Path) -> ClusterConfig:
    """The demo pair on the synthetic profile (a test replaces what it needs)."""
    return ClusterConfig(model=str(target_dir), draft=str(draft_dir), profile=str(profile_path))


def one_request_a_replica(downscale_delay_s: float) -> AutoscaleConfig:
    """Up to two replicas under Ray Serve's rule at one request a replica, added at once."""
    return AutoscaleConfig(
        max_replicas=2,
        signal=ScaleSignal.ONGOING,
        target_ongoing_requests=1.0,
        look_back_s=1.0,
        upscale_delay_s=0.0,
        downscale_delay_s=downscale_delay_s,
    )


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> Iterator[ClusterHandle]:
    """Two replicas of the demo pair on the synthetic profile, shared by a test module."""
    yield from launched(runner, replace(demo, num_kv_blocks=256))


async def collect(
    stream: AsyncIterator[TokenChunk | FinalRecord], started: asyncio.Event | None = None
) -> tuple[list[int], FinalRecord]:
    """A request's tokens and its FinalRecord, as a client reads its stream; `started` is set
    once a few tokens arrived."""
    tokens: list[int] = []
    async for item in stream:
        if isinstance(item, TokenChunk):
            tokens.extend(item.token_ids)
            if started is not None and len(tokens) >= 3:
                started.set()
        else:
            return tokens, item
    raise AssertionError("the stream ended without a FinalRecord")


def launched(runner: asyncio.Runner, config: ClusterConfig) -> Iterator[ClusterHandle]:
    """A module fixture's cluster: launched on the module's event loop, shut down after it."""
    handle = runner.run(launch(config))
    yield handle
    runner.run(handle.shutdown())


@pytest.fixture(scope="module")
def engine(target_dir: Path) -> Engine:
    """The standalone engine whose greedy output the cluster must reproduce."""
    return Engine.from_dirs(target_dir, num_blocks=64)


def greedy_reference(
    engine: Engine, request_id: str, prompt: list[int], max_tokens: int
) -> list[int]:
    """The engine's own greedy output, without speculation or a scheduler."""
    engine.add_request(
        Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), tier=Tier.BEST_EFFORT)
    )
    engine.step(BatchPlan((PrefillChunk(request_id, len(prompt)),)))
    while engine.finish_reason(request_id) is None:
        engine.step(BatchPlan((DecodeStep(request_id),)))
    out = engine.output_token_ids(request_id)
    engine.abort(request_id)
    return out


def all_alive(status: ClusterStatus) -> bool:
    return all(r.alive for r in status.replicas)


async def status_until(
    cluster: ClusterHandle, done: Callable[[ClusterStatus], bool], tries: int, period_s: float
) -> ClusterStatus:
    """Poll the cluster's status until `done` holds or `tries` polls are spent; the last status
    either way, for the caller to assert on (the cluster changes asynchronously)."""
    for attempt in range(tries):
        status = await cluster.status()
        if done(status) or attempt == tries - 1:
            break
        await asyncio.sleep(period_s)
    return status
