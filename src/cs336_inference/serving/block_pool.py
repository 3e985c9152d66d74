"""`BlockPool` (vLLM v1's name): the physical KV blocks and what they hold.

A `BlockAllocator` (free list, reference counts) plus the `PrefixCache` that names full blocks by
their prefix. The two live together because a block's name must go the moment the allocator hands
it out for new data, and a prefix hit must take a block back whether someone holds it (share it) or
it sits on the free list with its old contents intact (take it back from the free list).
"""

from __future__ import annotations

from typing import Callable

from .block_allocator import BlockAllocator
from .prefix_cache import CachedBlock, PrefixCache, chained_block_hash


class BlockPool(BlockAllocator):
    """`num_blocks` blocks of `block_size` token slots, with an optional prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 hash_fn: Callable[[int, tuple[int, ...]], int] = chained_block_hash):
        super().__init__(num_blocks, block_size)
        self.prefix_cache = PrefixCache(hash_fn) if prefix_caching else None

    def allocate(self) -> int:
        """A block for new data (least recently freed first); its old prefix-cache name is dropped."""
        block = super().allocate()
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)  # its contents are about to be overwritten
        return block

    def touch(self, block: int) -> None:
        """Take a cached block for one more table: share it if held, else take it off the free list."""
        if self.is_free(block):
            self.reuse(block)
        else:
            self.incref(block)

    def match_prefix(self, token_ids: list[int]) -> list[CachedBlock]:
        """Cached entries of the leading full blocks of `token_ids`, excluding the block of the last
        token (at least one token must run through the model: its logits predict the next one)."""
        if self.prefix_cache is None:
            return []
        hits, parent, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = self.prefix_cache.lookup(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            if parent is None:
                break
            hits.append(parent)
        return hits

    def cache_block(self, block: int, parent: CachedBlock | None, token_ids: tuple[int, ...]) -> CachedBlock | None:
        """Name the full `block` holding `token_ids` after `parent`'s prefix (None without a cache)."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.insert(block, parent, token_ids)


__all__ = ["BlockPool"]
