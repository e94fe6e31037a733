"""Tensor parallelism over two real processes (gloo on 127.0.0.1): the split model computes what
the whole one does (token trees and KV moves included), for a rotary GQA model (the demo target)
and for OPT (biased projections, and a vocabulary that does not divide by the group's size)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replica.model_runner import ModelConfig, ModelRunner
from replica.tensor_parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import json, os, sys, torch
torch.set_num_threads(1)
from replica.kv_cache import KVCacheManager
from replica.model_runner import ForwardSeq, KVMove, ModelRunner
from replica.tensor_parallel import join, leave

rank, size, address, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
runner = ModelRunner(model, num_blocks=16, tp=join(rank, size, address, torch.device("cpu")))
if rank > 0:
    runner.serve_batches()
else:
    whole = ModelRunner(model, num_blocks=16)
    prompt = [(i * 7 + 3) % 290 + 5 for i in range(37)]
    diffs = []
    for r in (runner, whole):
        cache = KVCacheManager(r.num_blocks)
        out = []
        cache.append("a", 30)
        out.append(r.forward([ForwardSeq(prompt[:30], cache.block_table("a"), 0, 30)]))
        cache.append("a", 1)
        cache.append("b", 12)
        out.append(r.forward([
            ForwardSeq(prompt[30:31], cache.block_table("a"), 30, 1),
            ForwardSeq(prompt[:12], cache.block_table("b"), 0, 12),
        ]))
        # Two sibling drafts; the second is kept: every rank moves its KV after the context.
        cache.append("a", 2)
        table = cache.block_table("a")
        mask = torch.eye(2, dtype=torch.bool)
        out.append(r.forward([ForwardSeq(prompt[31:33], table, 31, 2, [31, 31], mask)]))
        r.move_kv([KVMove(table, [32], [31])])
        cache.truncate("a", 32)
        cache.append("a", 1)
        out.append(r.forward([ForwardSeq(prompt[33:34], cache.block_table("a"), 32, 1)]))
        diffs.append(torch.cat(out))
    runner.stop_group()
    print(json.dumps({
        "max_diff": (diffs[0] - diffs[1]).abs().max().item(),
        "heads": [runner.config.num_heads, whole.config.num_heads],
        "vocab_rows": [runner.embed.shape[0], runner.lm_head.shape[0], whole.embed.shape[0]],
        "kv_blocks_bytes": [runner.config.kv_bytes_per_block(torch.float32),
                            whole.config.kv_bytes_per_block(torch.float32)],
    }), flush=True)
leave()
# torch's TCPStore server (rank 0 hosts it) can abort in its destructor at interpreter exit
# ("terminate called without an active exception"); the group is already left cleanly.
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_group(model: Path, size: int = 2) -> dict[str, object]:
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(size), address, str(model)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(size)
    ]
    outputs = [p.communicate(timeout=120) for p in ranks]
    for rank, (p, (_, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert p.returncode == 0, (rank, err)
    result: dict[str, object] = json.loads(outputs[0][0])
    return result


def test_two_ranks_compute_the_demo_target(target_dir: Path) -> None:
    result = _run_group(target_dir)
    assert isinstance(result["max_diff"], float) and result["max_diff"] < 1e-4
    assert result["heads"] == [4, 8]
    assert result["vocab_rows"] == [2048, 2048, 4096]
    assert result["kv_blocks_bytes"][0] * 2 == result["kv_blocks_bytes"][1]  # type: ignore[index]


def test_two_ranks_compute_opt_with_its_biases_counted_once_and_an_odd_vocabulary(
    tmp_path: Path, opt_checkpoint: Callable[..., Path]
) -> None:
    result = _run_group(opt_checkpoint(tmp_path, vocab_size=301))
    assert isinstance(result["max_diff"], float) and result["max_diff"] < 1e-4
    assert result["vocab_rows"] == [151, 151, 301]


def test_a_rank_takes_its_heads_and_columns_and_rank_0_the_shared_biases() -> None:
    full = {
        "l.self_attn.q_proj.weight": torch.arange(24.0).view(6, 4),
        "l.self_attn.out_proj.weight": torch.arange(24.0).view(4, 6),
        "l.self_attn.out_proj.bias": torch.ones(4),
        "l.input_layernorm.weight": torch.ones(4),
    }

    def take(rank: int, name: str) -> torch.Tensor:
        return TensorParallel(rank, 2, None, None).take(name, full[name], full[name].shape)

    q, o = full["l.self_attn.q_proj.weight"], full["l.self_attn.out_proj.weight"]
    assert torch.equal(take(1, "l.self_attn.q_proj.weight"), q[3:])
    assert torch.equal(take(1, "l.self_attn.out_proj.weight"), o[:, 3:])
    assert torch.equal(take(1, "l.self_attn.out_proj.bias"), torch.zeros(4))
    assert torch.equal(take(0, "l.self_attn.out_proj.bias"), torch.ones(4))
    assert torch.equal(take(1, "l.input_layernorm.weight"), torch.ones(4))
    with pytest.raises(ValueError, match="6 rows or columns do not split over 4 ranks"):
        TensorParallel(0, 4, None, None).take("l.self_attn.q_proj.weight", q, q.shape)


def test_a_rank_takes_its_range_of_the_vocabulary_padded_to_an_equal_share() -> None:
    table = torch.arange(10.0).view(5, 2)

    def take(rank: int, name: str) -> torch.Tensor:
        return TensorParallel(rank, 2, None, None).take(name, table, table.shape)

    assert torch.equal(take(0, "model.embed_tokens.weight"), table[:3])
    assert torch.equal(take(1, "lm_head.weight"), torch.cat([table[3:], torch.zeros(1, 2)]))
    assert torch.equal(take(1, "model.decoder.embed_positions.weight"), table)


def test_a_model_that_does_not_split_evenly_is_refused(target_dir: Path) -> None:
    config = ModelConfig.from_dir(target_dir)
    with pytest.raises(ValueError, match=r"tensor parallelism over 3 needs num_heads \(8\)"):
        config.sharded(3)


def test_a_cut_head_is_refused_on_a_split_model(target_dir: Path) -> None:
    with pytest.raises(ValueError, match="a cut head"):
        ModelRunner(
            target_dir, num_blocks=4, head_vocab=[1, 2], tp=TensorParallel(0, 2, None, None)
        )
