"""How the baseline schedulers are sized, shared by the live cluster and the simulator.

Sarathi-Serve picks one chunk size per replica from the tightest TPOT it must hold; vLLM
(no chunking) must batch at least the longest prefill a request may need.
"""

from __future__ import annotations

from replica.perf_model import BatchShape, PerfModel
from replica.planner.vllm import VllmConfig

DEFAULT_VLLM_BATCHED_TOKENS = VllmConfig().max_num_batched_tokens


def sarathi_token_budget(perf: PerfModel, tpot_s: float) -> int:
    """Largest step (query tokens, one chunk on an empty cache) the perf model fits in
    `tpot_s`: Sarathi-Serve's chunk size chosen from the tightest TPOT; at least 1."""

    def fits(n: int) -> bool:
        return perf.predict(BatchShape((n,), (0,), tp=perf.tp)) <= tpot_s

    if not fits(1):
        return 1
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def vllm_config(longest_prefill: int) -> VllmConfig:
    """vLLM's default batch size, raised to the longest unchunked prefill it must run (a
    resume after preemption feeds prompt and output at once)."""
    return VllmConfig(max_num_batched_tokens=max(DEFAULT_VLLM_BATCHED_TOKENS, longest_prefill))
