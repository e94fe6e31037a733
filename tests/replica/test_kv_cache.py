"""KV block allocator: invariants under random operation sequences, and clean refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.kv_cache import CacheFullError, KVCacheManager, PrefixPicture


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


def prefix_cache(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=4, prefix_caching=True)


def written(cache: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """A request that computed `tokens` and committed them all."""
    cache.append(rid, len(tokens))
    cache.register(rid, tokens, len(tokens))


def test_a_request_shares_the_registered_blocks_of_its_leading_tokens() -> None:
    cache = prefix_cache()
    a = list(range(10))
    written(cache, "a", a)
    b = [*a[:8], 99, 98]
    assert cache.attach_prefix("b", b, limit=len(b) - 1) == 8
    assert cache.block_table("b") == cache.block_table("a")[:2]
    assert cache.num_tokens("b") == 8
    assert cache.append("b", 2) == [3]
    assert cache.num_used_blocks == 4  # a's three, b's own third
    assert cache.attach_prefix("c", [0, 1, 2, 3, 4, 5, 6, 0], limit=7) == 4
    assert cache.attach_prefix("d", [9, 1, 2, 3, 4], limit=4) == 0
    assert cache.block_table("d") == []


def test_the_limit_leaves_a_token_to_compute_and_matches_whole_blocks() -> None:
    cache = prefix_cache()
    written(cache, "a", list(range(8)))
    assert cache.attach_prefix("b", list(range(8)), limit=7) == 4
    assert cache.attach_prefix("c", list(range(8)), limit=3) == 0
    assert cache.attach_prefix("b", list(range(8)), limit=7) == 0  # b holds KV already


def test_only_committed_full_blocks_are_registered() -> None:
    cache = prefix_cache()
    cache.append("a", 12)
    cache.register("a", list(range(12)), num_committed=7)
    assert cache.attach_prefix("b", list(range(12)), limit=11) == 4
    with pytest.raises(ValueError, match="shared or registered"):
        cache.truncate("a", 3)  # b reads all four of the first block's tokens
    cache.truncate("a", 4)
    cache.append("a", 8)
    cache.register("a", list(range(12)), num_committed=12)
    assert cache.attach_prefix("c", list(range(12)), limit=11) == 8


def test_released_blocks_stay_cached_until_the_pool_needs_them() -> None:
    cache = prefix_cache(num_blocks=4)
    written(cache, "a", list(range(8)))
    written(cache, "b", [7] * 4)
    assert cache.blocks_released_by(["a"]) == 2
    cache.free("a")
    cache.free("b")
    assert (cache.num_free_blocks, cache.num_cached_blocks) == (4, 3)
    assert cache.attach_prefix("c", list(range(9)), limit=8) == 8
    assert cache.num_cached_blocks == 1 and cache.blocks_released_by(["c"]) == 2
    assert cache.attach_prefix("d", list(range(9)), limit=8) == 8
    assert cache.blocks_released_by(["c"]) == 0  # shared with d: freeing c frees nothing
    assert cache.blocks_released_by(["c", "d", "c"]) == 2  # freeing both frees them
    cache.free("c")
    cache.free("d")
    # A request's blocks are released last first, so its tail is taken before its head: b's
    # block goes first (released earliest), then a's second block.
    cache.append("e", 5)  # the free block and b's
    assert cache.attach_prefix("f", [7] * 5, limit=4) == 0
    assert cache.attach_prefix("g", list(range(9)), limit=8) == 8
    cache.free("g")
    cache.append("h", 1)  # a's second block
    assert cache.attach_prefix("i", list(range(9)), limit=8) == 4
    assert cache.num_free_blocks == 0


def test_a_touched_prefix_is_taken_last() -> None:
    """a released before b: its blocks would be taken first, but a request bound to start
    from a's prefix touched it, so b's go first, tail before head."""
    cache = prefix_cache(num_blocks=4)
    written(cache, "a", list(range(8)))
    written(cache, "b", list(range(50, 58)))
    cache.free("a")
    cache.free("b")
    cache.touch(list(range(9)), limit=8)
    cache.touch([99] * 8, limit=8)  # nothing cached: nothing to touch
    cache.append("c", 1)  # b's second block
    assert cache.cached_prefix_len(list(range(50, 58))) == 4
    cache.append("c", 4)  # b's first block
    assert cache.cached_prefix_len(list(range(50, 58))) == 0
    assert cache.attach_prefix("d", list(range(9)), limit=8) == 8
    off = KVCacheManager(num_blocks=4, block_size=4)
    written(off, "a", list(range(8)))
    off.free("a")
    off.touch(list(range(8)), limit=8)
    assert off.num_free_blocks == 4


def test_a_picture_takes_a_touched_prompt_s_prefix_last_as_its_replica_does() -> None:
    picture = PrefixPicture(num_blocks=4, block_size=4)
    first, second = list(range(8)), list(range(50, 58))
    picture.remember(first)
    picture.remember(second)
    picture.touch([*first, 1])
    picture.remember(list(range(100, 108)))  # two blocks: second's, not first's
    assert picture.cached(first) == 8 and picture.cached(second) == 0


def test_a_block_computed_twice_continues_the_first_copy_s_chain() -> None:
    cache = prefix_cache()
    written(cache, "a", list(range(4)))
    written(cache, "b", list(range(8)))  # computed its own copy of a's block
    assert cache.attach_prefix("c", list(range(9)), limit=8) == 8
    assert cache.block_table("c") == [cache.block_table("a")[0], cache.block_table("b")[1]]


def test_without_prefix_caching_nothing_is_shared() -> None:
    cache = KVCacheManager(num_blocks=4, block_size=4)
    written(cache, "a", list(range(8)))
    assert cache.attach_prefix("b", list(range(8)), limit=7) == 0
    cache.free("a")
    assert (cache.num_free_blocks, cache.num_cached_blocks) == (4, 0)


prefix_operations = st.lists(
    st.tuples(
        st.sampled_from(["append", "truncate", "free", "attach", "register"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=10),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=1000, deadline=None)
@given(prefix_operations)
def test_shared_blocks_hold_the_tokens_of_everyone_who_reads_them(
    ops: list[tuple[str, str, list[int]]],
) -> None:
    """Blocks' contents are modelled slot by slot: an attach must hand out blocks holding
    exactly the request's tokens, nobody writes a block another request holds, and every
    block is free, cached or held, never two of these."""
    cache = KVCacheManager(num_blocks=6, block_size=2, prefix_caching=True)
    slots: dict[int, list[int | None]] = {}
    tokens: dict[str, list[int]] = {}
    for op, rid, new in ops:
        mine = tokens.get(rid, [])
        if op == "append" and cache.extra_blocks_needed(rid, len(new)) <= cache.num_free_blocks:
            start = len(mine)
            cache.append(rid, len(new))
            table = cache.block_table(rid)
            for i, token in enumerate(new, start):
                block = table[i // 2]
                holders = sum(block in cache.block_table(r) for r in tokens | {rid: []})
                assert holders == 1, "wrote a block another request reads"
                slots.setdefault(block, [None, None])[i % 2] = token
            tokens[rid] = mine + new
        elif op == "truncate" and mine:
            keep = min(len(new), len(mine))
            try:
                cache.truncate(rid, keep)
            except ValueError:
                continue
            tokens[rid] = mine[:keep]
        elif op == "free":
            cache.free(rid)
            tokens.pop(rid, None)
        elif op == "attach" and not cache.block_table(rid):
            # Mostly another request's tokens (or what it dropped) and then some: hits.
            lead = next((t for r, t in tokens.items() if r != rid), []) if new[:1] != [2] else []
            want = lead + new
            got = cache.attach_prefix(rid, want, limit=len(want))
            table = cache.block_table(rid)
            assert [slots[b] for b in table] == [want[i : i + 2] for i in range(0, got, 2)]
            tokens[rid] = want[:got]
        elif op == "register":
            cache.register(rid, mine, len(mine))
        held = {b for r in tokens for b in cache.block_table(r)}
        assert len(held) + cache.num_free_blocks == cache.num_blocks, "a block leaked"
        for r, mine in tokens.items():
            assert cache.num_tokens(r) == len(mine)


def test_the_cached_prefix_of_tokens_is_measured_without_taking_its_blocks() -> None:
    cache = KVCacheManager(num_blocks=3, block_size=4, prefix_caching=True)
    cache.append("a", 10)
    cache.register("a", list(range(10)), 10)
    assert cache.cached_prefix_len(list(range(12))) == 8
    assert cache.cached_prefix_len([*range(4), 9, 9, 9, 9]) == 4
    assert cache.cached_prefix_len(list(range(7))) == 4
    assert cache.cached_prefix_len([9, *range(11)]) == 0
    cache.free("a")
    assert cache.num_free_blocks == 3 and cache.cached_prefix_len(list(range(12))) == 8
    cache.append("b", 12)
    assert cache.cached_prefix_len(list(range(12))) == 0
