"""Tensor parallelism: one replica's model split by attention heads, MLP columns and vocabulary
over a group of processes (Megatron-style), each holding its shard of the weights and of the KV
cache.

Rank 0 runs the engine (scheduling, the draft, sampling); every forward it sends the batch to
the other ranks, all compute their heads and columns, and the attention output and MLP
projections are summed with one all-reduce each per layer. The embedding and the LM head are
split by token id, so no rank holds the vocabulary's rows whole (a large share of a big model's
weights): each rank looks up the tokens in its range (one all-reduce joins them) and computes its
range's logits (gathered on rank 0, which samples). NCCL between GPUs, gloo on CPU; the batches
always go over a gloo group, since they are Python objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROW_SPLIT = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.", "fc1.")
"""Weights (and biases) whose output rows are split: each rank computes its heads/columns."""
COLUMN_SPLIT = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "fc2.weight")
"""Weights whose input columns are split: each rank's product is a partial sum."""
ONCE = ("out_proj.bias", "fc2.bias")
"""Biases of the summed projections: added by rank 0 alone, so the sum counts them once."""
VOCAB_SPLIT = ("embed_tokens.weight", "lm_head.weight")
"""Rows split by token id; the last rank's range is padded with zero rows, so a vocabulary that
does not divide by the group's size still splits into equal shards."""


@dataclass
class TensorParallel:
    """This process's place in a replica's tensor-parallel group."""

    rank: int
    size: int
    device_group: Any
    """Sums the partial products (NCCL on GPUs, gloo on CPU)."""
    batch_group: Any
    """Carries the batches from rank 0 (gloo)."""

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.device_group)
        return partial

    def embed(self, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` from the vocabulary-split table whose shard this rank holds: each rank
        fills the tokens in its range, zeros elsewhere, and the sum is every token's row."""
        local = ids - self.rank * shard.shape[0]
        outside = (local < 0) | (local >= shard.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), shard)
        return self.all_reduce(rows.masked_fill_(outside.unsqueeze(1), 0))

    def gather_logits(self, part: torch.Tensor, vocab: int) -> torch.Tensor:
        """Rank 0: every rank's logit columns side by side, the padding dropped; [rows, vocab].
        Other ranks send theirs and get an empty tensor."""
        part = part.contiguous()
        if self.rank > 0:
            dist.gather(part, None, dst=0, group=self.device_group)
            return part[:, :0]
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.gather(part, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=1)[:, :vocab]

    def send_batch(self, batch: object) -> None:
        """Rank 0: the next forward's batch (or KV moves, model_runner.move_kv), or None to stop
        the other ranks."""
        dist.broadcast_object_list([batch], src=0, group=self.batch_group)

    def receive_batch(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.batch_group)
        return box[0]

    def take(self, name: str, source: Any, shape: Sequence[int]) -> torch.Tensor:
        """This rank's piece of checkpoint tensor `name` read from `source` (a tensor, or a
        safetensors slice that reads only the piece): heads and MLP columns split evenly, the
        vocabulary's rows in padded equal ranges, and the summed projections' biases kept by
        rank 0 (zero elsewhere)."""
        if name.endswith(VOCAB_SPLIT):
            return self._vocab_rows(source, shape[0])
        if name.endswith(ONCE):
            whole: torch.Tensor = source[:]
            return whole if self.rank == 0 else torch.zeros_like(whole)
        if any(part in name for part in ROW_SPLIT):
            return source[self._range(shape[0])]
        if name.endswith(COLUMN_SPLIT):
            return source[:, self._range(shape[1])]
        return source[:]

    def _vocab_rows(self, source: Any, vocab: int) -> torch.Tensor:
        step = -(-vocab // self.size)
        start = min(self.rank * step, vocab)
        rows: torch.Tensor = source[start : min(start + step, vocab)]
        if rows.shape[0] == step:
            return rows
        padding = rows.new_zeros(step - rows.shape[0], *rows.shape[1:])
        return torch.cat([rows, padding])

    def _range(self, length: int) -> slice:
        if length % self.size:
            raise ValueError(f"{length} rows or columns do not split over {self.size} ranks")
        step = length // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def join(
    rank: int,
    size: int,
    address: str,
    device: torch.device,
    timeout: timedelta = timedelta(minutes=10),
) -> TensorParallel:
    """Join the group rendezvousing at `address` (tcp://host:port); blocks until all have,
    or raises after `timeout` (also the limit of every later collective)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=size, timeout=timeout
    )
    world = dist.group.WORLD
    batches = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank, size, world, batches)


def leave() -> None:
    """Leave together: a rank that tore down alone would cut the others' store connection
    (rank 0 hosts it) while they still use it."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
