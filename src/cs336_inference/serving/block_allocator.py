"""Physical KV blocks: a free list and per-block reference counts (vLLM, Kwon et al. 2023).

The KV pool is cut into `num_blocks` blocks of `block_size` token slots. A block is either free
(on the free list, count 0) or used (count = how many block tables hold it: more than one when
sequences share a prefix or were forked). Every operation is O(1).

The free list is ordered: `allocate` takes the block freed longest ago and `free` puts a block at
the back. A freed block keeps its data until it is handed out again, so a prefix cache can still
`reuse` it in between (an LRU cache of freed blocks, for free).
"""

from __future__ import annotations

from collections import OrderedDict

from .. import _checks


class OutOfBlocksError(RuntimeError):
    """No free KV block: the caller should wait, preempt a sequence, or reserve fewer tokens."""


class BlockAllocator:
    """`num_blocks` physical blocks of `block_size` token slots; hands out block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = _checks.positive_int("num_blocks", num_blocks)
        self.block_size = _checks.positive_int("block_size", block_size)
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[self._check_block(block)]

    def is_free(self, block: int) -> bool:
        return self._check_block(block) in self._free

    def free_blocks(self) -> list[int]:
        """The free list, the next block `allocate` hands out first."""
        return list(self._free)

    # --- operations ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take the least recently freed block (count 1). Raises OutOfBlocksError, changing nothing."""
        if not self._free:
            raise OutOfBlocksError(f"out of KV blocks: all {self.num_blocks} blocks of {self.block_size} "
                                   f"tokens are in use; free or preempt a sequence first")
        block, _ = self._free.popitem(last=False)
        self._ref_counts[block] = 1
        return block

    def reuse(self, block: int) -> None:
        """Take a specific free block back (count 1): a prefix-cache hit on a block nobody holds."""
        if self._check_block(block) not in self._free:
            raise ValueError(f"block {block} is not free (count {self._ref_counts[block]}); "
                             f"use incref to share a block in use")
        del self._free[block]
        self._ref_counts[block] = 1

    def incref(self, block: int) -> None:
        """One more block table holds `block` (fork, or a prefix-cache hit on a block in use)."""
        if self._check_block(block) in self._free:
            raise ValueError(f"block {block} is free; allocate or reuse it before sharing it")
        self._ref_counts[block] += 1

    def free(self, block: int) -> bool:
        """One block table lets go of `block`; True if that was the last one (it is free again)."""
        if self._check_block(block) in self._free:
            raise ValueError(f"double free: block {block} is already free")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            return True
        return False

    def check_invariants(self) -> None:
        """Free blocks have count 0, used blocks a positive count, and free + used = total."""
        for block, count in enumerate(self._ref_counts):
            if (block in self._free) != (count == 0) or count < 0:
                raise AssertionError(f"block {block}: count {count}, on free list: {block in self._free}")
        assert self.num_free + self.num_used == self.num_blocks

    def _check_block(self, block) -> int:
        return _checks.integer("block", block, 0, self.num_blocks - 1)

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free})")


__all__ = ["BlockAllocator", "OutOfBlocksError"]
