"""The contiguous layout behind the engine's memory interface, to compare with paging on equal terms.

Same interface as `KVCacheManager` (what the schedulers and the model runner call), but every sequence
owns one run of token slots reserved at admission for its prompt plus max_new_tokens (first fit in a
`ContiguousAllocator`), n samples reserve n runs, nothing is shared (a fork copies the prompt's K/V),
and there is no prefix cache. Internally a "block" is one token slot (block_size = 1), so the same
pools and the same attention code serve both layouts: only where the K/V go differs.
"""

from __future__ import annotations

from typing import Hashable

from .block_pool import OutOfBlocksError
from .kv_cache_manager import BlockTable
from .contiguous_allocator import ContiguousAllocator
from .memory_stats import KVMemoryStats


class ContiguousManager:
    block_size = 1

    def __init__(self, num_slots: int):
        self.allocator = ContiguousAllocator(num_slots)
        self.tables: dict[Hashable, BlockTable] = {}
        self._spare: dict[Hashable, list] = {}  # reserved runs for a leader's siblings, claimed by fork

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_slots

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.memory_stats().free_tokens

    def table(self, seq_id: Hashable) -> BlockTable:
        if seq_id not in self.tables:
            raise ValueError(f"unknown sequence {seq_id!r}: it was never allocated or is already freed")
        return self.tables[seq_id]

    def num_cached_tokens(self, token_ids) -> int:
        return 0  # no prefix cache

    def can_allocate(self, token_ids, max_len: int, num_samples: int = 1, reserve: int = 0) -> bool:
        """True if num_samples runs of max_len slots can be placed (first fit) with `reserve` slots free."""
        runs = [length for _, length in self.allocator.free_runs()]  # address order, as first fit sees them
        for _ in range(num_samples):
            fit = next((i for i, length in enumerate(runs) if length >= max_len), None)
            if fit is None:
                return False
            runs[fit] -= max_len
        return sum(runs) >= reserve

    def growth(self, token_ids, max_len: int, num_samples: int = 1) -> int:
        return 0  # everything was reserved at admission

    def fits_empty(self, token_ids, max_len: int, num_samples: int = 1, reserve: int = 0,
                   together: bool = False) -> bool:
        """Every sample's run is reserved at admission, together or not."""
        return num_samples * max_len + reserve <= self.allocator.num_slots

    def append_needs_block(self, seq_id: Hashable) -> bool:
        return False  # the reservation already holds every token the sequence may produce

    def allocate(self, seq_id: Hashable, token_ids, max_len: int, num_samples: int = 1) -> int:
        """Reserve max_len slots for `seq_id` and max_len more for each of its num_samples - 1 siblings."""
        if not self.can_allocate(token_ids, max_len, num_samples):
            raise OutOfBlocksError(f"no room for {num_samples} runs of {max_len} slots for {seq_id!r}")
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a region; free it first")
        start = self.allocator.allocate(seq_id, max_len, num_used=len(token_ids))
        self._spare[seq_id] = []
        for k in range(num_samples - 1):
            key = ("spare", seq_id, k)
            self._spare[seq_id].append((key, self.allocator.allocate(key, max_len)))
        self.tables[seq_id] = BlockTable(1, list(range(start, start + len(token_ids))), len(token_ids))
        return 0

    def allocate_slots(self, seq_id: Hashable, num_new_tokens: int = 1, token_ids=None) -> list[tuple[int, int]]:
        """The next slots of the reservation (nothing to copy: nothing is shared; no prefix cache)."""
        table = self.table(seq_id)
        self.allocator.append(seq_id, num_new_tokens)  # refuses to pass the reservation
        start = table.blocks[0]
        table.blocks.extend(range(start + table.num_tokens, start + table.num_tokens + num_new_tokens))
        table.num_tokens += num_new_tokens
        return []

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """Give `child_id` one of the parent's spare runs and copy the parent's K/V into it."""
        parent = self.table(parent_id)
        if not self._spare.get(parent_id):
            raise OutOfBlocksError(f"sequence {parent_id!r} has no reserved run left for a sibling")
        key, start = self._spare[parent_id].pop()
        region = self.allocator.regions.pop(key)
        region.used = parent.num_tokens
        self.allocator.regions[child_id] = region
        self._spare[child_id] = []
        self.tables[child_id] = BlockTable(1, list(range(start, start + parent.num_tokens)), parent.num_tokens)
        return list(zip(parent.blocks, self.tables[child_id].blocks))

    def free(self, seq_id: Hashable) -> None:
        self.table(seq_id)
        for key, _ in self._spare.pop(seq_id, []):
            self.allocator.free(key)
        self.allocator.free(seq_id)
        del self.tables[seq_id]

    def cache_blocks(self, seq_id: Hashable, token_ids) -> None:
        """No prefix cache in this layout."""

    def memory_stats(self) -> KVMemoryStats:
        return self.allocator.memory_stats()


__all__ = ["ContiguousManager"]
