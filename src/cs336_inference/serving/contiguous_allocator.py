"""The baseline paging replaces: one contiguous KV region per request, reserved at admission for the
prompt plus `max_new_tokens` (the most the request may need), first fit in a pool of token slots.

Two kinds of waste follow (vLLM, Kwon et al. 2023, section 3): internal fragmentation, the
reserved tail a request never reaches (it stops early or is given a generous limit), and external
fragmentation, free slots split into runs too short for the next request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from .. import _checks
from .block_pool import OutOfBlocksError
from .memory_stats import KVMemoryStats


@dataclass
class Region:
    start: int
    reserved: int
    used: int


class ContiguousAllocator:
    """`num_slots` token slots; each sequence owns one run [start, start + reserved)."""

    def __init__(self, num_slots: int):
        self.num_slots = _checks.positive_int("num_slots", num_slots)
        self.regions: dict[Hashable, Region] = {}

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, in address order."""
        runs, cursor = [], 0
        for region in sorted(self.regions.values(), key=lambda r: r.start):
            if region.start > cursor:
                runs.append((cursor, region.start - cursor))
            cursor = region.start + region.reserved
        if cursor < self.num_slots:
            runs.append((cursor, self.num_slots - cursor))
        return runs

    def can_allocate(self, num_reserved: int) -> bool:
        return any(length >= num_reserved for _, length in self.free_runs())

    def allocate(self, seq_id: Hashable, num_reserved: int, num_used: int = 0) -> int:
        """Reserve `num_reserved` adjacent slots (first fit) for `seq_id`; return the start slot."""
        _checks.positive_int("num_reserved", num_reserved)
        if seq_id in self.regions:
            raise ValueError(f"sequence {seq_id!r} already has a region; free it first")
        if not 0 <= num_used <= num_reserved:
            raise ValueError(f"num_used must be in [0, num_reserved={num_reserved}], got {num_used}")
        for start, length in self.free_runs():
            if length >= num_reserved:
                self.regions[seq_id] = Region(start, num_reserved, num_used)
                return start
        runs = self.free_runs()
        raise OutOfBlocksError(f"no free run of {num_reserved} slots for {seq_id!r}: "
                               f"{sum(n for _, n in runs)} slots are free in {len(runs)} runs, "
                               f"the longest has {max((n for _, n in runs), default=0)}")

    def append(self, seq_id: Hashable, num_tokens: int = 1) -> None:
        """Record `num_tokens` more written tokens inside the reservation."""
        region = self._region(seq_id)
        if region.used + num_tokens > region.reserved:
            raise ValueError(f"sequence {seq_id!r} would hold {region.used + num_tokens} tokens, "
                             f"more than the {region.reserved} slots reserved for it")
        region.used += num_tokens

    def free(self, seq_id: Hashable) -> None:
        self._region(seq_id)  # a clear error for an unknown sequence
        del self.regions[seq_id]

    def memory_stats(self) -> KVMemoryStats:
        used = sum(r.used for r in self.regions.values())
        return KVMemoryStats(capacity_tokens=self.num_slots,
                             reserved_tokens=sum(r.reserved for r in self.regions.values()),
                             used_tokens=used, logical_tokens=used, num_sequences=len(self.regions),
                             largest_free_tokens=max((n for _, n in self.free_runs()), default=0))

    def _region(self, seq_id: Hashable) -> Region:
        if seq_id not in self.regions:
            raise ValueError(f"unknown sequence {seq_id!r}: it was never allocated or is already freed")
        return self.regions[seq_id]


__all__ = ["ContiguousAllocator", "Region"]
