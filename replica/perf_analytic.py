"""Analytic GPU profiles: FLOPs and bytes per batch over datasheet rates, for simulation.

No GPU is at hand, so the A100/H100 profiles the simulator uses are derived, not measured. Per
GPU and step (bf16, tensor parallel degree tp, Megatron sharding, draft replicated at TP 1):

    gemm      = max((tokens * 2 * P_layers + requests * 2 * d * V) / tp / (FLOPS * e_gemm),
                    weight_bytes / tp / (BW * e_mem))
    attention = max(attn_pairs * 4 * L * d_attn / tp / (FLOPS * e_attn),
                    kv_tokens * kv_bytes_per_token / tp / (BW * e_kv))
    draft     = draft_steps * (launches + draft_weight_bytes / (BW * e_mem))
                + draft_tokens * 2 * P_draft / (FLOPS * e_gemm)
                + draft_kv_tokens * (kv_bytes_d / (BW * e_kv) + 4 * L_d * d_d / (FLOPS * e_attn))
    T = overhead + allreduce + draft + gemm + attention

A sum of two maxima is the max of four sums, so T is exactly a 4-term PerfModel. The logits
GEMM is charged per request (one sampled position each; verify positions beyond it are ignored).
Every assumption is written into the profile's `assumptions`, with reference predictions in its
`notes`. `python -m replica.perf_analytic --out deploy/profiles` regenerates the shipped files;
a test re-runs `analytic_profiles()` and compares.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from replica.perf_info import ProfileInfo
from replica.perf_model import FEATURES, BatchShape, PerfModel, Term

ANALYTIC_DATE = "2026-11-22"
BYTES_PER_PARAM = 2


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet rates of one GPU and the efficiency we assume it reaches."""

    name: str
    memory_gb: float
    bf16_tflops: float
    """Dense bf16 tensor-core peak."""
    hbm_tb_s: float
    allreduce_gb_s: float
    """NCCL ring bus bandwidth between the GPUs of a TP group (effective, not link peak)."""
    allreduce_latency_us: float
    gemm_efficiency: float
    attention_efficiency: float = 0.4
    memory_efficiency: float = 0.75
    kv_efficiency: float = 0.6


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer dimensions (from the model's config.json)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    """SwiGLU (3 MLP matrices, Llama) or plain (2 matrices, OPT)."""
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        attention = 2 * self.hidden * self.heads * self.head_dim
        attention += 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    @property
    def total_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layer_params + embeddings

    def kv_bytes_per_token(self, tp: int) -> int:
        """K and V of every layer on one GPU (KV heads split across tp, at least one each)."""
        kv_heads = max(self.kv_heads // tp, 1)
        return 2 * self.layers * kv_heads * self.head_dim * BYTES_PER_PARAM


A100_40GB = DeviceSpec("A100-40GB", 40, 312, 1.555, 200, 15, gemm_efficiency=0.6)
A100_80GB = DeviceSpec("A100-80GB", 80, 312, 2.039, 200, 15, gemm_efficiency=0.6)
H100_80GB = DeviceSpec("H100-80GB", 80, 989, 3.35, 350, 10, gemm_efficiency=0.5)
DEVICES = (A100_40GB, A100_80GB, H100_80GB)

OPT_125M = ModelSpec("OPT-125m", 12, 768, 12, 12, 3072, 50272, False, True)
OPT_7B = ModelSpec("OPT-7B", 32, 4096, 32, 32, 16384, 50272, False, True)
OPT_13B = ModelSpec("OPT-13B", 40, 5120, 40, 40, 20480, 50272, False, True)
OPT_30B = ModelSpec("OPT-30B", 48, 7168, 56, 56, 28672, 50272, False, True)
LLAMA_32_1B = ModelSpec("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, True, True)
LLAMA_31_8B = ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, True, False)
LLAMA_31_70B = ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, True, False)

CATALOGUE: tuple[tuple[ModelSpec, ModelSpec, int], ...] = (
    (OPT_7B, OPT_125M, 1),
    (OPT_13B, OPT_125M, 2),
    (OPT_30B, OPT_125M, 4),
    (LLAMA_31_8B, LLAMA_32_1B, 1),
    (LLAMA_31_70B, LLAMA_32_1B, 4),
)
"""(target, draft, tp) pairs profiled on every device they fit on."""

STEP_OVERHEAD_S = 2.0e-3
"""Scheduling, input preparation and sampling per step (host side)."""
LAYER_OVERHEAD_S = 40e-6
"""Kernel launches per target layer per step (no CUDA graphs assumed)."""
DRAFT_STEP_OVERHEAD_S = 0.5e-3
DRAFT_LAYER_OVERHEAD_S = 30e-6
MEMORY_UTILIZATION = 0.9
"""Share of device memory the server may use (vLLM's gpu_memory_utilization default)."""
WORKSPACE_GB = 2.0
"""Activations, CUDA context and allocator slack per GPU."""
MIN_KV_TOKENS = 8192
"""A combination fits only if, after weights, KV room for this many tokens remains."""


def kv_capacity_tokens(device: DeviceSpec, target: ModelSpec, draft: ModelSpec, tp: int) -> int:
    """Tokens the replica's KV cache holds: each of its tp GPUs stores 1/tp of every token's
    target KV (plus the replicated draft's KV) in what the weights leave free."""
    weights = (target.total_params / tp + draft.total_params) * BYTES_PER_PARAM
    free = MEMORY_UTILIZATION * device.memory_gb * 1e9 - weights - WORKSPACE_GB * 1e9
    per_token = target.kv_bytes_per_token(tp) + draft.kv_bytes_per_token(1)
    return max(0, int(free // per_token))


def fits(device: DeviceSpec, target: ModelSpec, draft: ModelSpec, tp: int) -> bool:
    return kv_capacity_tokens(device, target, draft, tp) >= MIN_KV_TOKENS


def _draft_coefficients(device: DeviceSpec, draft: ModelSpec) -> dict[str, float]:
    """Draft cost at TP 1: per sequential step (launches + weights), per drafted token (GEMMs
    and logits), per KV entry a drafted token attends to (KV read + attention FLOPs, added)."""
    bandwidth = device.hbm_tb_s * 1e12
    flops = device.bf16_tflops * 1e12
    weights = draft.total_params * BYTES_PER_PARAM / (bandwidth * device.memory_efficiency)
    token_flops = 2 * (draft.layer_params + draft.hidden * draft.vocab)
    attention_flops = 4 * draft.layers * draft.hidden
    return {
        "draft_steps": DRAFT_STEP_OVERHEAD_S + DRAFT_LAYER_OVERHEAD_S * draft.layers + weights,
        "draft_tokens": token_flops / (flops * device.gemm_efficiency),
        "draft_kv_tokens": draft.kv_bytes_per_token(1) / (bandwidth * device.kv_efficiency)
        + attention_flops / (flops * device.attention_efficiency),
    }


def _coefficients(**values: float) -> tuple[float, ...]:
    return tuple(values.get(name, 0.0) for name in FEATURES)


def analytic_profile(device: DeviceSpec, target: ModelSpec, draft: ModelSpec, tp: int) -> PerfModel:
    """The 4-term roofline profile of `target` (with `draft`) on `tp` GPUs of `device`."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not fits(device, target, draft, tp):
        raise ValueError(
            f"{target.name} at TP {tp} with draft {draft.name} does not fit on {device.name}: "
            f"KV room for {kv_capacity_tokens(device, target, draft, tp)} tokens "
            f"< {MIN_KV_TOKENS}"
        )
    flops = device.bf16_tflops * 1e12
    bandwidth = device.hbm_tb_s * 1e12
    gemm_token = 2 * target.layer_params / tp / (flops * device.gemm_efficiency)
    gemm_request = 2 * target.hidden * target.vocab / tp / (flops * device.gemm_efficiency)
    weight_bytes = (target.layer_params + target.hidden * target.vocab) * BYTES_PER_PARAM / tp
    weights_s = weight_bytes / (bandwidth * device.memory_efficiency)
    attention_pair = 4 * target.layers * target.hidden / tp / (flops * device.attention_efficiency)
    kv_token = target.kv_bytes_per_token(tp) / (bandwidth * device.kv_efficiency)
    allreduces = 2 * target.layers if tp > 1 else 0
    ring = 2 * (tp - 1) / tp
    allreduce_const = allreduces * device.allreduce_latency_us * 1e-6
    allreduce_token = (
        allreduces * ring * target.hidden * BYTES_PER_PARAM / (device.allreduce_gb_s * 1e9)
    )
    overhead = STEP_OVERHEAD_S + LAYER_OVERHEAD_S * target.layers + allreduce_const
    shared = _draft_coefficients(device, draft)
    gemm_compute = {"tokens": gemm_token + allreduce_token, "requests": gemm_request}
    gemm_memory = {"const": weights_s, "tokens": allreduce_token}
    terms = []
    for gemm_name, gemm in (("gemm-compute", gemm_compute), ("gemm-memory", gemm_memory)):
        for attn_name, attn in (
            ("attn-compute", {"attn_tokens": attention_pair}),
            ("attn-memory", {"kv_tokens": kv_token}),
        ):
            values = {**shared, **gemm, **attn}
            values["const"] = values.get("const", 0.0) + overhead
            terms.append(Term(f"{gemm_name}+{attn_name}", _coefficients(**values)))
    assumptions = {
        "bf16_tflops": device.bf16_tflops,
        "hbm_tb_s": device.hbm_tb_s,
        "gemm_efficiency": device.gemm_efficiency,
        "attention_efficiency": device.attention_efficiency,
        "memory_efficiency": device.memory_efficiency,
        "kv_efficiency": device.kv_efficiency,
        "allreduce_gb_s": device.allreduce_gb_s,
        "allreduce_latency_us": device.allreduce_latency_us,
        "step_overhead_s": STEP_OVERHEAD_S,
        "layer_overhead_s": LAYER_OVERHEAD_S,
        "draft_step_overhead_s": DRAFT_STEP_OVERHEAD_S,
        "draft_layer_overhead_s": DRAFT_LAYER_OVERHEAD_S,
        "draft_placement": "replicated on every GPU, TP 1",
        "target_params": target.total_params,
        "draft_params": draft.total_params,
        "memory_utilization": MEMORY_UTILIZATION,
        "workspace_gb": WORKSPACE_GB,
        "kv_capacity_tokens": kv_capacity_tokens(device, target, draft, tp),
        "kv_bytes_per_token_per_gpu": target.kv_bytes_per_token(tp),
    }
    info = ProfileInfo(
        source="analytic",
        backend="analytic-roofline",
        device=device.name,
        model=target.name,
        draft=draft.name,
        dtype="bfloat16",
        tp=tp,
        date=ANALYTIC_DATE,
        notes=(
            "Analytic: FLOPs and bytes per step over datasheet rates times the efficiency "
            "factors in `assumptions`; not measured.",
        ),
        assumptions=assumptions,
    )
    model = PerfModel(tuple(terms), info)
    return PerfModel(model.terms, _with_reference_notes(model))


def reference_points(model: PerfModel) -> dict[str, float]:
    """Predicted seconds of the steps the notes quote: decodes at context 512 (64 x 512 tokens
    fit in every catalogue combination's KV cache), a 2048-token prefill, a speculative step."""
    tp = model.tp

    def decode(batch: int) -> float:
        return model.predict(BatchShape((1,) * batch, (512,) * batch, tp=tp))

    return {
        "decode_b1_ctx512_s": decode(1),
        "decode_b64_ctx512_s": decode(64),
        "prefill_2048_s": model.predict(BatchShape((2048,), (0,), tp=tp)),
        "verify_b16_k4_ctx512_s": model.predict(
            BatchShape((5,) * 16, (512,) * 16, draft_steps=4, draft_batch=16, tp=tp)
        ),
    }


_PUBLISHED = (
    "Sanity check (approximate, from memory of public vLLM-class benchmarks, not re-measured): "
    "a 7B model decodes at batch 1 in roughly 12-20 ms per step on an A100 and 7-10 ms on an "
    "H100; a 70B model at TP 4 on H100 in roughly 20-30 ms; a 2k-token prefill of a 7B model "
    "takes roughly 150-250 ms on an A100."
)


def _with_reference_notes(model: PerfModel) -> ProfileInfo:
    points = reference_points(model)
    summary = ", ".join(f"{name} = {value * 1e3:.2f} ms" for name, value in points.items())
    return replace(model.info, notes=(*model.info.notes, f"Predicted: {summary}.", _PUBLISHED))


def profile_name(device: DeviceSpec, target: ModelSpec, tp: int) -> str:
    return f"{device.name}-{target.name}-tp{tp}".lower().replace(".", "")


def analytic_profiles() -> dict[str, PerfModel]:
    """Every catalogue combination that fits, by file stem."""
    return {
        profile_name(device, target, tp): analytic_profile(device, target, draft, tp)
        for device in DEVICES
        for target, draft, tp in CATALOGUE
        if fits(device, target, draft, tp)
    }


def write_analytic_profiles(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, model in analytic_profiles().items():
        path = out_dir / f"{name}.json"
        model.save(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the analytic GPU perf profiles")
    parser.add_argument("--out", type=Path, default=Path("deploy/profiles"))
    args = parser.parse_args(argv)
    for path in write_analytic_profiles(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
