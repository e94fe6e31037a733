"""Detached clusters and front-door leases: a handle that stops renewing its lease (its process
died) has its requests ended, while other handles on the same cluster keep theirs; the last
handle to leave stops the cluster, unless it hands it over to the next (a Serve update); a
detached launch attaches to a running cluster of the same config without reloading a model, and
replaces one of another config once its doors have left."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import ray
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
from ray.experimental.internal_kv import _internal_kv_get
from ray.util.placement_group import get_placement_group, placement_group

from cluster.api import ClusterUnavailable, FinalRecord, TokenChunk
from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle, _cluster_names, _stop_running, launch
from cluster.names import replica_name
from replica.request import SLO, Request, SamplingParams
from tests.cluster.conftest import one_request_a_replica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def long_request(rid: str, max_tokens: int = 1500) -> Request:
    return Request(
        rid,
        [5, 6, 7, 8],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=SLO(ttft_ms=5000, tpot_ms=1000),
    )


async def incarnations(handle: ClusterHandle) -> list[str]:
    return list(await asyncio.gather(*(r.health.remote() for r in handle.replicas)))


async def _last(stream: AsyncIterator[TokenChunk | FinalRecord]) -> FinalRecord:
    items = [item async for item in stream]
    assert isinstance(items[-1], FinalRecord)
    return items[-1]


async def idle(handle: ClusterHandle, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status = await handle.status()
        if all(r.running == 0 and r.waiting == 0 for r in status.replicas):
            return True
        await asyncio.sleep(0.2)
    return False


def test_a_lapsed_lease_ends_only_its_own_requests(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    config = replace(demo, replicas=1, num_kv_blocks=256, door_lease_s=2.0)

    async def run() -> None:
        first = await launch(config, detached=True)
        loaded = await incarnations(first)
        second = await launch(config, detached=True)
        assert second.door_id != first.door_id
        assert await incarnations(second) == loaded  # attached: no model loaded again

        orphan = first.submit(long_request("orphan"))
        assert isinstance(await anext(orphan), TokenChunk)
        first._leaving.set()  # as if its process died: the lease is no longer renewed
        kept = second.submit(long_request("kept", 1000))
        orphaned, served = await asyncio.gather(_last(orphan), _last(kept))
        assert orphaned.finish_reason == "abort" and orphaned.num_output_tokens < 1500
        assert orphaned.reason == "its front door stopped renewing its lease (door_lease_s)"
        assert served.finish_reason == "length" and served.num_output_tokens == 1000
        assert await idle(second, 5.0)

        await first.shutdown()  # another handle holds the cluster: it keeps running
        assert (await _last(second.submit(long_request("after", 4)))).num_output_tokens == 4
        await second.shutdown()  # the last one stops it
        assert _cluster_names() == []

    runner.run(run())


def test_a_door_whose_event_loop_is_held_up_keeps_its_lease(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A door's loop held for longer than the lease (a burst of large bodies to parse) does
    not end its requests: the lease is renewed from a thread of its own."""
    config = replace(demo, replicas=1, num_kv_blocks=256, door_lease_s=2.0)

    async def run() -> None:
        door = await launch(config, detached=True)
        stream = door.submit(long_request("held"))
        assert isinstance(await anext(stream), TokenChunk)
        time.sleep(3 * config.door_lease_s)  # the loop runs nothing meanwhile
        final = await _last(stream)
        assert final.finish_reason == "length" and final.num_output_tokens == 1500
        await door.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_door_that_dies_while_the_controller_restarts_has_its_requests_ended(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """The restarted controller learns who reads each request from the doors' renewals; a
    request no door names within a lease belonged to a door that died meanwhile."""
    config = replace(demo, replicas=1, num_kv_blocks=256, door_lease_s=2.0)

    async def run() -> None:
        first = await launch(config, detached=True)
        second = await launch(config, detached=True)
        orphan = first.submit(long_request("unclaimed"))
        kept = second.submit(long_request("claimed", 600))
        for stream in (orphan, kept):
            assert isinstance(await anext(stream), TokenChunk)
        first._leaving.set()  # the door dies with the controller, before it can renew
        ray.kill(first._controller, no_restart=False)
        orphaned, served = await asyncio.gather(_last(orphan), _last(kept))
        assert orphaned.finish_reason == "abort" and orphaned.num_output_tokens < 1500
        assert orphaned.reason == "no front door claimed it after the controller restarted"
        assert served.finish_reason == "length" and served.num_output_tokens == 600
        await first.shutdown()
        await second.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_detached_launch_replaces_a_cluster_of_another_config(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    config = replace(demo, replicas=2, num_kv_blocks=128)

    async def run() -> None:
        old = await launch(config, detached=True)
        loaded = await incarnations(old)
        new = await launch(replace(config, replicas=1, num_kv_blocks=64), detached=True)
        assert await incarnations(new) != loaded[:1]
        assert sorted(_cluster_names()) == ["slos-serve-controller", "slos-serve-replica-0"]
        await old.shutdown()  # its controller is gone: it stops nothing, by name or otherwise
        assert sorted(_cluster_names()) == ["slos-serve-controller", "slos-serve-replica-0"]
        assert (await _last(new.submit(long_request("new", 4)))).num_output_tokens == 4
        await new.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_launch_of_a_config_ray_cannot_place_leaves_the_running_cluster_serving(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A Serve update asking for GPUs the Ray cluster lacks stopped the running cluster, then
    failed: every request got a 503 until the old config was deployed again."""
    config = replace(demo, replicas=1, num_kv_blocks=64)

    async def run() -> None:
        old = await launch(config, detached=True)
        loaded = await incarnations(old)
        with pytest.raises(ValueError, match="num_gpus_per_replica=1 but the Ray cluster has"):
            await launch(replace(config, num_gpus_per_replica=1), detached=True)
        began = time.monotonic()
        with pytest.raises(ValueError, match=r"has 0 GPU\(s\) after 2 s"):  # GPU nodes may join
            await launch(replace(config, num_gpus_per_replica=1, resource_wait_s=2), detached=True)
        assert time.monotonic() - began >= 2
        # The autoscaler is no longer asked for GPU nodes no replica will use.
        assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"0") == []
        assert await incarnations(old) == loaded
        assert (await _last(old.submit(long_request("kept", 4)))).num_output_tokens == 4
        await old.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_door_handing_over_leaves_the_cluster_to_the_next(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A Serve update: the old door leaves first, and the new one attaches without a reload."""
    config = replace(demo, replicas=1, num_kv_blocks=64, door_lease_s=2.0)

    async def run() -> None:
        old = await launch(config, detached=True)
        loaded = await incarnations(old)
        await old.shutdown(handover=True)
        assert sorted(_cluster_names()) == ["slos-serve-controller", "slos-serve-replica-0"]
        new = await launch(config, detached=True)
        assert await incarnations(new) == loaded  # attached: no model loaded again
        assert (await _last(new.submit(long_request("after", 4)))).num_output_tokens == 4
        await new.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_launch_of_another_config_waits_for_the_running_doors_to_leave(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A Serve update changing the cluster: the old door drains its streams on the old
    cluster, which the new door stops only once the old door has left."""
    config = replace(demo, replicas=1, num_kv_blocks=256, door_lease_s=2.0)

    async def run() -> None:
        old = await launch(config, detached=True)
        loaded = await incarnations(old)
        stream = old.submit(long_request("draining", 1000))
        assert isinstance(await anext(stream), TokenChunk)
        other = replace(config, num_kv_blocks=128)
        new = asyncio.create_task(launch(other, detached=True, drain_s=60.0))
        final = await _last(stream)
        assert final.finish_reason == "length" and final.num_output_tokens == 1000
        await asyncio.sleep(2 * config.door_lease_s)  # past a lease: the old door renews it
        assert not new.done()
        started = time.monotonic()
        await old.shutdown(handover=True)
        handle = await new
        assert time.monotonic() - started < 30.0
        assert await incarnations(handle) != loaded
        assert (await _last(handle.submit(long_request("after", 4)))).num_output_tokens == 4
        await handle.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_launch_of_another_config_stops_the_running_cluster_after_the_drain(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """An old door that never leaves (Serve's own drain outlived, a door hung) holds the
    update back only for the drain and a lease: then its cluster is stopped under it, and
    its stream ends saying so instead of hanging."""
    config = replace(demo, replicas=1, num_kv_blocks=256, door_lease_s=2.0)

    async def run() -> None:
        old = await launch(config, detached=True)
        loaded = await incarnations(old)
        stream = old.submit(long_request("held", 2000))
        assert isinstance(await anext(stream), TokenChunk)
        started = time.monotonic()
        other = replace(config, num_kv_blocks=128, door_lease_s=10.0)  # renewed on a loaded CI
        handle = await launch(other, detached=True, drain_s=1.0)
        waited = time.monotonic() - started
        assert 1.0 + config.door_lease_s <= waited < 150.0  # a launch under a loaded CI
        assert await incarnations(handle) != loaded
        with pytest.raises(ClusterUnavailable):
            await asyncio.wait_for(_last(stream), 30.0)
        assert (await _last(handle.submit(long_request("after", 4)))).num_output_tokens == 4
        await old.shutdown()
        await handle.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_replacing_a_cluster_frees_a_group_left_without_its_replica(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A launcher that died between reserving a GPU replica's group and starting the replica
    left a detached group: the next detached launch frees it before reserving its own."""
    name = replica_name(0)
    group = placement_group([{"CPU": 0.01}], name=name, lifetime="detached")
    ray.get(group.ready())
    runner.run(_stop_running(replace(demo, replicas=1)))
    with pytest.raises(ValueError, match="Failed to look up placement group"):
        get_placement_group(name)


def test_a_door_whose_cluster_is_closing_learns_it_at_its_next_renewal(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """What Serve's health check reads (router.app): the door is restarted, not left up."""
    config = replace(demo, replicas=1, num_kv_blocks=64, door_lease_s=2.0)

    async def run() -> None:
        door = await launch(config, detached=True)
        assert await door.controller.release.remote(door.door_id)  # the last door: closing
        assert not door.lease_refused
        await asyncio.sleep(config.door_lease_s / 4 + 0.5)
        assert door.lease_refused
        await door.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_an_autoscaled_cluster_is_attached_to_and_stopped_whole(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A door attaching to an autoscaled cluster gets the replicas its controller runs now,
    one the autoscaler started included; the last door stops that one too."""
    scale = one_request_a_replica(downscale_delay_s=600.0)
    config = replace(demo, replicas=1, num_kv_blocks=256, autoscale=scale)

    async def run() -> None:
        first = await launch(config, detached=True)
        streams = [first.submit(long_request(f"load-{i}", 400)) for i in range(3)]
        for stream in streams:
            assert isinstance(await anext(stream), TokenChunk)
        deadline = time.monotonic() + 120
        while len((await first.status()).replicas) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert [r.replica for r in (await first.status()).replicas] == [0, 1]
        second = await launch(config, detached=True)
        assert len(second.replicas) == 2  # the started one too, without a reload
        assert await incarnations(second) == [
            await r.health.remote() for r in (first.replicas[0], second.replicas[1])
        ]
        finals = await asyncio.gather(*(_last(s) for s in streams))
        assert all(f.num_output_tokens == 400 for f in finals)
        assert (await _last(second.submit(long_request("after", 4)))).num_output_tokens == 4
        await first.shutdown()
        await second.shutdown()
        assert _cluster_names() == []

    runner.run(run())


def test_a_door_whose_controller_is_dead_for_good_learns_it(
    ray_session: None, runner: asyncio.Runner, demo: ClusterConfig
) -> None:
    """A controller killed without restart (a door that replaced the cluster stopped it)
    leaves this door nothing to serve with: its renewals say so, for Serve's health check
    (router.app) to restart it."""
    config = replace(demo, replicas=1, num_kv_blocks=64, door_lease_s=2.0)

    async def run() -> None:
        door = await launch(config, detached=True)
        ray.kill(door.controller, no_restart=True)
        deadline = time.monotonic() + 30
        while not door.lease_refused and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert door.lease_refused
        await door.shutdown()
        await _stop_running(config)
        assert _cluster_names() == []

    runner.run(run())
