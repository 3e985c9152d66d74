"""`KVCacheManager` (vLLM v1's name): the block tables of many sequences over one `BlockPool`.

A sequence's `BlockTable` maps its logical positions to physical KV slots: position p lives in block
`blocks[p // block_size]` at offset `p % block_size`. The blocks need not be adjacent or in order:
that removes external fragmentation, and lets two tables point at the same block (sharing).

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
- `free(seq)`: let go of every block (freed ones keep their prefix-cache name until reused).
- `truncate(seq, n)`: speculative decoding's rollback: keep the first n slots, free the blocks the
  rejected drafts took (never a shared or named block).

This class is the edge of paging: it checks sequence ids, token ids and counts once, and every refused
call (out of blocks, unknown or duplicate sequence) raises before changing anything. Block ids come only
from its own tables, so the hot path (one decode slot per running sequence and step) reads the pool's
counts directly instead of validating block by block. The sequences own their token ids; a table only
counts its tokens. The K/V tensors live in `PagedKVCache`; this class only decides which slots they go to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

from .. import _checks
from .block_pool import BlockPool, CachedBlock, OutOfBlocksError, chained_block_hash
from .memory_stats import KVMemoryStats


@dataclass
class BlockTable:
    """One sequence's blocks, in position order."""

    block_size: int
    blocks: list[int] = field(default_factory=list)  # physical block of logical block i
    num_tokens: int = 0                               # token slots in use (the sequence owns the ids)
    # prefix-cache entries of the leading full blocks already named (for chaining the next one)
    cached: list[CachedBlock] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        """Token slots the table's blocks hold (num_tokens rounded up to whole blocks)."""
        return len(self.blocks) * self.block_size

    def slot(self, position: int) -> int:
        """Flat pool slot of logical `position`."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position must be in [0, {self.capacity}) for this table, got {position}")
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def copy(self) -> "BlockTable":
        return BlockTable(self.block_size, list(self.blocks), self.num_tokens, list(self.cached))


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


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
        return len(self.pool.free_queue)

    def table(self, seq_id: Hashable) -> BlockTable:
        table = self.tables.get(seq_id)
        if table is None:
            raise _unknown(seq_id)
        return table

    def blocks_needed(self, token_ids) -> int:
        """Free blocks `allocate(seq, token_ids)` would take (prefix hits on blocks in use are free)."""
        return self._plan(_check_tokens(token_ids))[1]

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
        table = self.tables.get(seq_id)
        if table is None:
            raise _unknown(seq_id)
        return table.num_tokens == len(table.blocks) * self.block_size or self.pool.ref_counts[table.blocks[-1]] > 1

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
        hits, needed = self._plan(token_ids)
        if needed > self.pool.num_free:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} free KV blocks "
                                   f"({len(token_ids)} tokens, {len(hits)} blocks cached), "
                                   f"{self.pool.num_free} are free")
        table = BlockTable(self.block_size, num_tokens=len(token_ids), cached=hits)
        for entry in hits:  # first, so `allocate` below cannot hand these out
            self.pool.take(entry.block)
            table.blocks.append(entry.block)
        for _ in range(blocks_for(len(token_ids), self.block_size) - len(hits)):
            table.blocks.append(self.pool.allocate())
        self.tables[seq_id] = table
        return len(hits) * self.block_size

    def allocate_slots(self, seq_id: Hashable, num_new_tokens: int = 1, token_ids=None) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens of `seq_id`; return the (src, dst) blocks whose
        data the cache must copy first (copy-on-write of a shared, partly filled last block).
        `token_ids` (the sequence's ids, new ones included): also `cache_blocks` them, in the same call."""
        table = self.tables.get(seq_id)
        if table is None:
            raise _unknown(seq_id)
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            num_new_tokens = _checks.positive_int("num_new_tokens", num_new_tokens)
        pool, blocks, bs = self.pool, table.blocks, self.block_size
        shared_last = table.num_tokens < len(blocks) * bs and pool.ref_counts[blocks[-1]] > 1
        new_blocks = -(-(table.num_tokens + num_new_tokens) // bs) - len(blocks)
        if shared_last + new_blocks > len(pool.free_queue):
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {shared_last + new_blocks} free KV blocks for "
                                   f"{num_new_tokens} more tokens, {pool.num_free} are free")
        copies = []
        if shared_last:
            shared, private = blocks[-1], pool.allocate()
            pool.free(shared)  # one holder fewer; the others keep it unchanged
            blocks[-1] = private
            copies.append((shared, private))
        for _ in range(new_blocks):
            blocks.append(pool.allocate())
        table.num_tokens += num_new_tokens
        if token_ids is not None and self.pool.prefix_caching and table.num_tokens >= (len(table.cached) + 1) * bs:
            self._name_full_blocks(table, token_ids)   # a block was filled (a decode fills one every bs steps)
        return copies

    def blocks_to_append(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots(seq_id, num_new_tokens)` would take (new blocks, plus a
        copy-on-write of a shared, partly filled last block)."""
        table = self.table(seq_id)
        blocks, bs = table.blocks, self.block_size
        shared_last = table.num_tokens < len(blocks) * bs and self.pool.ref_counts[blocks[-1]] > 1
        return shared_last + blocks_for(table.num_tokens + num_new_tokens, bs) - len(blocks)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> int:
        """Roll `seq_id` back to its first `num_tokens` slots (speculative decoding: the rejected drafts'
        slots go); blocks past them are freed, last first. Returns how many blocks were freed.

        Only blocks this sequence holds alone and that no prefix-cache name points at may go: the slots
        of a rollback were reserved this step by `allocate_slots` (fresh or copied-on-write blocks), so
        a shared or named block past `num_tokens` means the caller rolls back too far, and it raises
        ValueError before changing anything. Blocks kept are untouched (their stale slots past
        `num_tokens` are overwritten by the next tokens before anything reads them)."""
        table = self.table(seq_id)
        _checks.integer("num_tokens", num_tokens, len(table.cached) * self.block_size, table.num_tokens,
                        allowed=f"an int in [{len(table.cached) * self.block_size}, {table.num_tokens}] "
                                f"(the named prefix blocks stay; a table only shrinks)")
        keep = blocks_for(num_tokens, self.block_size)
        for block in table.blocks[keep:]:
            if self.pool.ref_counts[block] != 1 or self.pool.is_named(block):
                raise ValueError(f"sequence {seq_id!r}: block {block} past {num_tokens} tokens is shared or named "
                                 f"in the prefix cache; a rollback frees only the slots it reserved")
        freed = table.blocks[keep:]
        for block in reversed(freed):
            self.pool.free(block)
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        return len(freed)

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
        for block in reversed(self.table(seq_id).blocks):
            self.pool.free(block)
        del self.tables[seq_id]

    def cache_blocks(self, seq_id: Hashable, token_ids) -> None:
        """Name the full blocks among the sequence's first len(token_ids) tokens (`token_ids`: their
        ids; their K/V are written, or will be in this step's forward before anything reads them) so
        later sequences with the same prefix can share them."""
        table = self.tables.get(seq_id)
        if table is None:
            raise _unknown(seq_id)
        if self.pool.prefix_caching:
            self._name_full_blocks(table, token_ids)

    def _name_full_blocks(self, table: BlockTable, token_ids) -> None:
        bs, cached = self.block_size, table.cached
        for i in range(len(cached), min(len(token_ids), table.num_tokens) // bs):
            parent = cached[-1] if cached else None
            cached.append(self.pool.cache_block(table.blocks[i], parent, tuple(token_ids[i * bs:(i + 1) * bs])))

    def _plan(self, token_ids: list[int]) -> tuple[list[CachedBlock], int]:
        """The prefix hits of checked `token_ids` and the free blocks a table for them takes."""
        hits = self.pool.match_prefix(token_ids)
        live_hits = sum(self.pool.ref_counts[e.block] > 0 for e in hits)
        return hits, blocks_for(len(token_ids), self.block_size) - live_hits

    # --- statistics and checks ----------------------------------------------------------------
    def memory_stats(self) -> KVMemoryStats:
        """Reserved (blocks in use) vs used (slots holding a token) token slots, counted physically."""
        fill: dict[int, int] = {}
        bs, logical = self.block_size, 0
        for table in self.tables.values():
            logical += table.num_tokens
            for i, block in enumerate(table.blocks):
                fill[block] = max(fill.get(block, 0), min(bs, table.num_tokens - i * bs))
        num_free = len(self.pool.free_queue)
        return KVMemoryStats(capacity_tokens=self.pool.num_blocks * bs,
                             reserved_tokens=(self.pool.num_blocks - num_free) * bs,
                             used_tokens=sum(fill.values()), logical_tokens=logical, num_sequences=len(self.tables),
                             largest_free_tokens=num_free * bs)

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
            if self.pool.ref_counts[block] != count:
                raise AssertionError(f"block {block}: count {self.pool.ref_counts[block]}, held by {count} tables")


def _unknown(seq_id) -> ValueError:
    return ValueError(f"unknown sequence {seq_id!r}: it was never allocated or is already freed")


def _check_tokens(token_ids) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"token_ids must be a non-empty list of ints, got {token_ids!r:.80}")
    kinds = {type(t) for t in token_ids}   # one pass in C, then a check per kind (not per token)
    if any(not issubclass(k, int) or issubclass(k, bool) for k in kinds) or min(token_ids) < 0:
        raise ValueError(f"token_ids must hold non-negative ints, got {list(token_ids)!r:.80}")
    return list(token_ids)


__all__ = ["BlockTable", "KVCacheManager", "blocks_for"]
