"""Regenerates router/gen/ from proto/ with grpcio-tools: `python -m router.protogen`.

protoc names Python modules after the proto path (`slos_serve.v1`), which is not importable
from the repo root; the generated gRPC stub's one import of its messages is rewritten to
`router.gen.slos_serve.v1`. The proto tree is never a Python package (proto-plus owns `proto`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GEN_ROOT = ROOT / "router" / "gen"
PACKAGE = "slos_serve.v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules (with __init__.py files) under `out_dir`; returns them."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    relative = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *relative,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {relative}")
    written = sorted(p for p in out_dir.rglob("*") if p.is_file())
    for path in written:
        if path.name.endswith("_pb2_grpc.py"):
            text = path.read_text()
            path.write_text(
                text.replace(f"from {PACKAGE} import", f"from router.gen.{PACKAGE} import")
            )
    for folder in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text("")
            written.append(init)
    return sorted(written)


def regenerate() -> list[Path]:
    """Replace router/gen with freshly generated code."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        generate(fresh)
        shutil.rmtree(GEN_ROOT, ignore_errors=True)
        shutil.copytree(fresh, GEN_ROOT)
    return sorted(p for p in GEN_ROOT.rglob("*") if p.is_file())


if __name__ == "__main__":
    for written in regenerate():
        print(written.relative_to(ROOT))
