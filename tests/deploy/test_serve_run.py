"""`slos-serve serve deploy/serve-cpu.yaml` (what `make serve` runs: serve run, drained on
SIGTERM) starts a working cluster, and stops it without cutting a stream.

The only change to the shipped config is the ports (free ones, so the test never collides with
a running server); paths stay relative to the repo root, where `serve run` is started.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from loadgen import serve_process
from loadgen.serve_process import ServeCommand
from router.client import Client, Result
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def with_ports(config: dict, http_port: int, grpc_port: int) -> dict:  # type: ignore[type-arg]
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = grpc_port
    args = config["applications"][0]["args"]
    args["http"]["port"] = http_port
    args["grpc"]["port"] = grpc_port
    return config


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def slos_serve(config: Path, http_port: int, grpc_port: int) -> ServeCommand:
    """`slos-serve serve CONFIG` on a private Ray cluster."""
    return ServeCommand(
        config=config,
        health_url=f"http://127.0.0.1:{http_port}/health",
        ports=(("127.0.0.1", http_port), ("127.0.0.1", grpc_port)),
        log=config.with_suffix(".log"),
        cwd=ROOT,
        startup_timeout_s=START_TIMEOUT_S,
        argv=(str(Path(sys.executable).parent / "slos-serve"), "serve", "--address", "local"),
    )


@dataclass(frozen=True)
class Served:
    base: str
    grpc_target: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    http_port, grpc_port = free_port(), free_port()
    config = yaml.safe_load((ROOT / "deploy" / "serve-cpu.yaml").read_text())
    path = tmp_path_factory.mktemp("serve") / "serve-cpu.yaml"
    path.write_text(yaml.safe_dump(with_ports(config, http_port, grpc_port)))
    with serve_process.served(slos_serve(path, http_port, grpc_port)) as process:
        yield Served(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", process)


def test_an_application_that_fails_to_deploy_ends_the_process_naming_why(
    tmp_path: Path,
) -> None:
    """serve run went on running (120 s and more), serving 404s, after the front door refused
    to start open with a keys file holding no key: no process manager could tell."""
    http_port, grpc_port = free_port(), free_port()
    config = with_ports(
        yaml.safe_load((ROOT / "deploy" / "serve-cpu.yaml").read_text()), http_port, grpc_port
    )
    keys = tmp_path / "keys.txt"
    keys.write_text("# every key revoked\n")
    config["applications"][0]["args"]["api_keys_file"] = str(keys)
    path = tmp_path / "serve-bad.yaml"
    path.write_text(yaml.safe_dump(config))
    command = slos_serve(path, http_port, grpc_port)
    with (
        pytest.raises(serve_process.ServeError, match="exited with 1 before") as info,
        serve_process.served(command),
    ):
        pass
    assert "failed to deploy: ValueError: api_keys_file" in str(info.value)
    assert "holds no keys" in str(info.value)


def test_one_completion_through_http(served: Served) -> None:
    body = {
        "model": "demo",
        "prompt": "def fib(n):",
        "max_tokens": 8,
        "temperature": 0,
        "slo": {"ttft_ms": 2000, "tpot_ms": 200},
    }
    request = urllib.request.Request(
        served.base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
        out = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["text"]
    assert out["slos_serve"]["verdict"] in ("admitted", "best_effort")


def test_models_endpoint_names_the_demo(served: Served) -> None:
    status, payload = get(served.base + "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(payload)["data"]] == ["demo"]


def test_sigterm_stops_it_once_the_open_streams_ended(served: Served) -> None:
    """docker stop, systemd: an HTTP and a gRPC stream open at the signal both end whole,
    and so does one its client leaves unread for 65 s (serve.delete's own wait gave up at
    60 s, cutting it and skipping Serve's shutdown); then the process exits (the last test
    here: it stops the module's server)."""
    body = {"prompt": "def f(", "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = threading.Event()
    events: list[bytes] = []
    # No BDP probing: a 64 KiB window, which this stream's log-probabilities fill unread.
    channel = grpc.insecure_channel(served.grpc_target, options=[("grpc.http2.bdp_probe", 0)])
    held = pb_grpc.ServingStub(channel).Generate(
        pb.GenerateRequest(prompt="def h(", max_tokens=1500, ignore_eos=True, logprobs=20),
        timeout=300,
    )
    assert next(held).HasField("chunk")

    def over_http() -> None:
        request = urllib.request.Request(
            served.base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            for line in resp:
                events.append(line)
                started.set()

    reading = threading.Thread(target=over_http)
    reading.start()
    with Client(served.grpc_target, timeout_s=120) as client:
        stream = client.generate("def g(", max_tokens=400, ignore_eos=True)
        assert not isinstance(next(stream), Result)
        assert started.wait(60)
        served.process.send_signal(signal.SIGTERM)
        results = [item for item in stream if isinstance(item, Result)]
    reading.join(120)
    time.sleep(65)
    last = list(held)[-1]
    channel.close()
    assert last.HasField("final") and last.final.finish_reason == "length"
    assert [r.finish_reason for r in results] == ["length"]
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2:] == [b"data: [DONE]\n", b"\n"]
    assert served.process.wait(timeout=120) == 0
