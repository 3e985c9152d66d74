"""`KVCacheManager` (vLLM v1's name): the block tables of many sequences over one `BlockPool`.

- `allocate(seq, token_ids)`: a table for a new sequence; full prompt blocks whose prefix is cached
  are shared, not recomputed (returns how many tokens the model can skip).
- `allocate_slots(seq, n)`: room for n more tokens: new blocks when the last one is full, and
  **copy-on-write** when the last block is shared (after `fork`): the writer gets a private copy, so
  writing never changes another sequence's data.
- `fork(parent, child)`: parallel sampling: the child shares every block. (vLLM v1 dropped fork: it
  shares only full blocks through the prefix cache. We keep fork and copy-on-write because they are
  the paper's mechanism and they also share the prompt's partly filled last block.)
- `cache_blocks(seq, token_ids)`: name the full blocks whose K/V this step computes, so later
  sequences, and those admitted later in the same step, with the same prefix share them.
- `free(seq)`: let go of every block (freed ones keep their prefix-cache entry until reused).

Every refused call (out of blocks, unknown or duplicate sequence) raises before changing anything.
The sequences own their token ids; a table only counts its tokens. The K/V tensors live in
`PagedKVCache`; this class only decides which slots they go to.
"""

from __future__ import annotations

from typing import Callable, Hashable

from .. import _checks
from .block_allocator import OutOfBlocksError
from .block_pool import BlockPool
from .block_table import BlockTable, blocks_for
from .memory_stats import KVMemoryStats
from .prefix_cache import chained_block_hash


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 hash_fn: Callable[[int, tuple[int, ...]], int] = chained_block_hash):
        self.pool = BlockPool(num_blocks, block_size, prefix_caching, hash_fn)
        self.block_size = block_size
        self.tables: dict[Hashable, BlockTable] = {}

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def table(self, seq_id: Hashable) -> BlockTable:
        if seq_id not in self.tables:
            raise ValueError(f"unknown sequence {seq_id!r}: it was never allocated or is already freed")
        return self.tables[seq_id]

    def blocks_needed(self, token_ids) -> int:
        """Free blocks `allocate(seq, token_ids)` would take (prefix hits on blocks in use are free)."""
        token_ids = _check_tokens(token_ids)
        live_hits = sum(not self.pool.is_free(e.block) for e in self.pool.match_prefix(token_ids))
        return blocks_for(len(token_ids), self.block_size) - live_hits

    def num_cached_tokens(self, token_ids) -> int:
        """Leading tokens of `token_ids` whose K/V a new sequence would take from the prefix cache."""
        return len(self.pool.match_prefix(_check_tokens(token_ids))) * self.block_size

    def can_allocate(self, token_ids, max_len: int | None = None, num_samples: int = 1, reserve: int = 0) -> bool:
        """True if the sequence fits now with `reserve` blocks left free. Its num_samples - 1 forked
        siblings share every block, but each will copy a partly filled last block on its first write."""
        copies = (num_samples - 1) if len(token_ids) % self.block_size else 0
        return self.blocks_needed(token_ids) + copies + reserve <= self.pool.num_free

    def growth(self, token_ids, max_len: int, num_samples: int = 1) -> int:
        """Blocks the sequence (and its siblings) may still take after `allocate`, at worst: paging
        allocates as tokens arrive, so everything up to max_len is still to come."""
        return num_samples * blocks_for(max_len, self.block_size) - self.blocks_needed(token_ids)

    def fits_empty(self, token_ids, max_len: int, num_samples: int = 1, reserve: int = 0,
                   together: bool = False) -> bool:
        """Could the request ever run, in an empty pool with `reserve` blocks kept free at admission?
        Its prompt (and one copy-on-write block per sibling) must fit, and one sample growing to
        max_len alone (siblings can be preempted and run later); `together`: all samples at their
        longest side by side, as a static batch reserves them."""
        copies = (num_samples - 1) if len(token_ids) % self.block_size else 0
        longest = blocks_for(max_len, self.block_size)
        if together:
            return num_samples * longest + copies + reserve <= self.pool.num_blocks
        return max(longest, blocks_for(len(token_ids), self.block_size) + copies) + reserve <= self.pool.num_blocks

    def append_needs_block(self, seq_id: Hashable) -> bool:
        """True if the next one-token `allocate_slots` takes a free block (new block, or a copy-on-write)."""
        table = self.table(seq_id)
        return table.num_tokens == table.capacity or self.pool.ref_count(table.blocks[-1]) > 1

    # --- operations ---------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids, max_len: int | None = None, num_samples: int = 1) -> int:
        """Give `seq_id` a table for `token_ids`; return the number of leading tokens already cached.

        The block holding the last token is never taken from the cache, so at least one token is
        left to run through the model. Blocks are taken as tokens arrive, so `max_len` (the most the
        sequence may grow to) and `num_samples` (siblings share these blocks) play no part.
        """
        token_ids = _check_tokens(token_ids)
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; free it first")
        hits = self.pool.match_prefix(token_ids)
        needed = blocks_for(len(token_ids), self.block_size) - sum(not self.pool.is_free(e.block) for e in hits)
        if needed > self.pool.num_free:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} free KV blocks "
                                   f"({len(token_ids)} tokens, {len(hits)} blocks cached), "
                                   f"{self.pool.num_free} are free")
        table = BlockTable(self.block_size, num_tokens=len(token_ids), cached=list(hits))
        for entry in hits:  # first, so `allocate` below cannot hand these out
            self.pool.touch(entry.block)
            table.blocks.append(entry.block)
        while len(table.blocks) < blocks_for(len(token_ids), self.block_size):
            table.blocks.append(self.pool.allocate())
        self.tables[seq_id] = table
        return len(hits) * self.block_size

    def allocate_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens of `seq_id`; return the (src, dst) blocks whose
        data the cache must copy first (copy-on-write of a shared, partly filled last block)."""
        table = self.table(seq_id)
        num_new_tokens = _checks.positive_int("num_new_tokens", num_new_tokens)
        shared_last = table.num_tokens < table.capacity and self.pool.ref_count(table.blocks[-1]) > 1
        new_blocks = blocks_for(table.num_tokens + num_new_tokens, self.block_size) - len(table.blocks)
        if shared_last + new_blocks > self.pool.num_free:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {shared_last + new_blocks} free KV blocks for "
                                   f"{num_new_tokens} more tokens, {self.pool.num_free} are free")
        copies = []
        if shared_last:
            shared, private = table.blocks[-1], self.pool.allocate()
            self.pool.free(shared)  # one holder fewer; the others keep it unchanged
            table.blocks[-1] = private
            copies.append((shared, private))
        table.blocks.extend(self.pool.allocate() for _ in range(new_blocks))
        table.num_tokens += num_new_tokens
        return copies

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """`child_id` starts as a copy of `parent_id`, sharing all of its blocks: no data is copied
        (the returned list of block copies is empty; copy-on-write comes later, in `allocate_slots`)."""
        parent = self.table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table; free it first")
        for block in parent.blocks:
            self.pool.incref(block)
        self.tables[child_id] = parent.copy()
        return []

    def free(self, seq_id: Hashable) -> None:
        """Let go of every block of `seq_id` (last block first, so shared prefixes are evicted last)."""
        table = self.table(seq_id)
        for block in reversed(table.blocks):
            self.pool.free(block)
        del self.tables[seq_id]

    def cache_blocks(self, seq_id: Hashable, token_ids) -> None:
        """Name the full blocks among the sequence's first len(token_ids) tokens (`token_ids`: their
        ids; their K/V are written, or will be in this step's forward before anything reads them) so
        later sequences with the same prefix can share them."""
        table = self.table(seq_id)
        if self.pool.prefix_cache is None:
            return
        num_full = min(len(token_ids), table.num_tokens) // self.block_size
        for i in range(len(table.cached), num_full):
            parent = table.cached[-1] if table.cached else None
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            table.cached.append(self.pool.cache_block(table.blocks[i], parent, tokens))

    # --- statistics and checks ----------------------------------------------------------------
    def memory_stats(self) -> KVMemoryStats:
        """Reserved (blocks in use) vs used (slots holding a token) token slots, counted physically."""
        fill: dict[int, int] = {}
        for table in self.tables.values():
            for i, block in enumerate(table.blocks):
                filled = min(self.block_size, table.num_tokens - i * self.block_size)
                fill[block] = max(fill.get(block, 0), filled)
        bs = self.block_size
        return KVMemoryStats(capacity_tokens=self.pool.num_blocks * bs,
                             reserved_tokens=self.pool.num_used * bs,
                             used_tokens=sum(fill.values()),
                             logical_tokens=sum(t.num_tokens for t in self.tables.values()),
                             num_sequences=len(self.tables),
                             largest_free_tokens=self.pool.num_free * bs)

    def check_invariants(self) -> None:
        """Counts equal the number of tables holding each block; used blocks are held, free ones not;
        every table has exactly the blocks its tokens need."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            if len(table.blocks) != blocks_for(table.num_tokens, self.block_size):
                raise AssertionError(f"sequence {seq_id!r}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            for block in table.blocks:
                holders[block] += 1
        for block, count in enumerate(holders):
            if self.pool.ref_count(block) != count:
                raise AssertionError(f"block {block}: count {self.pool.ref_count(block)}, held by {count} tables")


def _check_tokens(token_ids) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"token_ids must be a non-empty list of ints, got {token_ids!r:.80}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in token_ids):
        raise ValueError(f"token_ids must hold non-negative ints, got {list(token_ids)!r:.80}")
    return list(token_ids)


__all__ = ["KVCacheManager"]
