"""A picture of a replica's prefix cache: the prompts it likely holds, not its blocks.

The controller's mirrors keep one per replica for the prefix first hop (cluster.routing), and
the simulator one per simulated replica as that replica's cache. It is the replica's block
cache (replica.kv_cache) fed whole token sequences, each released at once: least recently
used blocks are evicted first, and nothing is held, so it evicts later than a real cache,
whose running requests hold blocks too. A picture, not a copy.
"""

from __future__ import annotations

from replica.kv_cache import KVCacheManager

_SLOT = ""
"""The one request id the picture uses (each sequence is released at once)."""


class PrefixPicture:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self._cache = KVCacheManager(num_blocks, block_size, prefix_caching=True)

    def cached(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` pictured cached (whole blocks)."""
        return self._cache.cached_prefix_len(tokens)

    def remember(self, tokens: list[int]) -> None:
        """Cache `tokens` as the replica does: shared where they match, the rest registered,
        all of it then released (a prefix's first block released last, so it outlives the
        blocks after it)."""
        cache = self._cache
        tokens = tokens[: cache.num_blocks * cache.block_size]
        try:
            cache.attach_prefix(_SLOT, tokens, len(tokens))
            cache.append(_SLOT, len(tokens) - cache.num_tokens(_SLOT))
            cache.register(_SLOT, tokens, len(tokens))
        finally:
            cache.free(_SLOT)
