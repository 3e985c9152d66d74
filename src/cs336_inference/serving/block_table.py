"""A sequence's block table: logical token positions -> physical KV slots.

Position p of a sequence lives in physical block `blocks[p // block_size]` at offset
`p % block_size`, i.e. in pool slot `blocks[p // block_size] * block_size + p % block_size`. The
blocks need not be adjacent or in order: that is what removes external fragmentation, and what
lets two tables point at the same block (sharing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .prefix_cache import CachedBlock


@dataclass
class BlockTable:
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


__all__ = ["BlockTable", "blocks_for"]
