"""A cluster whose replicas plan with the Sarathi baseline: everything is admitted round-robin,
streams stay whole (also across a replica's death) and the text is the engine's own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.api import ClusterStatus, FinalRecord, Verdict
from cluster.config import ClusterConfig, SchedulerKind, TierConfig
from cluster.handle import ClusterHandle
from cluster.messages import ReplicaSnapshot
from replica.engine import Engine
from replica.request import SLO, Request, SamplingParams
from tests.cluster.conftest import all_alive, collect, greedy_reference, launched, status_until

pytestmark = pytest.mark.timeout(180)

TIGHT = SLO(ttft_ms=1500, tpot_ms=100)
"""The slos planner fits one such request per replica on the synthetic profile."""
MAX_TOKENS = 24
VICTIM_TOKENS = 480


@pytest.fixture(scope="module")
def sarathi(
    ray_session: None, runner: asyncio.Runner, target_dir: Path, profile_path: Path
) -> Iterator[ClusterHandle]:
    """Two replicas of the demo target without a draft. The tier's 500 ms TPOT fits an
    11-token step on the synthetic profile (50 ms + 40 ms per token): prompts are chunked."""
    config = ClusterConfig(
        model=str(target_dir),
        scheduler=SchedulerKind.SARATHI,
        spec_policy="none",
        tiers=(TierConfig("chat", ttft_ms=3000, tpot_ms=500),),
        profile=str(profile_path),
        num_kv_blocks=256,
    )
    yield from launched(runner, config)


def prompt(i: int) -> list[int]:
    return [17 + i, 250 + 9 * i, 33, 480 + i, 7, 60 + i, 91, 3 * i + 2, 128, 44, 19, 300 - i, 5]


def index(rid: str) -> int:
    return int(rid.split("-")[1])


async def stream_tight(
    cluster: ClusterHandle,
    rid: str,
    tokens_seen: asyncio.Event | None = None,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[int], FinalRecord]:
    """Stream one tight request; set `tokens_seen` once a few tokens arrived."""
    req = Request(rid, prompt(index(rid)), SamplingParams(max_tokens=max_tokens), slo=TIGHT)
    return await collect(cluster.submit(req), tokens_seen)


def test_every_request_is_admitted_round_robin_with_the_engine_text(
    sarathi: ClusterHandle, runner: asyncio.Runner, engine: Engine
) -> None:
    rids = [f"s-{i}" for i in range(4)]

    async def run() -> list[tuple[list[int], FinalRecord]]:
        return list(await asyncio.gather(*(stream_tight(sarathi, rid) for rid in rids)))

    results = runner.run(run())
    for rid, (tokens, final) in zip(rids, results, strict=True):
        assert tokens == greedy_reference(engine, rid, prompt(index(rid)), MAX_TOKENS), rid
        assert final.verdict is Verdict.ADMITTED and final.hops == 1
        assert final.finish_reason in ("length", "stop")
        assert final.num_output_tokens == len(tokens)
    assert sorted(final.replica or 0 for _, final in results) == [0, 0, 1, 1]
    status = runner.run(sarathi.status())
    assert status.scheduler == "sarathi"
    assert status.counters.get("admitted") == 4 and "routed" not in status.counters


def test_killed_replica_streams_resume_elsewhere(
    sarathi: ClusterHandle, runner: asyncio.Runner, engine: Engine
) -> None:
    rids = [f"k-{i}" for i in range(2)]
    # The victim's request is long enough to be mid-stream when its replica dies, however
    # slowly the kill follows its first tokens on a loaded machine.
    lengths = [VICTIM_TOKENS, MAX_TOKENS]

    async def run() -> list[tuple[list[int], FinalRecord]]:
        seen = asyncio.Event()
        tasks = [asyncio.ensure_future(stream_tight(sarathi, rids[0], seen, VICTIM_TOKENS))]
        tasks.append(asyncio.ensure_future(stream_tight(sarathi, rids[1])))
        await asyncio.wait_for(seen.wait(), 60)
        snaps: list[ReplicaSnapshot] = await asyncio.gather(
            *(r.snapshot.remote() for r in sarathi.replicas)
        )
        victim = next(
            s.replica for s in snaps if any(h.request.request_id == rids[0] for h in s.requests)
        )
        ray.kill(sarathi.replicas[victim], no_restart=False)
        return list(await asyncio.gather(*tasks))

    results = runner.run(run())
    for rid, n, (tokens, final) in zip(rids, lengths, results, strict=True):
        assert tokens == greedy_reference(engine, rid, prompt(index(rid)), n), rid
        assert final.finish_reason in ("length", "stop")
    assert results[0][1].migrations > 0

    def empty(status: ClusterStatus) -> bool:
        """Every replica up and holding nothing: the step reports of the last tokens the
        clients already have may reach the controller a moment after them."""
        idle = all(r.admitted == 0 and r.running == 0 for r in status.replicas)
        return all_alive(status) and idle

    async def rejoined() -> bool:
        return empty(await status_until(sarathi, empty, 240, 0.25))

    assert runner.run(rejoined()), "the killed replica did not rejoin empty after its restart"
