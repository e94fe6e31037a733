"""A replica Ray will not restart (killed without restart here; a restart that fails in
`__init__` ends the same way) is replaced by the controller, and its streams finish there."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import ray

from cluster.api import FinalRecord
from cluster.config import ClusterConfig
from cluster.handle import launch
from cluster.names import NAMESPACE, replica_name
from replica.engine import Engine
from replica.request import SLO, Request, SamplingParams
from tests.cluster.conftest import all_alive, collect, greedy_reference, status_until

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 120


def test_a_replica_killed_for_good_is_replaced_and_its_streams_finish_on_the_new_one(
    ray_session: None, demo: ClusterConfig, engine: Engine
) -> None:
    """One replica, so the streams can only finish on its replacement. Detached, as under Ray
    Serve: the replacement outlives the controller that started it, so shutting the cluster
    down must find it by its slot's name (the front door never had its handle)."""
    config = replace(demo, replicas=1, num_kv_blocks=256)
    prompts = {f"gone-{i}": [40 + i, 300 + 11 * i, 77, 5 + i] for i in range(3)}

    async def run() -> list[tuple[list[int], FinalRecord]]:
        cluster = await launch(config, detached=True)
        try:
            started = {rid: asyncio.Event() for rid in prompts}
            tasks = [
                asyncio.ensure_future(
                    collect(
                        cluster.submit(
                            Request(rid, p, SamplingParams(max_tokens=MAX_TOKENS), SLO(5000, 1000))
                        ),
                        started[rid],
                    )
                )
                for rid, p in prompts.items()
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
            killed = cluster.replicas[0]
            ray.kill(killed, no_restart=True)
            results = list(await asyncio.gather(*tasks))
            status = await status_until(cluster, all_alive, 40, 0.25)
            assert all_alive(status) and status.counters["migrated"] >= len(prompts)
            assert ray.get_actor(replica_name(0), NAMESPACE) != killed
        finally:
            await cluster.shutdown()
        with pytest.raises(ValueError):
            ray.get_actor(replica_name(0), NAMESPACE)
        return results

    results = asyncio.run(run())
    for (rid, prompt), (tokens, final) in zip(prompts.items(), results, strict=True):
        assert tokens == greedy_reference(engine, rid, prompt, MAX_TOKENS), rid
        assert final.finish_reason == "length" and final.migrations >= 1
