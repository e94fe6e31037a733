"""The C kernels for decode and verify batches on CPU, built on first use.

- Paged attention (kernels/paged_attention.c): SDPA needs each request's context as one dense
  tensor, so the pure-torch path copies every decode row's keys and values out of the paged
  pool before attending (at batch 32 that copy was half of the step); the kernel reads the
  pool in place through the block tables.
- The fused forward (kernels/decode_forward.c): every layer of a batch of few tokens in one
  call, because at batch 1 PyTorch's per-op cost, not arithmetic, set the step time.

One library holds both. It is compiled with the system C compiler into a per-user cache keyed
by the sources, the flags and the CPU's feature flags (the build uses -march=native), and
loaded with ctypes. Without a compiler, or with SLOS_SERVE_CPU_KERNEL=0, `load()` returns None
and the runner keeps its PyTorch paths.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.user_cache import user_cache_dir

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
SOURCE = KERNEL_DIR / "decode_forward.c"
"""The translation unit; it includes the other files."""
SOURCES = tuple(sorted(KERNEL_DIR.glob("*.[ch]")))
"""Everything the build reads, for the cache key."""
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


def _build(compiler: str) -> Path:
    sources = b"".join(path.read_bytes() for path in SOURCES)
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS) + _cpu_flags()
    key = hashlib.sha256(sources + flags.encode()).hexdigest()[:16]
    target = user_cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
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


class LayerWeights(ctypes.Structure):
    """Mirror of decode_forward.c's struct layer_weights: data pointers of one layer."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("attn_norm", "qkv", "qkv_bias", "o", "mlp_norm", "gate_up", "down")
    ]


_P, _I = ctypes.c_void_p, ctypes.c_int64


class ModelArgs(ctypes.Structure):
    """Mirror of decode_forward.c's struct model_args (every field 8 bytes, no padding)."""

    _fields_ = [
        ("embed", _P),
        ("layers", ctypes.POINTER(LayerWeights)),
        ("num_layers", _I),
        ("final_norm", _P),
        ("head", _P),
        ("head_rows", _I),
        ("cos", _P),
        ("sin", _P),
        ("pool", _P),
        ("layer_stride", _I),
        ("hidden", _I),
        ("intermediate", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("block_size", _I),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
    ]


MASK_WINDOW = 64
"""Keys a tree mask can hide, counted back from a request's last new token (one uint64 of
bits per new token)."""
MAX_TREE_WIDTH = 4
"""Children the C beam (`greedy_tree`) keeps per tree level at most."""


@dataclass
class TreeMasks:
    """The kernels' form of a batch's attention masks: request r's new tokens see every key
    before mask_from[r], and key mask_from[r] + b when bit b of their row of `bits` is set
    (rows as signed int64, in batch token order)."""

    mask_from: list[int]
    bits: list[int]


def mask_bits(mask: torch.Tensor, kv_len: int) -> tuple[int, list[int]] | None:
    """A ForwardSeq's mask ([q, q] over its new tokens or [q, kv_len] over all its keys) as
    (mask_from, one int64 of bits per new token), or None when the keys it hides reach further
    back than MASK_WINDOW from the end, or a token does not see its own key (the kernel's
    softmax starts from that key's score)."""
    q, width = mask.shape
    rows = mask.to("cpu", torch.bool)
    if not bool(rows[:, width - q :].diagonal().all()):
        return None
    hidden = (~rows).any(dim=0).nonzero()
    first = kv_len - width + (int(hidden[0]) if len(hidden) else width)
    first = min(first, kv_len - q)
    if kv_len - first > MASK_WINDOW:
        return None
    window = rows[:, width - (kv_len - first) :].tolist()
    bits = []
    for row in window:
        value = sum(1 << b for b, seen in enumerate(row) if seen)
        bits.append(value - (1 << 64) if value >= 1 << 63 else value)
    return first, bits


def pack_batch(
    ids: list[int],
    positions: list[int],
    slots: list[int],
    logit_rows: list[int],
    q_start: list[int],
    q_len: list[int],
    num_cached: list[int],
    tables: list[list[int]],
    masks: TreeMasks | None = None,
) -> array.array[int]:
    """decode_forward.c's batch array, as one int64 `array` (built ~3x faster than a tensor
    from the same list). Block tables are padded to the longest with block 0 (never read)."""
    width = max(len(t) for t in tables)
    flat = [len(ids), len(q_start), width, len(logit_rows), int(masks is not None)]
    for part in (ids, positions, slots, logit_rows, q_start, q_len, num_cached):
        flat += part
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    if masks is not None:
        flat += masks.mask_from
        flat += masks.bits
    return array.array("q", flat)


class CpuKernels:
    """ctypes bindings of the fp32 and bf16 entry points of the library."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        args = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        args.append(ctypes.c_float)
        self._entry = {}
        self._forward = {}
        self._chain = {}
        self._tree = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"paged_attention_{suffix}")
            fn.argtypes = [*args, ptr, i64]
            fn.restype = ctypes.c_int
            self._entry[dtype] = fn
            forward = getattr(lib, f"decode_forward_{suffix}")
            forward.argtypes = [ctypes.POINTER(ModelArgs), ptr, ptr, i64]
            forward.restype = ctypes.c_int
            self._forward[dtype] = forward
            chain = getattr(lib, f"greedy_chain_{suffix}")
            chain.argtypes = [
                ctypes.POINTER(ModelArgs),
                ptr,
                ptr,
                ptr,
                ptr,
                ptr,
                i64,
                ptr,
                ptr,
                i64,
            ]
            chain.restype = ctypes.c_int
            self._chain[dtype] = chain
            tree = getattr(lib, f"greedy_tree_{suffix}")
            tree.argtypes = [ctypes.POINTER(ModelArgs), ptr, ptr, i64, ptr, ptr, i64, i64]
            tree.argtypes += [ptr, ptr, ptr, ptr, ptr, i64]
            tree.restype = ctypes.c_int
            self._tree[dtype] = tree

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._entry

    def forward(
        self, dtype: torch.dtype, model: ModelArgs, batch: array.array[int], logits: torch.Tensor
    ) -> None:
        """Run decode_forward for weights of `dtype` (`model` must point at live tensors) over
        a `pack_batch` array, writing fp32 `logits` [logit rows, head rows]."""
        threads = torch.get_num_threads()
        address = batch.buffer_info()[0]
        if self._forward[dtype](model, address, logits.data_ptr(), threads):
            raise MemoryError("fused forward could not allocate its scratch buffers")

    def greedy_chain(
        self,
        dtype: torch.dtype,
        model: ModelArgs,
        batch: array.array[int],
        steps: list[int],
        vocab: torch.Tensor | None,
        confident: bool = False,
        floors: list[float] | None = None,
        table: list[float] | None = None,
    ) -> list[tuple[list[int], list[float] | None]]:
        """Up to `steps[r]` greedy tokens for request r of a `pack_batch` array whose logit rows
        are each request's last row, every step in one C call (greedy_chain in the kernel);
        `vocab` (int64) maps a cut head's columns to token ids. `confident`: with each token's
        softmax confidence (else None), and with `floors` request r stops once its next
        token's predicted acceptance falls below floors[r], from each token's chance of
        acceptance: its bin's in `table` (equal bins of confidence), or its confidence. The
        block tables must already hold the tokens the steps write."""
        if not confident and (floors is not None or table is not None):
            raise ValueError("floors and a calibration table act on confidences: confident")
        if table is not None and not table:
            raise ValueError("a calibration table needs at least one bin")
        most = max(steps)
        counts = array.array("q", steps)
        out = array.array("q", [-1]) * (len(steps) * most)
        conf = array.array("f", bytes(4 * len(steps) * most)) if confident else None
        bars = None if floors is None else array.array("f", floors)
        chances = None if table is None else array.array("f", table)
        failed = self._chain[dtype](
            model,
            batch.buffer_info()[0],
            counts.buffer_info()[0],
            None if vocab is None else vocab.data_ptr(),
            None if bars is None else bars.buffer_info()[0],
            None if chances is None else chances.buffer_info()[0],
            0 if chances is None else len(chances),
            out.buffer_info()[0],
            None if conf is None else conf.buffer_info()[0],
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("greedy chain could not allocate its scratch buffers")
        chains: list[tuple[list[int], list[float] | None]] = []
        for r, n in enumerate(steps):
            tokens = [t for t in out[r * most : r * most + n] if t >= 0]
            sure = None if conf is None else conf[r * most : r * most + len(tokens)].tolist()
            chains.append((tokens, sure))
        return chains

    def greedy_tree(
        self,
        dtype: torch.dtype,
        model: ModelArgs,
        batch: array.array[int],
        depths: list[int],
        width: int,
        vocab: torch.Tensor | None,
        chances: list[list[float]],
    ) -> list[tuple[list[int], list[int], list[float], list[int]]]:
        """AdaServe's beam of `depths[r]` levels of `width` for request r of a `pack_batch`
        array whose logit rows are each request's last row, every level in one C call
        (greedy_tree in the kernel): each request's (tokens, parents, path probabilities,
        ranks), node 0 its root. `chances[rank][bin]`: the calibrated chance of a child of that
        rank among the draft's choices in that equal bin of its probability. The block tables
        must already hold every level's slots."""
        if not 1 <= width <= MAX_TREE_WIDTH:
            raise ValueError(f"a tree level keeps 1 to {MAX_TREE_WIDTH} children, got {width}")
        if not chances or not chances[0] or len({len(row) for row in chances}) != 1:
            raise ValueError("chances must be ranks x bins, every rank the same bins")
        stride = 1 + max(depths) * width
        size = len(depths) * stride
        tokens = array.array("q", [0]) * size
        parents = array.array("q", [0]) * size
        ranks = array.array("q", [0]) * size
        probs = array.array("f", bytes(4 * size))
        counts = array.array("q", [0]) * len(depths)
        table = array.array("d", [c for row in chances for c in row])
        levels = array.array("q", depths)
        failed = self._tree[dtype](
            model,
            batch.buffer_info()[0],
            levels.buffer_info()[0],
            width,
            None if vocab is None else vocab.data_ptr(),
            table.buffer_info()[0],
            len(chances[0]),
            len(chances),
            tokens.buffer_info()[0],
            parents.buffer_info()[0],
            probs.buffer_info()[0],
            ranks.buffer_info()[0],
            counts.buffer_info()[0],
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("greedy tree could not allocate its scratch buffers")
        return [
            (
                tokens[r * stride : r * stride + n].tolist(),
                parents[r * stride : r * stride + n].tolist(),
                probs[r * stride : r * stride + n].tolist(),
                ranks[r * stride : r * stride + n].tolist(),
            )
            for r, n in enumerate(counts)
        ]

    def attention(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        num_cached: torch.Tensor,
        block_size: int,
        scale: float,
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim] (contiguous) over `pool` (one layer, contiguous) for
        requests described by int64 tensors: block tables [requests, width], the first query
        row of each request in q, its query count and its cached length; `masks`: int64
        tensors of `TreeMasks`' two fields (None: causal)."""
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
            None if masks is None else masks[0].data_ptr(),
            None if masks is None else masks[1].data_ptr(),
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
def load() -> CpuKernels | None:
    """The kernels, or None when disabled or no C compiler can build them."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the CPU forward stays on PyTorch")
        return None
    try:
        return CpuKernels(_build(compiler))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable, the forward stays on PyTorch: %s", detail)
        return None
