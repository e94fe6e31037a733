"""An autoscaled cluster on a local Ray instance: load starts a second replica, which serves;
when the load is gone it drains and stops, its name freed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest
import ray

from cluster.api import ClusterStatus, FinalRecord
from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle
from cluster.names import replica_name
from replica.engine import Engine
from replica.request import Request, SamplingParams, Tier
from tests.cluster.conftest import (
    collect,
    greedy_reference,
    launched,
    one_request_a_replica,
    status_until,
)

pytestmark = pytest.mark.timeout(240)

PROMPT = [21, 305, 17, 44, 9]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> Iterator[ClusterHandle]:
    """One replica at the start, up to two, with short delays so the test sees both
    directions."""
    scale = one_request_a_replica(downscale_delay_s=2.0)
    yield from launched(runner, replace(demo, num_kv_blocks=256, replicas=1, autoscale=scale))


def request(rid: str) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=MAX_TOKENS), tier=Tier.BEST_EFFORT)


def up(status: ClusterStatus) -> list[int]:
    return [r.replica for r in status.replicas if r.alive and not r.draining]


def name_free(index: int) -> bool:
    try:
        ray.get_actor(replica_name(index))
    except ValueError:
        return True
    return False


def test_load_starts_a_replica_that_serves_then_drains_and_stops(
    cluster: ClusterHandle, runner: asyncio.Runner, engine: Engine
) -> None:
    expected = greedy_reference(engine, "autoscale-reference", PROMPT, MAX_TOKENS)

    async def run() -> tuple[list[FinalRecord], ClusterStatus]:
        first = await cluster.status()
        assert (first.target_replicas, up(first), first.starting) == (1, [0], 0)
        results: list[tuple[list[int], FinalRecord]] = []
        tasks: set[asyncio.Task[None]] = set()

        async def one(rid: str) -> None:
            results.append(await collect(cluster.submit(request(rid))))

        # Traffic of several requests at once keeps more than one ongoing until the second
        # replica is up, then a while longer so that it takes some.
        scaled = first
        for i in range(2000):
            tasks.add(asyncio.create_task(one(f"as-{i}")))
            tasks = {t for t in tasks if not t.done()}
            await asyncio.sleep(0.05)
            if i % 10 == 0:
                scaled = await cluster.status()
                if len(up(scaled)) == 2:
                    break
        assert up(scaled) == [0, 1] and scaled.target_replicas == 2
        for i in range(12):
            tasks.add(asyncio.create_task(one(f"after-{i}")))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        # No load: the count goes back to 1 and one replica drains, then stops.
        settled = await status_until(
            cluster, lambda s: s.target_replicas == 1 and len(s.replicas) == 1, 300, 0.1
        )
        finals = [final for _, final in results]
        for tokens, final in results:
            assert tokens == expected, final.request_id
        return finals, settled

    finals, settled = runner.run(run())
    assert all(f.verdict.value == "best_effort" and f.finish_reason == "length" for f in finals)
    assert {f.replica for f in finals if f.request_id.startswith("after-")} == {0, 1}
    (left,) = settled.replicas
    gone = 1 - left.replica
    assert left.alive and not left.draining and settled.starting == 0
    assert name_free(gone) and not name_free(left.replica)
    # Served after the scale-down, by the replica left.
    tokens, final = runner.run(collect(cluster.submit(request("after-down"))))
    assert tokens == expected and final.replica == left.replica
