"""A one-replica cluster with the reject backup policy: declined requests are refused with a
reason and a Retry-After; with the replica gone (and no arrival wait), submit raises
ClusterUnavailable with the same Retry-After. Its planning
tick is 5 s, so every verdict here comes from the pass the controller runs when a request
arrives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.api import ClusterUnavailable, FinalRecord, TokenChunk, Verdict
from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle
from cluster.routing import BackupPolicy
from replica.request import SLO, Request, SamplingParams
from tests.cluster.conftest import launched, status_until

pytestmark = pytest.mark.timeout(180)

TIGHT = SLO(ttft_ms=1500, tpot_ms=100)
TICK_MS = 5000.0


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, runner: asyncio.Runner, target_dir: Path, profile_path: Path
) -> Iterator[ClusterHandle]:
    config = ClusterConfig(
        model=str(target_dir),
        spec_policy="none",
        profile=str(profile_path),
        replicas=1,
        route_limit=1,
        backup_policy=BackupPolicy.REJECT,
        retry_after_s=2.5,
        num_kv_blocks=128,
        tick_interval_ms=TICK_MS,
        arrival_wait_s=0.0,
    )
    yield from launched(runner, config)


def tight(rid: str, max_tokens: int) -> Request:
    return Request(
        rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True), slo=TIGHT
    )


def test_full_cluster_rejects_with_reason_and_keeps_serving(
    cluster: ClusterHandle, runner: asyncio.Runner
) -> None:
    async def run() -> tuple[list[FinalRecord | TokenChunk], FinalRecord]:
        running = cluster.submit(tight("busy", 60))
        assert isinstance(await anext(running), TokenChunk)
        refused = [item async for item in cluster.submit(tight("refused", 4))]
        rest = [item async for item in running]
        assert isinstance(rest[-1], FinalRecord)
        return refused, rest[-1]

    started = time.monotonic()
    refused, busy = runner.run(run())
    assert time.monotonic() - started < TICK_MS / 1e3, "verdicts waited for the planning tick"
    assert len(refused) == 1
    record = refused[0]
    assert isinstance(record, FinalRecord)
    assert record.verdict is Verdict.REJECTED
    assert "SLO" in record.reason
    assert record.retry_after_s == 2.5
    assert record.num_output_tokens == 0 and record.finish_reason is None
    assert busy.verdict is Verdict.ADMITTED and busy.num_output_tokens == 60
    assert runner.run(cluster.status()).counters["rejected"] == 1


def test_submit_raises_cluster_unavailable_when_no_replica_is_up(
    cluster: ClusterHandle, runner: asyncio.Runner
) -> None:
    ray.kill(cluster.replicas[0], no_restart=True)

    async def run() -> None:
        await status_until(cluster, lambda s: not any(r.alive for r in s.replicas), 100, 0.1)
        with pytest.raises(ClusterUnavailable, match="no replica") as info:
            await anext(cluster.submit(tight("nowhere", 4)))
        assert info.value.retry_after_s == 2.5

    runner.run(run())
