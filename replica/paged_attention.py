"""The C paged-attention kernel for decode and verify rows on CPU, built on first use.

SDPA needs each request's context as one dense tensor, so the pure-torch path copies every
decode row's keys and values out of the paged pool before attending: at batch 32 that copy
was half of the step. The kernel (kernels/paged_attention.c) reads the pool in place through
the block tables. It is compiled with the system C compiler into a per-user cache keyed by
the source, the flags and the CPU's feature flags (the build uses -march=native), and loaded
with ctypes. Without a compiler, or with SLOS_SERVE_CPU_KERNEL=0, `load()` returns None and
the runner keeps the SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_attention.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
"""-ffast-math vectorizes expf and the reductions; it is given to the compile step only."""
LINK_FLAGS = ("-shared", "-fopenmp")
"""Linking with -ffast-math would add crtfastmath.o, whose constructor turns on flush-to-zero for
the whole process when the library loads, silently changing every other float computation."""
DISABLE_ENV = "SLOS_SERVE_CPU_KERNEL"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slos-serve" / "kernels"


def _build(compiler: str) -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(COMPILE_FLAGS + LINK_FLAGS).encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent replicas never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for command in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", obj],
            [compiler, *LINK_FLAGS, obj, "-o", tmp, "-lm"],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


class PagedAttentionKernel:
    """ctypes binding of the fp32 and bf16 entry points."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        args = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
        entries = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
        self._entry = {}
        for dtype, name in entries.items():
            fn = getattr(lib, name)
            fn.argtypes = [*args, ptr, i64]
            fn.restype = ctypes.c_int
            self._entry[dtype] = fn

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._entry

    def __call__(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        num_cached: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim] (contiguous) over `pool` (one layer, contiguous) for
        requests described by int32 tensors: block tables [requests, width], the first query
        row of each request in q, its query count and its cached length."""
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = pool.shape[-2]
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
        out = torch.empty_like(q)
        failed = self._entry[q.dtype](
            q.data_ptr(),
            pool.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            q_start.data_ptr(),
            q_len.data_ptr(),
            num_cached.data_ptr(),
            tables.shape[0],
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged attention kernel could not allocate its score buffer")
        return out


@functools.cache
def load() -> PagedAttentionKernel | None:
    """The kernel, or None when disabled or no C compiler can build it."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: CPU attention stays on SDPA")
        return None
    try:
        return PagedAttentionKernel(_build(compiler))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("paged attention kernel unavailable, CPU attention stays on SDPA: %s", detail)
        return None
