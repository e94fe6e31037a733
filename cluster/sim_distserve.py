"""DistServe-style disaggregation in the simulator: pool sizes and the KV link.

A prefill replica computes a prompt and its first token; the prompt's KV cache then crosses a
link to a decode replica. Each prefill replica has one outgoing link of `gb_s` bandwidth whose
transfers run one at a time in the order prompts finished, so a burst of prefills queues on
it. The paper reports DistServe's best of the 1:1, 2:1 and 1:2 prefill:decode allocations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATIOS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2))
"""Prefill:decode allocations the paper tries for DistServe."""
DEFAULT_LINK_GB_S = 200.0
"""KV link bandwidth: the analytic A100 profiles' interconnect assumption (`allreduce_gb_s`),
NVLink-class as on the paper's a2-highgpu-4g VMs."""


def pool_splits(instances: int) -> list[tuple[int, int]]:
    """(prefill, decode) replica counts for each ratio in RATIOS over `instances` replicas,
    rounded to the nearest split that keeps both pools non-empty; duplicates dropped (two
    replicas only split 1:1)."""
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 2:
        raise ValueError(f"distserve needs >= 2 replicas (one per pool), got {instances!r}")
    splits: list[tuple[int, int]] = []
    for prefill_share, decode_share in RATIOS:
        prefill = round(instances * prefill_share / (prefill_share + decode_share))
        prefill = min(max(prefill, 1), instances - 1)
        if (prefill, instances - prefill) not in splits:
            splits.append((prefill, instances - prefill))
    return splits


@dataclass
class KvLink:
    """One prefill replica's outgoing link: FIFO transfers at a fixed bandwidth."""

    gb_s: float
    bytes_per_token: float
    free_at: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gb_s) and self.gb_s > 0):
            raise ValueError(f"kv_link_gb_s must be > 0, got {self.gb_s!r}")
        if not (math.isfinite(self.bytes_per_token) and self.bytes_per_token > 0):
            raise ValueError(f"kv_bytes_per_token must be > 0, got {self.bytes_per_token!r}")

    def duration_s(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / (self.gb_s * 1e9)

    def send(self, now: float, tokens: int) -> float:
        """Queue a transfer of `tokens` tokens' KV at `now`; returns when it lands."""
        start = max(now, self.free_at)
        self.free_at = start + self.duration_s(tokens)
        return self.free_at
