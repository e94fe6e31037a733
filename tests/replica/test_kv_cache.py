"""KV block allocator: invariants under random operation sequences, and clean refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.kv_cache import CacheFullError, KVCacheManager


def test_append_allocates_blocks_as_tokens_cross_block_boundaries() -> None:
    cache = KVCacheManager(num_blocks=4, block_size=16)
    assert cache.append("a", 16) == [0]
    assert cache.append("a", 1) == [1]
    assert cache.append("a", 15) == []
    assert cache.block_table("a") == [0, 1]
    assert cache.num_tokens("a") == 32
    assert cache.num_used_blocks == 2
    assert cache.usage == 0.5


def test_full_pool_refuses_without_partial_allocation() -> None:
    cache = KVCacheManager(num_blocks=3, block_size=16)
    cache.append("a", 20)
    with pytest.raises(CacheFullError, match="needs 2 more blocks; 1 are free"):
        cache.append("b", 17)
    assert cache.block_table("b") == []
    assert cache.num_free_blocks == 1
    with pytest.raises(CacheFullError):
        cache.append("a", 30)
    assert cache.num_tokens("a") == 20
    assert cache.block_table("a") == [0, 1]


def test_truncate_and_free_return_blocks() -> None:
    cache = KVCacheManager(num_blocks=4, block_size=4)
    cache.append("a", 10)
    cache.truncate("a", 4)
    assert cache.block_table("a") == [0]
    assert cache.num_free_blocks == 3
    cache.free("a")
    assert cache.num_free_blocks == 4
    assert cache.num_tokens("a") == 0


def test_bad_arguments_are_refused() -> None:
    cache = KVCacheManager(num_blocks=2, block_size=4)
    cache.append("a", 3)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate("a", 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.append("a", -1)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0)


operations = st.lists(
    st.tuples(
        st.sampled_from(["append", "truncate", "free"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(min_value=0, max_value=40),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_random_sequences_keep_blocks_unique_and_accounted(ops: list[tuple[str, str, int]]) -> None:
    cache = KVCacheManager(num_blocks=8, block_size=4)
    model: dict[str, int] = {}
    for op, rid, n in ops:
        before = {r: cache.block_table(r) for r in "abc"}
        if op == "append":
            need = cache.blocks_for(model.get(rid, 0) + n) - len(before[rid])
            if need > cache.num_free_blocks:
                with pytest.raises(CacheFullError):
                    cache.append(rid, n)
                assert {r: cache.block_table(r) for r in "abc"} == before
            else:
                cache.append(rid, n)
                model[rid] = model.get(rid, 0) + n
                assert cache.block_table(rid)[: len(before[rid])] == before[rid]
        elif op == "truncate":
            target = min(n, model.get(rid, 0))
            cache.truncate(rid, target)
            if rid in model:
                model[rid] = target
            assert cache.block_table(rid) == before[rid][: cache.blocks_for(target)]
        else:
            cache.free(rid)
            model.pop(rid, None)
        tables = [cache.block_table(r) for r in "abc"]
        owned = [b for t in tables for b in t]
        assert len(owned) == len(set(owned)), "a block is shared"
        assert len(owned) + cache.num_free_blocks == cache.num_blocks, "a block leaked"
        for r in "abc":
            assert cache.num_tokens(r) == model.get(r, 0)
            assert len(cache.block_table(r)) == cache.blocks_for(model.get(r, 0))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 20)), max_size=8),
    st.integers(min_value=0, max_value=40),
)
def test_append_then_truncate_back_restores_exactly(
    setup: list[tuple[str, int]], extra: int
) -> None:
    cache = KVCacheManager(num_blocks=16, block_size=4)
    for rid, n in setup:
        if cache.extra_blocks_needed(rid, n) <= cache.num_free_blocks:
            cache.append(rid, n)
    table, tokens, free = cache.block_table("a"), cache.num_tokens("a"), cache.num_free_blocks
    other = cache.block_table("b")
    if cache.extra_blocks_needed("a", extra) <= free:
        cache.append("a", extra)
        cache.truncate("a", tokens)
    assert cache.block_table("a") == table
    assert cache.num_tokens("a") == tokens
    assert cache.num_free_blocks == free
    assert cache.block_table("b") == other
