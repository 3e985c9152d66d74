"""How well a KV memory is used: reserved vs used token slots, fragmentation, sharing.

Counted in token slots (multiply by `bytes_per_token` of the model's cache for bytes):
- reserved: slots set aside for live sequences (whole blocks when paged; prompt + max new tokens
  when reserving contiguously);
- used: slots that hold a token's K/V, each physical slot counted once (shared blocks count once);
- logical: the sum of the sequences' lengths, what separate per-sequence caches would hold.
Waste = (reserved - used) / reserved: the internal fragmentation (reserved, never written) as a share
of the reservation. External fragmentation = free slots that cannot serve a new request because no
free run is long enough (paging has none: any free block will do).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVMemoryStats:
    capacity_tokens: int       # slots in the whole pool
    reserved_tokens: int       # slots held by live sequences
    used_tokens: int           # slots holding K/V (physical, shared slots once)
    logical_tokens: int        # sum of sequence lengths (shared prefixes counted per sequence)
    num_sequences: int
    largest_free_tokens: int   # the longest request that could still be placed (contiguous run)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens

    @property
    def internal_fragmentation_tokens(self) -> int:
        """Reserved but unused slots (partly filled last blocks; unused max-length reservations)."""
        return self.reserved_tokens - self.used_tokens

    @property
    def external_fragmentation_tokens(self) -> int:
        """Free slots outside the largest free run: free, yet too scattered for one long request."""
        return self.free_tokens - self.largest_free_tokens

    @property
    def waste_fraction(self) -> float:
        """Share of the reserved slots that hold nothing (0 when nothing is reserved)."""
        return self.internal_fragmentation_tokens / self.reserved_tokens if self.reserved_tokens else 0.0

    @property
    def shared_tokens(self) -> int:
        """Slots saved by sharing (prefix caching, forks): logical minus physical tokens."""
        return self.logical_tokens - self.used_tokens

    def to_bytes(self, bytes_per_token: int) -> dict[str, int]:
        return {"capacity": self.capacity_tokens * bytes_per_token,
                "reserved": self.reserved_tokens * bytes_per_token,
                "used": self.used_tokens * bytes_per_token,
                "logical": self.logical_tokens * bytes_per_token}


__all__ = ["KVMemoryStats"]
