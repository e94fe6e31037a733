"""`router.app:build_app` under Ray Serve: the deployment entry point serves both doors."""

from __future__ import annotations

import socket
from pathlib import Path

import openai
import pytest

from router.app import build_app
from router.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_build_app_serves_http_and_grpc(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    from ray import serve

    from tests.cluster.conftest import write_profile

    http_port, grpc_port = free_port(), free_port()
    args = {
        "cluster": {
            "model": str(target_dir),
            "draft": str(draft_dir),
            "profile": str(write_profile(tmp_path / "profile.json")),
            "replicas": 1,
            "num_kv_blocks": 128,
        },
        "http": {"host": "127.0.0.1", "port": http_port},
        "grpc": {"port": grpc_port},
        "api_keys_file": None,
    }
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        serve.run(build_app(args), name="slos-serve", route_prefix="/")
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0)
        out = oai.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage is not None and 1 <= out.usage.completion_tokens <= 4
        with Client(f"127.0.0.1:{grpc_port}") as client:
            done = client.complete("Hello", max_tokens=4, temperature=0.0)
        assert done.text == out.choices[0].text
        assert done.result.verdict == "admitted"
    finally:
        serve.shutdown()
