"""Replicas split over tensor-parallel groups of two Ray actors (gloo on 127.0.0.1): they serve
the whole model's greedy tokens while speculating, and losing a rank restarts its replica
with a new group while its requests resume on the other replica, none lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle
from cluster.replica_actor import worker_name
from replica.engine import Engine
from tests.cluster.conftest import (
    all_alive,
    greedy_reference,
    launched,
    status_until,
    write_profile,
)
from tests.cluster.test_cluster_faults import holder, prompts, stream_with_hook

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tp_cluster(
    ray_session: None,
    runner: asyncio.Runner,
    target_dir: Path,
    draft_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterHandle]:
    """Two replicas of the demo pair, each target over two ranks (half a CPU each)."""
    config = ClusterConfig(
        model=str(target_dir),
        draft=str(draft_dir),
        profile=str(write_profile(tmp_path_factory.mktemp("tp2") / "synthetic.json", tp=2)),
        num_kv_blocks=256,
        replicas=2,
        tensor_parallel_size=2,
        num_cpus_per_replica=1.0,
    )
    yield from launched(runner, config)


def test_a_split_replica_serves_the_whole_models_tokens_and_survives_a_lost_rank(
    tp_cluster: ClusterHandle, runner: asyncio.Runner, engine: Engine
) -> None:
    reqs = prompts("tp")

    async def run(kill: bool) -> list[tuple[list[int], object]]:
        started = {rid: asyncio.Event() for rid in reqs}
        tasks = [
            asyncio.ensure_future(
                stream_with_hook(tp_cluster, f"{rid}-{kill}", p, started[rid], MAX_TOKENS)
            )
            for rid, p in reqs.items()
        ]
        if kill:
            await asyncio.wait_for(started[next(iter(reqs))].wait(), 60)
            victim = await holder(tp_cluster, f"{next(iter(reqs))}-{kill}")
            prefix = worker_name(victim, 1, 0).removesuffix("0")
            (name,) = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
            ray.kill(ray.get_actor(name))
        return list(await asyncio.gather(*tasks))

    for kill in (False, True):
        results = runner.run(run(kill))
        for (rid, prompt), (tokens, final) in zip(reqs.items(), results, strict=True):
            want = greedy_reference(engine, f"{rid}-{kill}", prompt, MAX_TOKENS)
            assert tokens == want, (rid, kill)
            assert final.num_output_tokens == len(tokens)  # type: ignore[attr-defined]

    async def back() -> bool:
        return all_alive(await status_until(tp_cluster, all_alive, 240, 0.25))

    assert runner.run(back()), "the replica did not come back with a new group"
    assert runner.run(tp_cluster.status()).counters["migrated"] >= 1
