"""Prefix caching: find full KV blocks another sequence already computed for the same prefix.

A full block's keys/values depend on its own token ids *and on every token before it*, so a block is
named by a hash chained over the previous block's hash and its token ids (vLLM's automatic prefix
caching; SGLang's RadixAttention keeps the same information in a radix tree). The hash is only an
index: a hit must also have the same token ids and the very same parent entry (the one matched for
the previous block), so even a colliding hash can never share wrong data (a test uses a hash that
collides on purpose).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

ROOT_HASH = 0  # the "previous block" of a sequence's first block


def chained_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """64-bit hash of (parent hash, token ids): stable across processes (unlike Python's `hash`)."""
    data = parent_hash.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(eq=False)  # identity matters: a parent is *this* entry, not an equal-looking one
class CachedBlock:
    block: int
    hash: int
    token_ids: tuple[int, ...]
    parent: Optional["CachedBlock"]


class PrefixCache:
    """hash -> full physical block whose K/V hold `token_ids` after the prefix its parent chain spells.

    The cache holds no references: a block's entry stays while the block is used or sits on the free
    list, and the block manager calls `evict` when the allocator hands the block out for new data.
    """

    def __init__(self, hash_fn: Callable[[int, tuple[int, ...]], int] = chained_block_hash):
        self.hash_fn = hash_fn
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def lookup(self, parent: CachedBlock | None, token_ids: tuple[int, ...]) -> CachedBlock | None:
        """The entry for `token_ids` right after `parent` (None = start of the sequence), if cached."""
        entry = self._by_hash.get(self.hash_fn(parent.hash if parent else ROOT_HASH, token_ids))
        if entry is not None and entry.parent is parent and entry.token_ids == token_ids:
            return entry
        return None  # a miss, or a hash collision with a different prefix

    def entry(self, block: int) -> CachedBlock | None:
        return self._by_block.get(block)

    def insert(self, block: int, parent: CachedBlock | None, token_ids: tuple[int, ...]) -> CachedBlock:
        """Name the full block `block` (its K/V are computed). Returns the entry, the existing one if
        the same prefix is already cached under another block (then `block` stays anonymous)."""
        existing = self.lookup(parent, token_ids)
        if existing is not None:
            return existing
        if block in self._by_block:
            raise ValueError(f"block {block} already caches another prefix; evict it first")
        entry = CachedBlock(block, self.hash_fn(parent.hash if parent else ROOT_HASH, token_ids),
                            tuple(token_ids), parent)
        old = self._by_hash.get(entry.hash)
        if old is not None:  # collision with a different prefix: the newer entry takes the slot
            del self._by_block[old.block]
        self._by_hash[entry.hash] = entry
        self._by_block[block] = entry
        return entry

    def clear(self) -> None:
        """Forget every name (entries already held by block tables stay valid parents)."""
        self._by_hash.clear()
        self._by_block.clear()

    def evict(self, block: int) -> None:
        """Forget what `block` holds (it is about to be overwritten). No-op for an anonymous block."""
        entry = self._by_block.pop(block, None)
        if entry is not None and self._by_hash.get(entry.hash) is entry:
            del self._by_hash[entry.hash]


__all__ = ["CachedBlock", "PrefixCache", "ROOT_HASH", "chained_block_hash"]
