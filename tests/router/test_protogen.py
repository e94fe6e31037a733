"""router/gen must be exactly what the current proto/ and grpcio-tools generate."""

from __future__ import annotations

from pathlib import Path

from router.protogen import GEN_ROOT, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path / "gen")
    expected = {p.relative_to(tmp_path / "gen"): p.read_bytes() for p in fresh}
    current = {
        p.relative_to(GEN_ROOT): p.read_bytes()
        for p in GEN_ROOT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(
        str(k) for k in expected.keys() | current.keys() if expected.get(k) != current.get(k)
    )
    assert not stale, f"router/gen is stale ({stale}); run: python -m router.protogen"


def test_stub_imports_messages_from_router_gen() -> None:
    from router.gen.slos_serve.v1 import serving_pb2, serving_pb2_grpc

    assert serving_pb2.DESCRIPTOR.name == "slos_serve/v1/serving.proto"
    assert serving_pb2_grpc.slos__serve_dot_v1_dot_serving__pb2 is serving_pb2
