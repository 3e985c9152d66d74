"""The paged KV memory of many sequences: block tables over one `BlockAllocator`.

- `allocate(seq, tokens)`: a table for a new sequence; full prompt blocks whose prefix is cached are
  shared, not recomputed (returns how many tokens the model can skip).
- `append_slot(seq, token)`: room for one more token: a new block when the last one is full, and
  **copy-on-write** when the last block is shared (after `fork`): the writer gets a private copy, so
  writing never changes another sequence's data.
- `fork(parent, child)`: parallel sampling / beam search: the child shares every block.
- `free(seq)`: let go of every block (freed ones keep their prefix-cache entry until reused).

Every refused call (out of blocks, unknown or duplicate sequence) raises before changing anything.
The K/V tensors live in `PagedKVCache`; this class only decides which slots they go to.
"""

from __future__ import annotations

from typing import Callable, Hashable

from .block_allocator import BlockAllocator, OutOfBlocksError
from .block_table import BlockTable, blocks_for
from .memory_stats import KVMemoryStats
from .prefix_cache import CachedBlock, PrefixCache, chained_block_hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 hash_fn: Callable[[int, tuple[int, ...]], int] = chained_block_hash):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_cache = PrefixCache(hash_fn) if prefix_caching else None
        self.tables: dict[Hashable, BlockTable] = {}

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def table(self, seq_id: Hashable) -> BlockTable:
        if seq_id not in self.tables:
            raise ValueError(f"unknown sequence {seq_id!r}: it was never allocated or is already freed")
        return self.tables[seq_id]

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_needed(self, token_ids) -> int:
        """Free blocks `allocate(seq, token_ids)` would take (prefix hits on blocks in use are free)."""
        token_ids = _check_tokens(token_ids)
        live_hits = sum(not self.allocator.is_free(e.block) for e in self._match_prefix(token_ids))
        return blocks_for(len(token_ids), self.block_size) - live_hits

    def num_cached_tokens(self, token_ids) -> int:
        """Leading tokens of `token_ids` whose K/V a new sequence would take from the prefix cache."""
        return len(self._match_prefix(_check_tokens(token_ids))) * self.block_size

    def can_allocate(self, token_ids, max_len: int | None = None, num_samples: int = 1, reserve: int = 0) -> bool:
        """True if the sequence fits now with `reserve` blocks left free. Its num_samples - 1 forked
        siblings share every block, but each will copy a partly filled last block on its first write."""
        copies = (num_samples - 1) if len(token_ids) % self.block_size else 0
        return self.blocks_needed(token_ids) + copies + reserve <= self.allocator.num_free

    def growth(self, token_ids, max_len: int, num_samples: int = 1) -> int:
        """Blocks the sequence (and its siblings) may still take after `allocate`, at worst: paging
        allocates as tokens arrive, so everything up to max_len is still to come."""
        return num_samples * blocks_for(max_len, self.block_size) - self.blocks_needed(token_ids)

    def fits_empty(self, max_len: int, num_samples: int = 1, reserve: int = 0) -> bool:
        """Could one sequence of max_len tokens run at all (alone, `reserve` blocks kept free)? Siblings
        need not fit together: a sibling can be preempted and run later."""
        return blocks_for(max_len, self.block_size) + reserve <= self.allocator.num_blocks

    def append_needs_block(self, seq_id: Hashable) -> bool:
        """True if the next `append_slot` takes a free block (new block, or a copy-on-write)."""
        table = self.table(seq_id)
        return table.num_tokens == table.capacity or self.allocator.ref_count(table.blocks[-1]) > 1

    # --- operations ---------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids, max_len: int | None = None, num_samples: int = 1) -> int:
        """Give `seq_id` a table for `token_ids`; return the number of leading tokens already cached.

        The block holding the last token is never taken from the cache, so at least one token is
        left to run through the model (its logits predict the next token). Blocks are taken as
        tokens arrive, so `max_len` (the most the sequence may grow to) and `num_samples` (siblings
        share these blocks) play no part.
        """
        token_ids = _check_tokens(token_ids)
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; free it first")
        hits = self._match_prefix(token_ids)
        needed = blocks_for(len(token_ids), self.block_size) - sum(
            not self.allocator.is_free(e.block) for e in hits)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} free KV blocks "
                                   f"({len(token_ids)} tokens, {len(hits)} blocks cached), "
                                   f"{self.allocator.num_free} are free")
        table = BlockTable(self.block_size, token_ids=list(token_ids), cached=list(hits))
        for entry in hits:  # first, so `allocate` below cannot hand these out
            if self.allocator.is_free(entry.block):
                self.allocator.reuse(entry.block)
            else:
                self.allocator.incref(entry.block)
            table.blocks.append(entry.block)
        while len(table.blocks) < blocks_for(len(token_ids), self.block_size):
            table.blocks.append(self._new_block())
        self.tables[seq_id] = table
        return len(hits) * self.block_size

    def append_slot(self, seq_id: Hashable, token_id: int) -> tuple[int, int] | None:
        """Make room for one more token of `seq_id` and record it; return (src, dst) blocks whose
        data the cache must copy (copy-on-write of a shared last block), else None."""
        table = self.table(seq_id)
        token_id = _check_tokens([token_id])[0]
        copy = None
        if table.num_tokens == table.capacity:
            table.blocks.append(self._new_block())  # raises before any change if none is free
        elif self.allocator.ref_count(table.blocks[-1]) > 1:
            shared = table.blocks[-1]
            private = self._new_block()
            self.allocator.free(shared)  # one holder fewer; the others keep it unchanged
            table.blocks[-1] = private
            copy = (shared, private)
        table.token_ids.append(token_id)
        return copy

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """`child_id` starts as a copy of `parent_id`, sharing all of its blocks: no data is copied
        (the returned list of block copies is empty; copy-on-write comes later, in `append_slot`)."""
        parent = self.table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table; free it first")
        for block in parent.blocks:
            self.allocator.incref(block)
        self.tables[child_id] = parent.copy()
        return []

    def free(self, seq_id: Hashable) -> None:
        """Let go of every block of `seq_id` (last block first, so shared prefixes are evicted last)."""
        table = self.table(seq_id)
        for block in reversed(table.blocks):
            self.allocator.free(block)
        del self.tables[seq_id]

    def cache_full_blocks(self, seq_id: Hashable, num_computed: int) -> None:
        """Name the full blocks among the first `num_computed` tokens (their K/V are written now) so
        later sequences with the same prefix can share them."""
        if self.prefix_cache is None:
            return
        table = self.table(seq_id)
        num_full = min(num_computed, table.num_tokens) // self.block_size
        for i in range(len(table.cached), num_full):
            parent = table.cached[-1] if table.cached else None
            tokens = tuple(table.token_ids[i * self.block_size:(i + 1) * self.block_size])
            table.cached.append(self.prefix_cache.insert(table.blocks[i], parent, tokens))

    # --- statistics and checks ----------------------------------------------------------------
    def memory_stats(self) -> KVMemoryStats:
        """Reserved (blocks in use) vs used (slots holding a token) token slots, counted physically."""
        fill: dict[int, int] = {}
        for table in self.tables.values():
            for i, block in enumerate(table.blocks):
                filled = min(self.block_size, table.num_tokens - i * self.block_size)
                fill[block] = max(fill.get(block, 0), filled)
        bs = self.block_size
        return KVMemoryStats(capacity_tokens=self.allocator.num_blocks * bs,
                             reserved_tokens=self.allocator.num_used * bs,
                             used_tokens=sum(fill.values()),
                             logical_tokens=sum(t.num_tokens for t in self.tables.values()),
                             num_sequences=len(self.tables),
                             largest_free_tokens=self.allocator.num_free * bs)

    def check_invariants(self) -> None:
        """Counts equal the number of tables holding each block; used blocks are held, free ones not;
        every table has exactly the blocks its tokens need."""
        self.allocator.check_invariants()
        holders = [0] * self.allocator.num_blocks
        for seq_id, table in self.tables.items():
            if len(table.blocks) != blocks_for(table.num_tokens, self.block_size):
                raise AssertionError(f"sequence {seq_id!r}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            for block in table.blocks:
                holders[block] += 1
        for block, count in enumerate(holders):
            if self.allocator.ref_count(block) != count:
                raise AssertionError(f"block {block}: count {self.allocator.ref_count(block)}, "
                                     f"held by {count} tables")

    def _match_prefix(self, token_ids: list[int]) -> list[CachedBlock]:
        """Cached entries of the leading full blocks, excluding the block of the last token."""
        if self.prefix_cache is None:
            return []
        hits, parent, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = self.prefix_cache.lookup(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            if parent is None:
                break
            hits.append(parent)
        return hits

    def _new_block(self) -> int:
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)  # its old contents are about to be overwritten
        return block


def _check_tokens(token_ids) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"token_ids must be a non-empty list of ints, got {token_ids!r:.80}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in token_ids):
        raise ValueError(f"token_ids must hold non-negative ints, got {list(token_ids)!r:.80}")
    return list(token_ids)


__all__ = ["BlockManager"]
