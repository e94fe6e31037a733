"""A request the model's context allows but a replica's KV cache cannot hold is refused at
the door by name (400 / INVALID_ARGUMENT), not failed as a server error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from router.client import Client, ClientError
from router.local import LocalFrontDoor
from tests.router.conftest import demo_door

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def small(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFrontDoor]:
    tmp = tmp_path_factory.mktemp("small")
    config = demo_door(target_dir, draft_dir, tmp, {"replicas": 1, "num_kv_blocks": 16})
    with LocalFrontDoor(config) as front:
        yield front


def test_more_tokens_than_a_replica_holds_is_a_named_400(small: LocalFrontDoor) -> None:
    body = {"model": "demo", "prompt": "def f(", "max_tokens": 500}
    url = small.http_url + "/v1/completions"
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "KV blocks" in error["message"]
    with Client(small.grpc_target) as client, pytest.raises(ClientError) as info:
        client.complete("def f(", max_tokens=500)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    fits = httpx.post(
        small.http_url + "/v1/completions", json={**body, "max_tokens": 8}, timeout=60
    )
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] >= 1
