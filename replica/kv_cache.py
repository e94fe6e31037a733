"""Paged KV cache bookkeeping: which blocks each request owns, in plain Python.

The tensors live in the model runner; this module only hands out block ids, so it is testable
without torch and the scheduler-side accounting can reuse the same arithmetic. A request's
cached tokens fill its blocks front to back: token j sits in block `table[j // block_size]`
at offset `j % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class CacheFullError(Exception):
    """The pool has too few free blocks; nothing was allocated."""


@dataclass
class _Allocation:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Block allocator with per-request block tables, append, truncate and free."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low block ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocs: dict[str, _Allocation] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

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
        if needed > len(self._free):
            raise CacheFullError(
                f"request {request_id!r} needs {needed} more blocks; {len(self._free)} are free"
            )
        alloc = self._allocs.setdefault(request_id, _Allocation())
        new_blocks = [self._free.pop() for _ in range(needed)]
        alloc.blocks.extend(new_blocks)
        alloc.num_tokens += num_new_tokens
        return new_blocks

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
        released = alloc.blocks[keep:]
        del alloc.blocks[keep:]
        self._free.extend(reversed(released))
        alloc.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort, preemption); unknown ids: no-op."""
        alloc = self._allocs.pop(request_id, None)
        if alloc is not None:
            self._free.extend(reversed(alloc.blocks))
