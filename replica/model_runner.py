"""Our own Llama/Qwen2/OPT forward pass over a paged KV cache, for ragged batches.

One `forward` call takes any mix of prefill chunks, decode tokens and verify tokens: each
request brings q >= 1 new tokens that attend to its cached context plus its own new tokens
(causally, or through an explicit mask with explicit positions for token trees).

Speed on a small CPU is mostly per-op dispatch, so the forward keeps ops few: fused QKV and
gate/up weights, rotary embedding folded into the QKV weights (the rotate-half copy of q and k
comes out of the same matmul, so rope is one multiply and one fused multiply-add for q and k
together), one KV pool preallocated and written by index, and every per-step index and mask
tensor built once per forward and shared by all layers.

CPU, three paths. Batches of decode and verify rows only (at most SMALL_QUERY new tokens each,
a token tree's mask hiding keys among the last MASK_WINDOW at most, at most FUSED_MAX_TOKENS in
all) run the whole forward in one C call
(kernels/decode_forward.c via replica/cpu_kernels.py): at batch 1 PyTorch's ~20 op calls per
layer cost more than the layer's arithmetic. Other batches run layer by layer in PyTorch; there,
rows of at most SMALL_QUERY new tokens go to a C paged-attention kernel that reads their keys and
values in place in the paged pool (the SDPA path first copied each row's context into a padded
tensor, and that copy was half of a batch-32 decode step). Prefill chunks, masks reaching
further back, and every row when no C compiler is present (or `paged_kernel=False`) use SDPA
calls whose
padded work tracks the ragged work: small rows share one call padded to their longest q and KV;
each prefill chunk gets its own call over its own context (equal chunks share one), causal by
SDPA's own flag when it has no cached context, else by an explicit mask. Explicit positions and
token-tree masks are honoured everywhere.
SDPA / paged-kernel attention, whole forward, demo target, fp32, best of 15 x 5 steps, in
one process (`paged_kernel=False/True`, `fused_forward=False`), 1 thread, shared machine:
  32 decodes, contexts 192-320:                         58.6 / 21.3 ms  (2.76x)
  1 decode, context 256:                                 3.3 / 2.2 ms   (1.53x)
  8 verify rows (k = 3, contexts 256-512):              14.1 / 11.5 ms  (1.23x)
  16 decodes (contexts 256-768) + a 256-token chunk:    68.8 / 41.9 ms  (1.64x)
  one 128-token chunk on 256 cached + 1 decode:         20.9 / 19.9 ms  (1.05x)
torch.compile was tried and dropped: compiling the whole layer stack for one fixed decode shape
saved 15% (1.91 -> 1.63 ms) but costs ~6 s per new shape, and ragged batches change shape
every step; compiling only the attention with dynamic shapes made it slower (2.1 -> 5.1 ms per
step).

Dtype: both fp32 and bf16 are supported (figures in loadgen/RESULTS.md, Engine): bf16 decodes
faster at batch 1 (half the weight bytes, and AVX512-BF16 dot products where the CPU has them)
and prefills about 2-3x faster (AMX); at batch 8 and 32 the two are within a few percent. fp32
matches transformers token for token and is the default.

CUDA: FlashInfer's paged prefill wrapper (it also serves q = 1 rows) over the same pool layout,
selected when CUDA and flashinfer are both available.
"""

from __future__ import annotations

import array
import functools
import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from replica import cpu_kernels
from replica.cpu_kernels import TreeMasks, mask_bits
from replica.model_source import eos_token_ids
from replica.spec.tree import level_slots
from replica.tensor_parallel import TensorParallel

BLOCK_SIZE = 16
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "opt")
OPT_POSITION_OFFSET = 2
"""OPT's learned position table starts two rows in (a fairseq legacy transformers keeps)."""
SMALL_QUERY = 16
"""CPU attention pads rows of at most this many new tokens into one call."""
FUSED_MAX_TOKENS = {torch.float32: 64, torch.bfloat16: 32}
"""Batches of at most this many new tokens (all in rows of at most SMALL_QUERY, no tree mask)
run through the fused C forward; beyond, PyTorch's matrix products (AMX for bf16) win. Demo
target, bf16, 2 threads: 32 decodes ran at ~5.7k tok/s fused against ~5.1k in PyTorch, 64 at
~5.4k against ~6.4k."""
PAD_SLACK = 1.25
"""Padded / ragged attention work a CPU call of longer rows may reach."""


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json the forward pass needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    """0 for OPT, which has no rotary embedding."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def is_opt(self) -> bool:
        """OPT: learned positions, LayerNorms with biases, a ReLU MLP, biased projections."""
        return self.model_type == "opt"

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        raw: dict[str, Any] = json.loads(path.read_text())
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        if model_type == "opt":
            return cls._from_opt(model_dir, raw)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or raw.get("attention_bias", False),
            eos_token_ids=eos_token_ids(Path(model_dir), raw),
        )

    @classmethod
    def _from_opt(cls, model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
        """OPT-125m, 1.3b, 2.7b, 6.7b, 13b, 30b, 66b: pre-norm, ReLU, the embedding as wide as
        the model. OPT-350m's post-norm layers and projected embeddings are refused."""
        unsupported = {
            "do_layer_norm_before": (raw.get("do_layer_norm_before", True), True),
            "word_embed_proj_dim": (
                raw.get("word_embed_proj_dim", raw["hidden_size"]),
                raw["hidden_size"],
            ),
            "activation_function": (raw.get("activation_function", "relu"), "relu"),
            "enable_bias": (raw.get("enable_bias", True), True),
            "layer_norm_elementwise_affine": (
                raw.get("layer_norm_elementwise_affine", True),
                True,
            ),
            "_remove_final_layer_norm": (raw.get("_remove_final_layer_norm", False), False),
        }
        for name, (value, supported) in unsupported.items():
            if value != supported:
                raise ValueError(f"OPT with {name}={value!r} is not supported (need {supported!r})")
        num_heads = raw["num_attention_heads"]
        return cls(
            model_type="opt",
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["ffn_dim"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=raw["hidden_size"] // num_heads,
            norm_eps=1e-5,
            rope_theta=0.0,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            qkv_bias=True,
            eos_token_ids=eos_token_ids(Path(model_dir), raw),
        )

    def sharded(self, size: int) -> ModelConfig:
        """One rank's share under tensor parallelism over `size` ranks: its heads and MLP
        columns (replica.tensor_parallel)."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % size:
                raise ValueError(
                    f"tensor parallelism over {size} needs {name} ({getattr(self, name)}) "
                    f"divisible by {size}"
                )
        return replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=self.num_kv_heads // size,
            intermediate_size=self.intermediate_size // size,
        )

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * BLOCK_SIZE * self.num_kv_heads * self.head_dim * elem


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    """Rows: q, k, rotate_half(q), rotate_half(k), v (rotary models); q, k, v (OPT)."""
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    """Rows: gate, up (Llama, Qwen2); OPT's fc1."""
    down: torch.Tensor
    attn_norm_bias: torch.Tensor | None = None
    """OPT's LayerNorms and projections carry biases; the RMSNorm models' do not."""
    o_bias: torch.Tensor | None = None
    mlp_norm_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def _rotate_rows(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Rows producing rotate_half(w @ x) per head: (x1, x2) -> (-x2, x1)."""
    shaped = w.reshape(num_heads, head_dim, *w.shape[1:])
    half = head_dim // 2
    rotated = torch.cat([-shaped[:, half:], shaped[:, :half]], dim=1)
    return rotated.reshape(w.shape)


def _load_state(model_dir: Path, tp: TensorParallel | None = None) -> dict[str, torch.Tensor]:
    """Safetensors shards, else PyTorch `.bin` shards (older hub checkpoints such as OPT's),
    read tensors-only. Both are mapped, not read whole, so a tensor-parallel rank reads only
    its pieces. Keys of a bare decoder (`decoder.*`) get the causal LM's `model.`."""
    state: dict[str, torch.Tensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (the handle is not iterable)
                if tp is None:
                    state[name] = handle.get_tensor(name)
                else:
                    piece = handle.get_slice(name)
                    state[name] = tp.take(name, piece, piece.get_shape())
    if not files:
        files = sorted(Path(model_dir).glob("pytorch_model*.bin"))
        for f in files:
            mapped = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in mapped.items():
                state[name] = tensor if tp is None else tp.take(name, tensor, tensor.shape)
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    if any(k.startswith("decoder.") for k in state):
        state = {
            k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()
        }
    return state


def _placed(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` on `device` in `dtype`, contiguous and 64-byte aligned. A tensor mapped from a file
    starts wherever the file put it (safetensors 0.8 aligns to 8 bytes), and torch's CPU kernels
    split a row differently at another alignment: the same weights then gave logits differing
    in the 8th digit depending on the file format they were read from."""
    placed = t.to(device=device, dtype=dtype).contiguous()
    if placed.device.type == "cpu" and placed.data_ptr() % 64:
        return placed.clone()
    return placed


def _tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return state[name]


def _build_layers(
    state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> list[_Layer]:
    def get(name: str) -> torch.Tensor:
        return _tensor(state, name).to(torch.float32)

    def put(t: torch.Tensor) -> torch.Tensor:
        return _placed(t, device, dtype)

    if cfg.is_opt:
        return [_opt_layer(get, put, f"model.decoder.layers.{i}.") for i in range(cfg.num_layers)]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        qr = _rotate_rows(q, cfg.num_heads, cfg.head_dim)
        kr = _rotate_rows(k, cfg.num_kv_heads, cfg.head_dim)
        bias = None
        if cfg.qkv_bias:
            qb, kb, vb = (get(p + f"self_attn.{n}_proj.bias") for n in "qkv")
            qbr = _rotate_rows(qb, cfg.num_heads, cfg.head_dim)
            kbr = _rotate_rows(kb, cfg.num_kv_heads, cfg.head_dim)
            bias = put(torch.cat([qb, kb, qbr, kbr, vb]))
        layers.append(
            _Layer(
                attn_norm=put(get(p + "input_layernorm.weight")),
                qkv=put(torch.cat([q, k, qr, kr, v])),
                qkv_bias=bias,
                o=put(get(p + "self_attn.o_proj.weight")),
                mlp_norm=put(get(p + "post_attention_layernorm.weight")),
                gate_up=put(
                    torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
                ),
                down=put(get(p + "mlp.down_proj.weight")),
            )
        )
    return layers


def _opt_layer(
    get: Callable[[str], torch.Tensor], put: Callable[[torch.Tensor], torch.Tensor], p: str
) -> _Layer:
    def both(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return put(get(f"{p}{name}.weight")), put(get(f"{p}{name}.bias"))

    attn_norm, attn_norm_bias = both("self_attn_layer_norm")
    o, o_bias = both("self_attn.out_proj")
    mlp_norm, mlp_norm_bias = both("final_layer_norm")
    fc1, fc1_bias = both("fc1")
    fc2, fc2_bias = both("fc2")
    qkv = [get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
    qkv_bias = [get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
    return _Layer(
        attn_norm=attn_norm,
        qkv=put(torch.cat(qkv)),
        qkv_bias=put(torch.cat(qkv_bias)),
        o=o,
        mlp_norm=mlp_norm,
        gate_up=fc1,
        down=fc2,
        attn_norm_bias=attn_norm_bias,
        o_bias=o_bias,
        mlp_norm_bias=mlp_norm_bias,
        gate_up_bias=fc1_bias,
        down_bias=fc2_bias,
    )


def _norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """OPT's LayerNorm when the norm has a bias, else Llama's RMSNorm."""
    if bias is None:
        return _rms_norm(x, weight, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def _rope_tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position, computed as transformers does (fp32) so fp32 runs match it."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(torch.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (exponents / cfg.head_dim))
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm in six small ops: measured ~2x faster than F.rms_norm for few rows
    (9 vs 16 us for one token), and the same arithmetic as transformers' version."""
    scale = torch.mean(x * x, dim=-1, keepdim=True).add_(eps).rsqrt_()
    return torch.mul(x, scale).mul_(weight)


@dataclass
class ForwardSeq:
    """One request's slice of a ragged forward.

    `block_table` must already cover `num_cached + len(token_ids)` tokens. Without
    `positions` the new tokens sit at positions num_cached, num_cached + 1, ...; without
    `attn_mask` they attend causally. A [q, q] `attn_mask[i, j]` says new token i may see new
    token j (every new token then sees the whole cached context); a [q, num_cached + q] one
    says which cached slots it sees too (a draft growing a token tree over several forwards
    keeps earlier levels in its cache, and a node must not see its cousins there).
    """

    token_ids: list[int]
    block_table: list[int]
    num_cached: int
    num_logits: int = 0
    """Return logits for this many of the last new tokens."""
    positions: list[int] | None = None
    attn_mask: torch.Tensor | None = None


@dataclass
class KVMove:
    """Cached slots of one request to copy, in its own blocks: `src[i]` to `dst[i]` (token
    positions). A verified token tree's accepted path is moved to the positions right after
    the context, where later steps read it."""

    block_table: list[int]
    src: list[int]
    dst: list[int]


@dataclass
class _AttnGroup:
    """Requests sharing one CPU SDPA call: [requests, max q] queries over [requests, max kv]."""

    read_k: torch.Tensor
    """Flat pool row of every (request, kv position); padding points at row 0, masked out."""
    read_v: torch.Tensor
    mask: torch.Tensor | None
    """[requests, 1, max q, max kv], True = may attend; None when nothing needs masking."""
    causal: bool
    """Equal fresh chunks (q = kv, no padding): SDPA's own causal mask replaces `mask`."""
    batch: int
    max_q: int
    start: int
    """First batch token row of the group (used when its requests are adjacent in the batch)."""
    q_gather: torch.Tensor | None
    """Batch token row of each padded query slot; None: rows start .. start + batch * max q."""
    out_rows: torch.Tensor | None
    """Padded slots holding real tokens, in token order; None when nothing is padded."""
    token_rows: torch.Tensor | None
    """Batch token rows of the group's tokens; None when they are start .. start + count."""
    count: int
    """New tokens of the group."""


@dataclass
class _Moves:
    """A `move_kv` call sent to the other tensor-parallel ranks (they hold their own heads)."""

    moves: list[KVMove]


@dataclass
class _PagedGroup:
    """Rows of few query tokens (chains or trees), attended by the C kernel in the pool."""

    tables: torch.Tensor
    """int64 [requests, width] block tables, padded with block 0 (never read)."""
    q_start: torch.Tensor
    """int64 first row of each request among the group's gathered queries."""
    q_len: torch.Tensor
    num_cached: torch.Tensor
    start: int
    count: int
    token_rows: torch.Tensor | None
    """Batch token rows of the group's tokens; None when they are start .. start + count."""
    masks: tuple[torch.Tensor, torch.Tensor] | None
    """int64 mask starts and bits (cpu_kernels.TreeMasks) when a row is a tree."""


@dataclass
class _StepMeta:
    """Index tensors of one forward, shared by every layer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """cos and sin of each token's position, [tokens, 1, head_dim] each; None for OPT."""
    write_k: torch.Tensor
    write_v: torch.Tensor
    logit_rows: torch.Tensor
    attend: Callable[[torch.Tensor, int], torch.Tensor]
    """(rotated queries [tokens, heads, head_dim], layer) -> attention output [tokens, hidden]."""


@dataclass
class _Flat:
    """A validated batch laid out token by token, in seq order."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    write_k: list[int] = field(default_factory=list)
    """Pool row of each new token's key (its value is BLOCK_SIZE rows later)."""
    logit_rows: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    """First token row of each seq."""
    masks: list[tuple[int, list[int]] | None] = field(default_factory=list)
    """Each seq's attention mask as the C kernels read it (cpu_kernels.mask_bits); None
    without one."""
    kernel_rows: list[bool] = field(default_factory=list)
    """Whether the C kernels attend each seq: few new tokens, and a mask (if any) they read."""


def _fits_fused(flat: _Flat, dtype: torch.dtype) -> bool:
    """Decode and verify batches of few tokens (chains and token trees): rows the fused C
    forward handles."""
    return len(flat.input_ids) <= FUSED_MAX_TOKENS[dtype] and all(flat.kernel_rows)


def _tree_masks(members: Sequence[int], seqs: list[ForwardSeq], flat: _Flat) -> TreeMasks | None:
    """The kernels' masks of the seqs `members` (in order), causal rows spelled out beside a
    tree; None when none has a mask."""
    if all(flat.masks[m] is None for m in members):
        return None
    mask_from: list[int] = []
    bits: list[int] = []
    for m in members:
        own = flat.masks[m]
        if own is None:
            mask_from.append(seqs[m].num_cached)
            bits += [(1 << (i + 1)) - 1 for i in range(flat.q_lens[m])]
        else:
            mask_from.append(own[0])
            bits += own[1]
    return TreeMasks(mask_from, bits)


class ModelRunner:
    """Weights plus one preallocated paged KV pool; `forward` runs a ragged batch.

    Pool layout per layer: [num_blocks, 2 (k, v), BLOCK_SIZE, kv_heads, head_dim], which is
    FlashInfer's NHD paged layout, so the CPU and CUDA paths share it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        head_vocab: Sequence[int] | None = None,
        paged_kernel: bool = True,
        fused_forward: bool = True,
        tp: TensorParallel | None = None,
    ) -> None:
        if (num_blocks is None) == (kv_memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_memory_bytes")
        self.model_dir = Path(model_dir)
        full = ModelConfig.from_dir(self.model_dir)
        self.tp = tp
        """The tensor-parallel group this runner is one rank of; `config` is then its share."""
        self.config = cfg = full if tp is None else full.sharded(tp.size)
        self.dtype = dtype
        self.device = torch.device(device)
        if num_blocks is None:
            num_blocks = (kv_memory_bytes or 0) // cfg.kv_bytes_per_block(dtype)
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds {num_blocks} blocks; need at least 1")
        self.num_blocks = int(num_blocks)
        state = _load_state(self.model_dir, tp)
        prefix = "model.decoder." if cfg.is_opt else "model."
        embed = _tensor(state, f"{prefix}embed_tokens.weight")
        self.embed = _placed(embed, self.device, dtype)
        self.pos_embed: torch.Tensor | None = None
        """OPT's learned position table; None for rotary models."""
        if cfg.is_opt:
            table = _tensor(state, "model.decoder.embed_positions.weight")
            self.pos_embed = _placed(table, self.device, dtype)
        head = self.embed if cfg.tie_word_embeddings else state.get("lm_head.weight")
        if head is None:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        self.head_vocab: torch.Tensor | None = None
        """Token id of each logit column when the head is cut to a vocabulary subset."""
        if head_vocab is not None:
            if tp is not None:
                raise ValueError("a cut head (head_vocab) is the draft's, which is not split")
            ids = torch.tensor(list(head_vocab), dtype=torch.long)
            if ids.numel() == 0 or len(set(ids.tolist())) != ids.numel():
                raise ValueError("head_vocab must list distinct token ids")
            if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
                raise ValueError(f"head_vocab ids must be in [0, {cfg.vocab_size})")
            head = head.index_select(0, ids)
            self.head_vocab = ids.to(self.device)
        self.lm_head = _placed(head, self.device, dtype)
        final = "model.decoder.final_layer_norm" if cfg.is_opt else "model.norm"
        self.final_norm = _placed(_tensor(state, f"{final}.weight"), self.device, dtype)
        self.final_norm_bias = (
            _placed(_tensor(state, f"{final}.bias"), self.device, dtype) if cfg.is_opt else None
        )
        self.layers = _build_layers(state, cfg, dtype, self.device)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        """cos and sin tables per position; None for OPT, whose positions are learned."""
        if not cfg.is_opt:
            cos, sin = _rope_tables(cfg, dtype)
            self.rope = cos.to(self.device), sin.to(self.device)
        self._check_gpu_room()
        self.kv = torch.zeros(
            cfg.num_layers,
            self.num_blocks,
            2,
            BLOCK_SIZE,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=self.device,
        )
        # Flat per-layer views: one row per (block, k|v, slot), so reads and writes are one
        # index op each.
        self._flat_kv = [
            self.kv[i].view(-1, cfg.num_kv_heads, cfg.head_dim) for i in range(cfg.num_layers)
        ]
        self._qk_width = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        self._flashinfer = _FlashInferAttention(self) if _flashinfer_usable(self.device) else None
        kernels = cpu_kernels.load() if paged_kernel and self.device.type == "cpu" else None
        self._paged = kernels if kernels is not None and kernels.supports(dtype) else None
        fused = self._paged is not None and fused_forward and not cfg.is_opt and tp is None
        self._fused = self._fused_template() if fused else None
        """The fused C forward computes the rotary models' layers, on one process."""

    def _check_gpu_room(self) -> None:
        """A KV pool the GPU cannot hold is refused with the numbers, not a CUDA OOM."""
        if self.device.type != "cuda":
            return
        need = self.num_blocks * self.config.kv_bytes_per_block(self.dtype)
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise ValueError(
                f"{self.num_blocks} KV blocks need {need / 2**30:.1f} GiB but the GPU has "
                f"{free / 2**30:.1f} GiB free after the weights: lower num_kv_blocks"
            )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The token ids of logit columns (`head_vocab`'s when the head is cut)."""
        return columns if self.head_vocab is None else self.head_vocab[columns]

    @torch.inference_mode()
    def forward(self, seqs: list[ForwardSeq]) -> torch.Tensor:
        """Run one ragged batch; returns fp32 logits [sum(num_logits), vocab] in seq order
        (columns are `head_vocab`'s tokens when the head is cut)."""
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        flat = self._flatten(seqs)
        if self._fused is not None and _fits_fused(flat, self.dtype):
            return self._forward_fused(seqs, flat)
        if self.tp is not None:
            self.tp.send_batch(seqs)
        return self._forward(seqs, flat)

    @torch.inference_mode()
    def serve_batches(self) -> None:
        """A rank > 0's loop: compute its share of every batch rank 0 sends, until it sends
        None (`stop_group`)."""
        if self.tp is None or self.tp.rank == 0:
            raise ValueError("serve_batches runs on the ranks > 0 of a tensor-parallel group")
        while (work := self.tp.receive_batch()) is not None:
            if isinstance(work, _Moves):
                self._move(work.moves)
            else:
                self._forward(work, self._flatten(work))

    @torch.inference_mode()
    def move_kv(self, moves: list[KVMove]) -> None:
        """Copy the given cached slots in every layer (every rank's share of them)."""
        if not moves:
            return
        if self.tp is not None:
            self.tp.send_batch(_Moves(moves))
        self._move(moves)

    def _move(self, moves: list[KVMove]) -> None:
        bs = BLOCK_SIZE
        src_block, src_slot, dst_block, dst_slot = [], [], [], []
        for m in moves:
            if len(m.src) != len(m.dst):
                raise ValueError(f"{len(m.src)} source slots for {len(m.dst)} destinations")
            for p in (*m.src, *m.dst):
                if not 0 <= p < len(m.block_table) * bs:
                    raise ValueError(f"position {p} is outside the request's blocks")
            src_block += [m.block_table[p // bs] for p in m.src]
            src_slot += [p % bs for p in m.src]
            dst_block += [m.block_table[p // bs] for p in m.dst]
            dst_slot += [p % bs for p in m.dst]
        dev = self.device

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        # The right side is gathered before any write, so overlapping moves stay correct.
        self.kv[:, index(dst_block), :, index(dst_slot)] = self.kv[
            :, index(src_block), :, index(src_slot)
        ]

    def stop_group(self) -> None:
        """Rank 0: release the other ranks from `serve_batches`."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send_batch(None)

    def _forward(self, seqs: list[ForwardSeq], flat: _Flat) -> torch.Tensor:
        meta = self._prepare(seqs, flat)
        cfg = self.config
        x = (
            F.embedding(meta.input_ids, self.embed)
            if self.tp is None
            else self.tp.embed(meta.input_ids, self.embed)
        )
        if self.pos_embed is not None:
            x = x + F.embedding(meta.positions + OPT_POSITION_OFFSET, self.pos_embed)
        num_tokens = x.shape[0]
        eps, opt = cfg.norm_eps, cfg.is_opt
        w = self._qk_width
        for li, layer in enumerate(self.layers):
            h = _norm(x, layer.attn_norm, layer.attn_norm_bias, eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk = qkv[:, :w].view(num_tokens, -1, cfg.head_dim)
            if meta.rope is None:
                v = qkv[:, w:]
            else:
                cos, sin = meta.rope
                qk_rot = qkv[:, w : 2 * w].view(num_tokens, -1, cfg.head_dim)
                qk = torch.addcmul(qk * cos, qk_rot, sin)
                v = qkv[:, 2 * w :]
            q = qk[:, : cfg.num_heads]
            k = qk[:, cfg.num_heads :]
            self._flat_kv[li].index_copy_(0, meta.write_k, k)
            self._flat_kv[li].index_copy_(
                0, meta.write_v, v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            )
            x = x + self._sum(F.linear(meta.attend(q, li), layer.o, layer.o_bias))
            h = _norm(x, layer.mlp_norm, layer.mlp_norm_bias, eps)
            if opt:
                act = F.relu(F.linear(h, layer.gate_up, layer.gate_up_bias))
            else:
                gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
                act = F.silu(gate) * up
            x = x + self._sum(F.linear(act, layer.down, layer.down_bias))
        rows = x.index_select(0, meta.logit_rows)
        rows = _norm(rows, self.final_norm, self.final_norm_bias, eps)
        logits = F.linear(rows, self.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, cfg.vocab_size)
        return logits.float()

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split projection's output: the sum over the tensor-parallel ranks."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _attend(
        self, groups: list[_AttnGroup | _PagedGroup], q: torch.Tensor, layer: int
    ) -> torch.Tensor:
        if len(groups) == 1:
            return self._attend_any(groups[0], q, layer)
        out = q.new_empty(q.shape[0], self.config.num_heads * self.config.head_dim)
        for g in groups:
            part = self._attend_any(g, q, layer)
            if g.token_rows is None:
                out[g.start : g.start + g.count] = part
            else:
                out.index_copy_(0, g.token_rows, part)
        return out

    def _attend_any(self, g: _AttnGroup | _PagedGroup, q: torch.Tensor, layer: int) -> torch.Tensor:
        if isinstance(g, _AttnGroup):
            return self._attend_group(g, q, layer)
        assert self._paged is not None
        rows = q[g.start : g.start + g.count] if g.token_rows is None else q[g.token_rows]
        cfg = self.config
        out = self._paged.attention(
            rows.contiguous(),
            self.kv[layer],
            g.tables,
            g.q_start,
            g.q_len,
            g.num_cached,
            BLOCK_SIZE,
            cfg.head_dim**-0.5,
            g.masks,
        )
        return out.view(g.count, cfg.num_heads * cfg.head_dim)

    def _attend_group(self, g: _AttnGroup, q: torch.Tensor, layer: int) -> torch.Tensor:
        cfg = self.config
        b, mq = g.batch, g.max_q
        qp = q[g.start : g.start + b * mq] if g.q_gather is None else q.index_select(0, g.q_gather)
        qp = qp.reshape(b, mq, cfg.num_heads, cfg.head_dim)
        # F.embedding as a row gather: 2-4x faster than advanced indexing here.
        rows = self._flat_kv[layer].view(-1, cfg.num_kv_heads * cfg.head_dim)
        kv_shape = (b, -1, cfg.num_kv_heads, cfg.head_dim)
        k = F.embedding(g.read_k, rows).view(kv_shape).transpose(1, 2)
        v = F.embedding(g.read_v, rows).view(kv_shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k, v, attn_mask=g.mask, is_causal=g.causal, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(b * mq, cfg.num_heads * cfg.head_dim)
        if g.out_rows is not None:
            out = out.index_select(0, g.out_rows)
        return out

    def _flatten(self, seqs: list[ForwardSeq]) -> _Flat:
        """Validate the batch and lay its tokens out in seq order."""
        cfg = self.config
        bs = BLOCK_SIZE
        flat = _Flat()
        for s in seqs:
            q = len(s.token_ids)
            kv_len = s.num_cached + q
            if q < 1:
                raise ValueError("every sequence needs at least one new token")
            if len(s.block_table) * bs < kv_len:
                raise ValueError(
                    f"block table of {len(s.block_table)} blocks cannot hold {kv_len} tokens"
                )
            if not 0 <= s.num_logits <= q:
                raise ValueError(f"num_logits must be in [0, {q}], got {s.num_logits}")
            pos = s.positions if s.positions is not None else range(s.num_cached, kv_len)
            if len(pos) != q:
                raise ValueError(f"{len(pos)} positions for {q} tokens")
            if q and (min(pos) < 0 or max(pos) >= cfg.max_position_embeddings):
                raise ValueError(f"positions must be in [0, {cfg.max_position_embeddings})")
            if s.attn_mask is not None and tuple(s.attn_mask.shape) not in ((q, q), (q, kv_len)):
                raise ValueError(f"attn_mask must have shape ({q}, {q}) or ({q}, {kv_len})")
            masks = None
            if s.attn_mask is not None and self._paged is not None:
                masks = mask_bits(s.attn_mask, kv_len)
            flat.masks.append(masks)
            flat.kernel_rows.append(q <= SMALL_QUERY and (s.attn_mask is None or masks is not None))
            start = len(flat.input_ids)
            flat.starts.append(start)
            flat.q_lens.append(q)
            flat.kv_lens.append(kv_len)
            flat.logit_rows.extend(range(start + q - s.num_logits, start + q))
            flat.input_ids.extend(s.token_ids)
            flat.positions.extend(pos)
            table = s.block_table
            for j in range(s.num_cached, kv_len):
                flat.write_k.append(table[j // bs] * 2 * bs + j % bs)
        bad = next((t for t in flat.input_ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary ({cfg.vocab_size})")
        return flat

    def _prepare(self, seqs: list[ForwardSeq], flat: _Flat) -> _StepMeta:
        """Build every index tensor of the PyTorch path once."""
        bs = BLOCK_SIZE
        q_lens, kv_lens = flat.q_lens, flat.kv_lens
        positions, write_k, input_ids = flat.positions, flat.write_k, flat.input_ids
        logit_rows = flat.logit_rows
        dev = self.device
        pos_t = torch.tensor(positions, device=dev)
        wk = torch.tensor(write_k, device=dev)
        if self._flashinfer is not None:
            attend = self._flashinfer.plan(seqs, q_lens, kv_lens)
        else:
            starts = flat.starts
            in_pool: list[int] = []
            rest: list[int] = []
            for i, kernel_row in enumerate(flat.kernel_rows):
                (in_pool if self._paged is not None and kernel_row else rest).append(i)
            groups: list[_AttnGroup | _PagedGroup] = [
                self._group(members, seqs, q_lens, kv_lens, starts)
                for members in _group_requests(rest, q_lens, kv_lens)
            ]
            if in_pool:
                groups.append(self._paged_group(in_pool, seqs, flat))
            attend = functools.partial(self._attend, groups)
        return _StepMeta(
            input_ids=torch.tensor(input_ids, device=dev),
            positions=pos_t,
            rope=None
            if self.rope is None
            else (
                F.embedding(pos_t, self.rope[0]).unsqueeze(1),
                F.embedding(pos_t, self.rope[1]).unsqueeze(1),
            ),
            write_k=wk,
            write_v=wk + bs,
            logit_rows=torch.tensor(logit_rows, device=dev, dtype=torch.long),
            attend=attend,
        )

    def _fused_template(self) -> cpu_kernels.ModelArgs:
        """The fused forward's arguments that never change: weights, tables, shapes."""
        cfg = self.config

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self._layer_ptrs = (cpu_kernels.LayerWeights * cfg.num_layers)(
            *(
                cpu_kernels.LayerWeights(
                    ptr(w.attn_norm),
                    ptr(w.qkv),
                    ptr(w.qkv_bias),
                    ptr(w.o),
                    ptr(w.mlp_norm),
                    ptr(w.gate_up),
                    ptr(w.down),
                )
                for w in self.layers
            )
        )
        assert self.rope is not None, "the fused forward is built for rotary models only"
        self._cos32 = self.rope[0].float().contiguous()
        self._sin32 = self.rope[1].float().contiguous()
        return cpu_kernels.ModelArgs(
            embed=ptr(self.embed),
            layers=self._layer_ptrs,
            num_layers=cfg.num_layers,
            final_norm=ptr(self.final_norm),
            head=ptr(self.lm_head),
            head_rows=self.lm_head.shape[0],
            cos=ptr(self._cos32),
            sin=ptr(self._sin32),
            pool=ptr(self.kv),
            layer_stride=self.kv[0].numel(),
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=BLOCK_SIZE,
            eps=cfg.norm_eps,
            scale=cfg.head_dim**-0.5,
        )

    def can_chain(self, q_lens: Sequence[int]) -> bool:
        """Whether `greedy_chain` takes sequences whose first step feeds `q_lens` tokens: the
        fused forward's limits (the one-token steps after the first are smaller still)."""
        return (
            self._fused is not None
            and sum(q_lens) <= FUSED_MAX_TOKENS[self.dtype]
            and all(1 <= q <= SMALL_QUERY for q in q_lens)
        )

    @torch.inference_mode()
    def greedy_chain(
        self,
        seqs: list[ForwardSeq],
        steps: Sequence[int],
        confident: bool = False,
        floors: Sequence[float] | None = None,
        table: Sequence[float] | None = None,
    ) -> list[tuple[list[int], list[float] | None]]:
        """Up to `steps[i]` greedy tokens for sequence i, each fed back as the next step's
        input, all in one C call (a draft's proposal loop). `confident`: with their softmax
        confidences (else None), and with `floors` sequence i stops early once its next
        token's predicted acceptance (the product of its tokens' chances so far times the last)
        falls below floors[i], a token's chance being its confidence bin's value in `table`
        (equal bins over [0, 1]) or, without one, its confidence. Each sequence takes default
        positions, no mask and one logit row, and its block table already covers the tokens
        every step writes."""
        if not self.can_chain([len(s.token_ids) for s in seqs]):
            raise ValueError(
                "greedy_chain needs the fused CPU forward and rows of at most "
                f"{SMALL_QUERY} tokens, {FUSED_MAX_TOKENS[self.dtype]} in all; see can_chain"
            )
        if len(steps) != len(seqs) or any(n < 1 for n in steps):
            raise ValueError(f"need one step count >= 1 per sequence, got {list(steps)}")
        if floors is not None and len(floors) != len(seqs):
            raise ValueError(f"need one floor per sequence, got {len(floors)} for {len(seqs)}")
        grows = []
        for s, n in zip(seqs, steps, strict=True):
            need = s.num_cached + len(s.token_ids) + n - 1
            grows.append((need, need, f"{n} steps"))
        self._check_loop("greedy_chain", seqs, grows)
        flat = self._flatten(seqs)
        assert self._fused is not None and self._paged is not None
        return self._paged.greedy_chain(
            self.dtype,
            self._fused,
            self._pack(seqs, flat),
            list(steps),
            self.head_vocab,
            confident,
            None if floors is None else list(floors),
            None if table is None else list(table),
        )

    def can_tree(self, q_lens: Sequence[int], depth: int, width: int) -> bool:
        """Whether `greedy_tree` takes sequences whose first level feeds `q_lens` tokens and
        that grow `depth` levels of `width`: the fused forward's limits for every level, and a
        tree whose fed levels fit the kernels' mask window."""
        return (
            self.can_chain(q_lens)
            and 1 <= width <= cpu_kernels.MAX_TREE_WIDTH
            and len(q_lens) * width <= FUSED_MAX_TOKENS[self.dtype]
            and (depth - 1) * width <= cpu_kernels.MASK_WINDOW
        )

    @torch.inference_mode()
    def greedy_tree(
        self,
        seqs: list[ForwardSeq],
        depths: Sequence[int],
        width: int,
        chances: list[list[float]],
    ) -> list[tuple[list[int], list[int], list[float], list[int]]]:
        """AdaServe's beam for greedy requests, every level in one C call (a draft's
        `propose_trees`): sequence i grows `depths[i]` levels, each keeping the `width`
        children of highest path score (`chances[rank][bin]`: the calibrated chance of a child
        of that rank among the draft's choices in that equal bin of its probability). Each
        level's nodes take the cache slots after the sequence's tokens, level by level, and its
        block table already covers them. Returns each sequence's (tokens, parents, path
        probabilities, ranks), node 0 its last token."""
        most = max(depths, default=0)
        if not self.can_tree([len(s.token_ids) for s in seqs], most, width):
            raise ValueError(
                "greedy_tree needs the fused CPU forward, rows of at most "
                f"{SMALL_QUERY} tokens, {FUSED_MAX_TOKENS[self.dtype]} in all, and fed levels "
                f"within {cpu_kernels.MASK_WINDOW} keys; see can_tree"
            )
        if len(depths) != len(seqs) or any(d < 0 for d in depths):
            raise ValueError(f"need one depth >= 0 per sequence, got {list(depths)}")
        grows = []
        for s, d in zip(seqs, depths, strict=True):
            known = s.num_cached + len(s.token_ids)
            grows.append((known + level_slots(d, width), known + d, f"{d} levels"))
        self._check_loop("greedy_tree", seqs, grows)
        flat = self._flatten(seqs)
        assert self._fused is not None and self._paged is not None
        return self._paged.greedy_tree(
            self.dtype,
            self._fused,
            self._pack(seqs, flat),
            list(depths),
            width,
            self.head_vocab,
            chances,
        )

    def _check_loop(
        self, name: str, seqs: list[ForwardSeq], grows: list[tuple[int, int, str]]
    ) -> None:
        """What a C loop (`greedy_chain`, `greedy_tree`) needs of each sequence: default
        positions, no mask, one logit row; `grows[i]`: the slots its block table must hold, the
        positions its tokens reach, and what it grows (for the errors)."""
        for s, (slots, reach, what) in zip(seqs, grows, strict=True):
            if s.num_logits != 1 or s.positions is not None or s.attn_mask is not None:
                raise ValueError(f"{name} sequences take default positions, no mask, 1 logit")
            if len(s.block_table) * BLOCK_SIZE < slots:
                raise ValueError(
                    f"block table of {len(s.block_table)} blocks cannot hold the {slots} tokens "
                    f"of {what}"
                )
            if reach > self.config.max_position_embeddings:
                raise ValueError(f"{what} run past position {self.config.max_position_embeddings}")

    def _pack(self, seqs: list[ForwardSeq], flat: _Flat) -> array.array[int]:
        """The batch as the fused forward reads it."""
        return cpu_kernels.pack_batch(
            flat.input_ids,
            flat.positions,
            flat.write_k,
            flat.logit_rows,
            flat.starts,
            flat.q_lens,
            [s.num_cached for s in seqs],
            [s.block_table for s in seqs],
            _tree_masks(range(len(seqs)), seqs, flat),
        )

    def _forward_fused(self, seqs: list[ForwardSeq], flat: _Flat) -> torch.Tensor:
        """The whole forward in one C call (decode and verify batches of few tokens)."""
        assert self._fused is not None and self._paged is not None
        logits = torch.empty(len(flat.logit_rows), self.lm_head.shape[0])
        self._paged.forward(self.dtype, self._fused, self._pack(seqs, flat), logits)
        return logits

    def _paged_group(self, members: list[int], seqs: list[ForwardSeq], flat: _Flat) -> _PagedGroup:
        """Block tables, offsets and masks of the kernel's rows (`members` in seq order)."""
        dev = self.device
        q_lens, starts = flat.q_lens, flat.starts
        masks = _tree_masks(members, seqs, flat)
        width = max(len(seqs[m].block_table) for m in members)
        tables = [seqs[m].block_table + [0] * (width - len(seqs[m].block_table)) for m in members]
        offsets = [0]
        for m in members[:-1]:
            offsets.append(offsets[-1] + q_lens[m])
        contiguous = members == list(range(members[0], members[-1] + 1))
        return _PagedGroup(
            tables=torch.tensor(tables, device=dev),
            q_start=torch.tensor(offsets, device=dev),
            q_len=torch.tensor([q_lens[m] for m in members], device=dev),
            num_cached=torch.tensor([seqs[m].num_cached for m in members], device=dev),
            start=starts[members[0]],
            count=sum(q_lens[m] for m in members),
            token_rows=None
            if contiguous
            else torch.tensor(
                [starts[m] + i for m in members for i in range(q_lens[m])], device=dev
            ),
            masks=None
            if masks is None
            else (torch.tensor(masks.mask_from), torch.tensor(masks.bits, dtype=torch.int64)),
        )

    def _group(
        self,
        members: list[int],
        seqs: list[ForwardSeq],
        q_lens: list[int],
        kv_lens: list[int],
        starts: list[int],
    ) -> _AttnGroup:
        """Index and mask tensors of one SDPA call over the requests `members` (in seq order)."""
        bs = BLOCK_SIZE
        dev = self.device
        group = [seqs[m] for m in members]
        gq = [q_lens[m] for m in members]
        gkv = [kv_lens[m] for m in members]
        max_q, max_kv = max(gq), max(gkv)
        width = -(-max_kv // bs)
        tables = torch.tensor(
            [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in group],
            device=dev,
        )
        j = torch.arange(max_kv, device=dev)
        read_k = tables[:, j // bs] * (2 * bs) + j % bs
        padded = any(q != max_q for q in gq)
        contiguous = members == list(range(members[0], members[-1] + 1))
        g = _AttnGroup(
            read_k=read_k,
            read_v=read_k + bs,
            mask=None,
            causal=False,
            batch=len(members),
            max_q=max_q,
            start=starts[members[0]],
            q_gather=None,
            out_rows=None,
            token_rows=None,
            count=sum(gq),
        )
        if not contiguous:
            g.token_rows = torch.tensor(
                [starts[m] + i for m, q in zip(members, gq, strict=True) for i in range(q)],
                device=dev,
            )
        if padded or not contiguous:
            # Padding slots read any of the group's tokens; their outputs are dropped.
            g.q_gather = torch.tensor(
                [
                    starts[m] + min(i, q - 1)
                    for m, q in zip(members, gq, strict=True)
                    for i in range(max_q)
                ],
                device=dev,
            )
        if padded:
            g.out_rows = torch.tensor(
                [bi * max_q + i for bi, q in enumerate(gq) for i in range(q)], device=dev
            )
        if all(s.attn_mask is None for s in group):
            if max_q == 1 and all(n == max_kv for n in gkv):
                return g
            if not padded and all(s.num_cached == 0 for s in group):
                g.causal = True
                return g
        cached = torch.tensor([s.num_cached for s in group], device=dev)
        i = torch.arange(max_q, device=dev)
        mask = j.view(1, 1, -1) <= (cached.view(-1, 1, 1) + i.view(1, -1, 1))
        for bi, s in enumerate(group):
            if s.attn_mask is not None:
                q, kv = gq[bi], gkv[bi]
                c = kv - s.attn_mask.shape[1]
                mask[bi, :q, c:kv] = s.attn_mask.to(device=dev, dtype=torch.bool)
        g.mask = mask.unsqueeze(1)
        return g


def _group_requests(members: list[int], q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Split the batch rows `members` into SDPA calls whose padding stays close to the ragged
    work.

    Rows of at most SMALL_QUERY tokens (decode, verify) share one call: their q is near
    uniform and one padded call beats one call each. Longer rows (prefill chunks), largest
    first, join a call while its padded work (requests x max q x max kv) stays within
    PAD_SLACK times the sum of q x kv, so equal chunks batch and a chunk pays little for a
    neighbour's longer query or context.
    """
    small = [i for i in members if q_lens[i] <= SMALL_QUERY]
    groups = [small] if small else []
    large = sorted(
        (i for i in members if q_lens[i] > SMALL_QUERY),
        key=lambda i: (q_lens[i], kv_lens[i]),
        reverse=True,
    )
    current: list[int] = []
    for i in large:
        trial = [*current, i]
        padded = len(trial) * max(q_lens[m] for m in trial) * max(kv_lens[m] for m in trial)
        if current and padded > PAD_SLACK * sum(q_lens[m] * kv_lens[m] for m in trial):
            groups.append(sorted(current))
            trial = [i]
        current = trial
    if current:
        groups.append(sorted(current))
    return groups


def _flashinfer_usable(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and importlib.util.find_spec("flashinfer") is not None
    )


class _FlashInferAttention:
    """Thin adapter over FlashInfer's paged prefill wrapper (ragged q, q = 1 included)."""

    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, runner: ModelRunner) -> None:
        import flashinfer

        self.runner = runner
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=runner.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(
        self, seqs: list[ForwardSeq], q_lens: list[int], kv_lens: list[int]
    ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        cfg = self.runner.config
        dev = self.runner.device
        qo_indptr, kv_indptr, kv_indices, last_len = [0], [0], [], []
        custom = any(s.attn_mask is not None for s in seqs)
        masks = []
        for s, q, kv_len in zip(seqs, q_lens, kv_lens, strict=True):
            pages = -(-kv_len // BLOCK_SIZE)
            qo_indptr.append(qo_indptr[-1] + q)
            kv_indptr.append(kv_indptr[-1] + pages)
            kv_indices.extend(s.block_table[:pages])
            last_len.append(kv_len - (pages - 1) * BLOCK_SIZE)
            if custom:
                # One tree in the batch makes every request's mask explicit (causal ones too).
                full = torch.ones(q, kv_len, dtype=torch.bool)
                if s.attn_mask is None:
                    full = torch.tril(full, diagonal=s.num_cached)
                else:
                    full[:, kv_len - s.attn_mask.shape[1] :] = s.attn_mask.to("cpu", torch.bool)
                masks.append(full.flatten())

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        self.wrapper.plan(
            i32(qo_indptr),
            i32(kv_indptr),
            i32(kv_indices),
            i32(last_len),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            BLOCK_SIZE,
            causal=not custom,
            custom_mask=torch.cat(masks).to(dev) if custom else None,
            q_data_type=self.runner.dtype,
        )
        return self._attend

    def _attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        out = self.wrapper.run(q.contiguous(), self.runner.kv[layer])
        return out.reshape(q.shape[0], -1)
