"""The C kernels: paged attention against SDPA, the fused forward against the PyTorch path, and
the runner with and without them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replica import cpu_kernels
from replica.cpu_kernels import MASK_WINDOW, mask_bits
from replica.kv_cache import KVCacheManager
from replica.model_runner import (
    BLOCK_SIZE,
    FUSED_MAX_TOKENS,
    SMALL_QUERY,
    ForwardSeq,
    ModelRunner,
    _fits_fused,
)
from replica.planner.specserve import acceptance_products, drafted_length
from replica.spec.draft import load_draft_vocab

kernel = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler to build the kernel")

HEADS, KV_HEADS, HEAD_DIM, BLOCKS = 8, 4, 32, 24


def reference(
    q: torch.Tensor, pool: torch.Tensor, table: list[int], cached: int, n_q: int
) -> torch.Tensor:
    """One request's rows by SDPA over its context copied out of the pool."""
    ctx = cached + n_q
    keys = torch.cat([pool[b, 0] for b in table])[:ctx].float()
    values = torch.cat([pool[b, 1] for b in table])[:ctx].float()
    allowed = torch.arange(ctx).view(1, -1) <= cached + torch.arange(n_q).view(-1, 1)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=allowed,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_for_decode_and_verify_rows(dtype: torch.dtype) -> None:
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    # (cached, new tokens): empty context, block edges, decode and verify rows.
    rows = [(0, 1), (15, 1), (16, 3), (47, 9), (100, 1), (31, 2)]
    order = torch.randperm(BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for cached, n_q in rows:
        need = -(-(cached + n_q) // BLOCK_SIZE)
        tables.append(order[used : used + need])
        used += need
    width = max(len(t) for t in tables)
    total = sum(n for _, n in rows)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = [0]
    for _, n_q in rows[:-1]:
        starts.append(starts[-1] + n_q)

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    out = kernel.attention(
        q,
        pool,
        i64([t + [0] * (width - len(t)) for t in tables]).view(len(rows), width),
        i64(starts),
        i64([n for _, n in rows]),
        i64([c for c, _ in rows]),
        BLOCK_SIZE,
        HEAD_DIM**-0.5,
    )
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    for (cached, n_q), start, table in zip(rows, starts, tables, strict=True):
        want = reference(q[start : start + n_q], pool, table, cached, n_q)
        assert torch.allclose(out[start : start + n_q].float(), want, atol=tol), (cached, n_q)


@needs_kernel
def test_kernel_refuses_a_block_size_that_is_not_a_power_of_two() -> None:
    assert kernel is not None
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="power of two"):
        kernel.attention(
            torch.zeros(1, HEADS, HEAD_DIM),
            torch.zeros(2, 2, 12, KV_HEADS, HEAD_DIM),
            torch.zeros(1, 1, dtype=torch.int64),
            one,
            one + 1,
            one,
            12,
            1.0,
        )


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """A -ffast-math link would switch the process to flush-to-zero when the library loads."""
    assert kernel is not None
    tiny = sys.float_info.min
    assert tiny / 2 > 0
    assert torch.tensor(tiny, dtype=torch.float64).div(2).item() > 0


def test_disabling_the_kernel_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        cpu_kernels.load.cache_clear()


@needs_kernel
def test_runner_gives_the_same_logits_with_and_without_the_kernel(target_dir: Path) -> None:
    """A batch with every kind of row: decode, verify, a tree-masked verify row and one whose
    mask also hides cached keys (the kernel reads both), a mask reaching back past the
    kernel's window (SDPA even with the kernel) and a prefill chunk on a cached context."""
    runners = [ModelRunner(target_dir, num_blocks=32, paged_kernel=flag) for flag in (True, False)]
    assert runners[0]._paged is not None and runners[1]._paged is None
    prompts = {
        rid: [(i * 31 + n) % 4000 + 2 for i in range(40 + 9 * n)] for n, rid in enumerate("abcdef")
    }
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)

    def over_cached(rid: str, hidden: int) -> torch.Tensor:
        """The tree after the prompt of `rid`, its last two nodes not seeing cached key
        `hidden` (the prompt's fourth last key, or its first)."""
        mask = torch.ones(3, len(prompts[rid]) + 3, dtype=torch.bool)
        mask[:, -3:] = tree
        mask[1:, hidden] = False
        return mask

    wide, far = over_cached("e", -7), over_cached("f", 0)
    assert mask_bits(wide, wide.shape[1]) is not None and mask_bits(far, far.shape[1]) is None
    rows = (("a", 1, None), ("b", 4, None), ("c", 3, tree), ("d", 20, None))
    rows += (("e", 3, wide), ("f", 3, far))
    results = []
    for runner in runners:
        cache = KVCacheManager(runner.num_blocks)
        for rid, prompt in prompts.items():
            cache.append(rid, len(prompt))
            runner.forward([ForwardSeq(prompt, cache.block_table(rid), 0)])
        batch = []
        for rid, n, mask in rows:
            cached = len(prompts[rid])
            cache.append(rid, n)
            positions = [cached, cached + 1, cached + 1] if mask is not None else None
            batch.append(
                ForwardSeq(
                    [7 + i for i in range(n)],
                    cache.block_table(rid),
                    cached,
                    num_logits=n,
                    positions=positions,
                    attn_mask=mask,
                )
            )
        results.append(runner.forward(batch))
    assert torch.allclose(results[0], results[1], atol=1e-4)


def _two_steps(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill four requests, then a decode/verify step (one row a token tree with explicit
    positions) and a decode step on top: logits of both steps and the KV pool in between."""
    prompts = {
        rid: [(i * 31 + n) % 4000 + 2 for i in range(40 + 9 * n)] for n, rid in enumerate("abcd")
    }
    cache = KVCacheManager(runner.num_blocks)
    for rid, prompt in prompts.items():
        cache.append(rid, len(prompt))
        runner.forward([ForwardSeq(prompt, cache.block_table(rid), 0)])
    batch = []
    for rid, n in (("a", 1), ("b", 4), ("c", 3), ("d", 1)):
        cached = len(prompts[rid])
        cache.append(rid, n)
        tree = rid == "c"
        positions = [cached, cached + 1, cached + 1] if tree else None
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool) if tree else None
        table = cache.block_table(rid)
        batch.append(ForwardSeq([7 + i for i in range(n)], table, cached, n, positions, mask))
    first = runner.forward(batch)
    pool = runner.kv.clone()
    second = []
    for rid in "abcd":
        cached = cache.num_tokens(rid)
        cache.append(rid, 1)
        second.append(ForwardSeq([11], cache.block_table(rid), cached, num_logits=1))
    return first, pool, runner.forward(second)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", ["target", "draft"])
def test_fused_forward_matches_the_pytorch_path(
    dtype: torch.dtype, model: str, target_dir: Path, draft_dir: Path
) -> None:
    """Logits and the KV it writes, for decode and verify rows; the draft has a cut head."""
    path = target_dir if model == "target" else draft_dir
    head = load_draft_vocab(draft_dir) if model == "draft" else None
    runners = [
        ModelRunner(path, num_blocks=32, dtype=dtype, head_vocab=head, fused_forward=flag)
        for flag in (True, False)
    ]
    assert runners[0]._fused is not None and runners[1]._fused is None
    (a1, pool_a, a2), (b1, pool_b, b2) = (_two_steps(r) for r in runners)
    # bf16: PyTorch rounds every activation to bf16, the fused forward keeps them in fp32.
    tol = 1e-4 if dtype is torch.float32 else 0.3
    assert torch.allclose(a1, b1, atol=tol)
    assert torch.allclose(pool_a.float(), pool_b.float(), atol=tol)
    assert torch.allclose(a2, b2, atol=tol)
    if dtype is torch.float32:
        assert torch.equal(a1.argmax(-1), b1.argmax(-1))


def test_a_mask_that_hides_a_tokens_own_key_is_left_to_sdpa() -> None:
    """The kernel's softmax starts from the token's own score, so such a mask has no bits."""
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert mask_bits(tree, 10) == (8, [1, 3])
    assert mask_bits(torch.tensor([[1, 0], [1, 0]], dtype=torch.bool), 10) is None


def test_only_decode_and_verify_batches_take_the_fused_forward(draft_dir: Path) -> None:
    runner = ModelRunner(draft_dir, num_blocks=16, fused_forward=False)

    def fits(*rows: tuple[int, int, torch.Tensor | None]) -> bool:
        seqs = [ForwardSeq([1] * q, [0] * 8, c, attn_mask=mask) for q, c, mask in rows]
        return _fits_fused(runner._flatten(seqs), torch.float32)

    tree = torch.ones(3, 3, dtype=torch.bool)
    near = torch.ones(2, 80 + 2, dtype=torch.bool)
    near[1, 80 + 2 - MASK_WINDOW] = False
    far = torch.ones(2, 80 + 2, dtype=torch.bool)
    far[1, 80 + 1 - MASK_WINDOW] = False
    assert fits((1, 4, None), (SMALL_QUERY, 4, None))
    assert not fits((1, 4, None), (SMALL_QUERY + 1, 4, None)), "a prefill chunk"
    assert fits((1, 4, None), (3, 4, tree)), "a token tree"
    assert fits((1, 4, None), (2, 80, near)), "a tree hiding cached keys in the window"
    assert not fits((1, 4, None), (2, 80, far)), "a mask reaching back past the window"
    assert not fits(*[(1, 4, None)] * (FUSED_MAX_TOKENS[torch.float32] + 1)), "a large batch"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_chain_equals_stepping_the_fused_forward(
    dtype: torch.dtype, draft_dir: Path
) -> None:
    """Every step of the C loop (cut head, rows of 1-3 catch-up tokens, a different step count
    per request) gives the argmax one fused forward per step gives, with its softmax
    probability as the confidence, and writes the same KV."""
    vocab = load_draft_vocab(draft_dir)
    runners = [ModelRunner(draft_dir, num_blocks=32, dtype=dtype, head_vocab=vocab) for _ in "ab"]
    prompts = {
        rid: [(i * 17 + n) % 4000 + 2 for i in range(30 + 7 * n)] for n, rid in enumerate("xyz")
    }
    feeds, steps = {"x": [5], "y": [9, 14, 3], "z": [40, 41]}, {"x": 4, "y": 1, "z": 3}
    caches = [KVCacheManager(r.num_blocks) for r in runners]
    for runner, cache in zip(runners, caches, strict=True):
        for rid, prompt in prompts.items():
            cache.append(rid, len(prompt))
            runner.forward([ForwardSeq(prompt, cache.block_table(rid), 0)])
            cache.append(rid, len(feeds[rid]) + steps[rid] - 1)
    chained, stepped = runners
    cache = caches[0]
    seqs = [ForwardSeq(feeds[rid], cache.block_table(rid), len(prompts[rid]), 1) for rid in "xyz"]
    got = chained.greedy_chain(seqs, [steps[rid] for rid in "xyz"], confident=True)
    want: dict[str, list[int]] = {rid: [] for rid in "xyz"}
    sure: dict[str, list[float]] = {rid: [] for rid in "xyz"}
    pending = dict(feeds)
    cached = {rid: len(p) for rid, p in prompts.items()}
    for step in range(max(steps.values())):
        live = [rid for rid in "xyz" if steps[rid] > step]
        batch = [
            ForwardSeq(pending[rid], caches[1].block_table(rid), cached[rid], 1) for rid in live
        ]
        assert vocab is not None
        logits = stepped.forward(batch)
        tokens = [vocab[c] for c in logits.argmax(-1).tolist()]
        for rid, token, p in zip(live, tokens, logits.softmax(-1).amax(-1).tolist(), strict=True):
            want[rid].append(token)
            sure[rid].append(p)
            cached[rid] += len(pending[rid])
            pending[rid] = [token]
    assert [tokens for tokens, _ in got] == [want[rid] for rid in "xyz"]
    assert all(len(g) == steps[rid] for (g, _), rid in zip(got, "xyz", strict=True))
    for (_, confidences), rid in zip(got, "xyz", strict=True):
        assert confidences == pytest.approx(sure[rid], rel=1e-4)
    assert torch.equal(chained.kv, stepped.kv)
    plain = chained.greedy_chain(seqs, [steps[rid] for rid in "xyz"])
    assert plain == [(tokens, None) for tokens, _ in got], "no confidences unless asked"


@needs_kernel
@pytest.mark.parametrize("calibrated", [False, True], ids=["confidences", "calibrated"])
def test_greedy_chain_stops_a_request_below_its_floor(draft_dir: Path, calibrated: bool) -> None:
    """With floors, each request's chain ends where SpecServe's drafter rule (the Python
    `drafted_length`, on the tokens' confidences or on their bins' chances in a calibration
    table) says, and its tokens are the first ones of the full chain."""
    runner = ModelRunner(draft_dir, num_blocks=32, head_vocab=load_draft_vocab(draft_dir))
    cache = KVCacheManager(runner.num_blocks)
    prompts = {
        rid: [(i * 13 + n) % 3000 + 5 for i in range(20 + 5 * n)] for n, rid in enumerate("xy")
    }
    for rid, prompt in prompts.items():
        cache.append(rid, len(prompt) - 1)
        runner.forward([ForwardSeq(prompt[:-1], cache.block_table(rid), 0)])
        cache.append(rid, 8)
    table = [0.3 + 0.07 * b for b in range(10)] if calibrated else None

    def chain(floors: list[float] | None) -> list[tuple[list[int], list[float]]]:
        seqs = [
            ForwardSeq([p[-1]], cache.block_table(rid), len(p) - 1, 1) for rid, p in prompts.items()
        ]
        made = runner.greedy_chain(seqs, [8, 8], True, floors, table)
        return [(tokens, confidences or []) for tokens, confidences in made]

    def chances(confidences: list[float]) -> list[float]:
        return confidences if table is None else [table[min(9, int(c * 10))] for c in confidences]

    full = chain(None)
    # Floors between the requests' predicted acceptances, so each stops somewhere inside.
    floors = []
    for _, confidences in full:
        odds = chances(confidences)
        products = acceptance_products(odds)
        predicted = sorted(p * c for p, c in zip(products, odds, strict=True))
        floors.append((predicted[3] + predicted[4]) / 2)
    stopped = chain(floors)
    for (tokens, confidences), (short, short_conf), floor in zip(
        full, stopped, floors, strict=True
    ):
        n = drafted_length(chances(confidences), floor)
        assert short == tokens[:n] and short_conf == pytest.approx(confidences[:n])
        assert 1 <= n < 8


@needs_kernel
def test_greedy_chain_refuses_what_it_cannot_run(draft_dir: Path) -> None:
    runner = ModelRunner(draft_dir, num_blocks=8)
    prompt = list(range(2, 20))
    short = ForwardSeq(prompt[:4], [0], 0, 1)
    with pytest.raises(ValueError, match="cannot hold the 19 tokens of 16 steps"):
        runner.greedy_chain([short], [16])
    with pytest.raises(ValueError, match="rows of at most"):
        runner.greedy_chain([ForwardSeq(prompt, [0, 1], 0, 1)], [2])
    with pytest.raises(ValueError, match="one step count >= 1"):
        runner.greedy_chain([short], [0])
    with pytest.raises(ValueError, match="act on confidences"):
        runner.greedy_chain([short], [2], floors=[0.5])
    assert not runner.can_chain([SMALL_QUERY + 1])
    assert runner.can_chain([SMALL_QUERY, 1])
