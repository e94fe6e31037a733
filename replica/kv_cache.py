"""Paged KV cache bookkeeping: which blocks each request owns, in plain Python.

The tensors live in the model runner; this module only hands out block ids, so it is testable
without torch and the scheduler-side accounting can reuse the same arithmetic. A request's
cached tokens fill its blocks front to back: token j sits in block `table[j // block_size]`
at offset `j % block_size`.

With `prefix_caching` (vLLM's automatic prefix caching), a full block of committed tokens is
registered under its tokens and the blocks before it; a new request whose first tokens match
a registered chain shares those blocks instead of computing them again (system prompts, the
history a chat or an agent sends back every turn). Shared blocks are full, so nobody writes
to them again; a request writes only the blocks after its prefix. A registered block nobody
holds stays cached until the pool needs it (least recently released or touched first: a
request waiting to start from a cached prefix touches it, `touch`). Keys are the
tokens themselves, compared exactly: a hash collision can never hand out another prompt's KV.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


def prefix_limit(num_known: int, num_output: int) -> int:
    """The most of a request's known tokens a cached prefix may cover: its last token is left
    to feed, for its logits, and a preempted one's last two (left one short, it would be
    decoding, and the prefill its planner sends would no longer apply)."""
    return num_known - (2 if num_output else 1)


class CacheFullError(Exception):
    """The pool has too few free blocks; nothing was allocated."""


_Key = tuple[int, tuple[int, ...]]
"""A registered block's key: its parent's chain id (0: none) and its tokens."""


@dataclass
class _Allocation:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_registered: int = 0
    """Leading blocks registered (or shared) for prefix caching."""
    chain: int = 0
    """The chain id of the last of them (0: none)."""


class KVCacheManager:
    """Block allocator with per-request block tables, append, truncate and free; with
    `prefix_caching`, blocks shared by requests with the same leading tokens."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Popping from the end hands out low block ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocs: dict[str, _Allocation] = {}
        self._refs: dict[int, int] = {}
        """Holders of each block in use (more than one: a shared prefix block)."""
        self._block_of: dict[_Key, int] = {}
        self._key_of: dict[int, _Key] = {}
        self._chain_of: dict[int, int] = {}
        """Each registered block's chain id: unique, never reused, so the blocks registered
        after an evicted one can no longer be matched through it."""
        self._chains = 0
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Registered blocks nobody holds, least recently released first: free to take."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks an append may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks nobody holds (kept for a later request's prefix)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_tokens(self, request_id: str) -> int:
        """Tokens with reserved slots (0 for an unknown request)."""
        alloc = self._allocs.get(request_id)
        return alloc.num_tokens if alloc else 0

    def block_table(self, request_id: str) -> list[int]:
        alloc = self._allocs.get(request_id)
        return list(alloc.blocks) if alloc else []

    def extra_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Blocks an `append(request_id, num_new_tokens)` would take from the pool."""
        alloc = self._allocs.get(request_id)
        have_tokens = alloc.num_tokens if alloc else 0
        have_blocks = len(alloc.blocks) if alloc else 0
        return max(0, self.blocks_for(have_tokens + num_new_tokens) - have_blocks)

    def append(self, request_id: str, num_new_tokens: int) -> list[int]:
        """Reserve slots for `num_new_tokens` more tokens; returns the new block ids.

        Raises CacheFullError, allocating nothing, if the pool cannot hold them.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        needed = self.extra_blocks_needed(request_id, num_new_tokens)
        if needed > self.num_free_blocks:
            raise CacheFullError(
                f"request {request_id!r} needs {needed} more blocks; "
                f"{self.num_free_blocks} are free"
            )
        alloc = self._allocs.setdefault(request_id, _Allocation())
        new_blocks = [self._take() for _ in range(needed)]
        alloc.blocks.extend(new_blocks)
        alloc.num_tokens += num_new_tokens
        return new_blocks

    def _take(self) -> int:
        """A block to write: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            del self._chain_of[block]
        self._refs[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a registered block nobody holds stays cached."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            del self._refs[block]
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def blocks_released_by(self, request_ids: Iterable[str]) -> int:
        """Blocks freeing all of `request_ids` would make available: those no other request
        holds (a block they share among themselves only counts once)."""
        holders = Counter(b for rid in set(request_ids) for b in self.block_table(rid))
        return sum(1 for block, n in holders.items() if self._refs[block] == n)

    def attach_prefix(self, request_id: str, tokens: list[int], limit: int) -> int:
        """Share the registered blocks that hold the longest prefix of `tokens` (at most
        `limit` tokens, whole blocks) with a request holding no KV; returns the tokens they
        hold (0 without prefix caching, a match, or for a request that holds KV)."""
        if not self.prefix_caching or self.block_table(request_id):
            return 0
        blocks = self._match(tokens, limit)
        if not blocks:
            return 0
        for block in blocks:
            if block in self._cached:
                del self._cached[block]
            self._refs[block] = self._refs.get(block, 0) + 1
        n = len(blocks)
        self._allocs[request_id] = _Allocation(
            blocks, n * self.block_size, n, self._chain_of[blocks[-1]]
        )
        return n * self.block_size

    def touch(self, tokens: list[int], limit: int) -> None:
        """Mark the cached blocks holding `tokens`' longest prefix (at most `limit` tokens)
        as just released, so the pool takes them last: a request bound here to start from
        them, whose prefill has not begun, keeps them from being taken first. Its first
        block ends up the most recent, as when a request releases its blocks."""
        for block in reversed(self._match(tokens, limit) if self.prefix_caching else []):
            if block in self._cached:
                self._cached.move_to_end(block)

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """Tokens of `tokens`' longest prefix held by registered blocks (whole blocks), held
        or cached, without taking them."""
        return len(self._match(tokens, len(tokens))) * self.block_size

    def _match(self, tokens: list[int], limit: int) -> list[int]:
        """The registered blocks holding the longest prefix of `tokens[:limit]`, in order."""
        size = self.block_size
        chain = 0
        blocks: list[int] = []
        for start in range(0, min(limit, len(tokens)) - size + 1, size):
            block = self._block_of.get((chain, tuple(tokens[start : start + size])))
            if block is None:
                break
            blocks.append(block)
            chain = self._chain_of[block]
        return blocks

    def registrable(self, request_id: str, num_committed: int) -> bool:
        """Whether `register` with `num_committed` tokens would register a block: a caller
        asks first, so it builds the request's tokens only when a block has filled."""
        alloc = self._allocs.get(request_id)
        return (
            self.prefix_caching
            and alloc is not None
            and min(num_committed, alloc.num_tokens) // self.block_size > alloc.num_registered
        )

    def register(self, request_id: str, tokens: list[int], num_committed: int) -> None:
        """Offer the request's full blocks among its first `num_committed` tokens (computed
        and final: no speculative token a verification may still reject) to later requests
        with the same leading tokens. A block whose tokens another block already holds under
        the same prefix is left unregistered (the request keeps its copy)."""
        if not self.registrable(request_id, num_committed):
            return
        alloc = self._allocs[request_id]
        size = self.block_size
        full = min(num_committed, alloc.num_tokens, len(tokens)) // size
        while alloc.num_registered < full:
            i = alloc.num_registered
            block = alloc.blocks[i]
            key = (alloc.chain, tuple(tokens[i * size : (i + 1) * size]))
            known = self._block_of.get(key)
            if known is None:
                self._chains += 1
                self._block_of[key] = block
                self._key_of[block] = key
                self._chain_of[block] = self._chains
                known = block
            alloc.chain = self._chain_of[known]
            alloc.num_registered += 1

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (rollback of rejected speculation)."""
        alloc = self._allocs.get(request_id)
        have = alloc.num_tokens if alloc else 0
        if not 0 <= num_tokens <= have:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {num_tokens} tokens; it holds {have}"
            )
        if alloc is None:
            return
        keep = self.blocks_for(num_tokens)
        if num_tokens < alloc.num_registered * self.block_size:
            raise ValueError(
                f"cannot truncate request {request_id!r} into its {alloc.num_registered} "
                "shared or registered blocks"
            )
        self._release(alloc.blocks[keep:])
        del alloc.blocks[keep:]
        alloc.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort, preemption); unknown ids: no-op."""
        alloc = self._allocs.pop(request_id, None)
        if alloc is not None:
            self._release(alloc.blocks)


_PICTURE_SLOT = ""
"""The one request id a `PrefixPicture` uses (each sequence is released at once)."""


class PrefixPicture:
    """A picture of a replica's prefix cache: the prompts it likely holds, not its blocks.

    The controller's mirrors keep one per replica for the prefix first hop (cluster.routing),
    and the simulated engine (replica.planner.executor) one as its replica's cache. It is the
    replica's block cache fed whole token sequences, each released at once: least recently
    used blocks are evicted first, and nothing is held, so it evicts later than a real cache,
    whose running requests hold blocks too. A picture, not a copy."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self._cache = KVCacheManager(num_blocks, block_size, prefix_caching=True)

    def cached(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` pictured cached (whole blocks)."""
        return self._cache.cached_prefix_len(tokens)

    def cached_prompt(self, prompt: list[int]) -> int:
        """Leading tokens of a new request's prompt the replica would start it from: those
        pictured cached, at most `prefix_limit`."""
        return self.cached(prompt[: prefix_limit(len(prompt), 0)])

    def touch(self, tokens: list[int]) -> None:
        """A request bound to start from `tokens`' cached prefix: taken last, as on the
        replica (KVCacheManager.touch)."""
        self._cache.touch(tokens, prefix_limit(len(tokens), 0))

    def remember(self, tokens: list[int]) -> None:
        """Cache `tokens` as the replica does: shared where they match, the rest registered,
        all of it then released (a prefix's first block released last, so it outlives the
        blocks after it)."""
        cache = self._cache
        tokens = tokens[: cache.num_blocks * cache.block_size]
        try:
            cache.attach_prefix(_PICTURE_SLOT, tokens, len(tokens))
            cache.append(_PICTURE_SLOT, len(tokens) - cache.num_tokens(_PICTURE_SLOT))
            cache.register(_PICTURE_SLOT, tokens, len(tokens))
        finally:
            cache.free(_PICTURE_SLOT)
