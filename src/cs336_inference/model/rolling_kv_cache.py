"""The sliding-window layer's cache: a ring buffer that holds the last window (+ spare) positions.

Mistral 7B (Jiang et al. 2023). It alone knows the window's geometry: which positions `update` returns
and the band mask over them. Implements the `kv_cache.LayerCache` interface.
"""

from __future__ import annotations

import torch

from .. import _checks
from .attention import attention_mask
from .kv_cache import CacheStep, _check_kv, _KVBuffers


class RollingKVCache(_KVBuffers):
    """Sliding-window attention's cache: a ring buffer of min(window + spare, max_seq_len) positions.

    Position p lives in slot p % capacity (Mistral 7B, Jiang et al. 2023), so memory stays flat however
    long the sequence grows. A query at position i sees keys i - window + 1 .. i, so `update` returns
    the keys of positions first_key(start) .. start + T - 1 in order: the older ones gathered from the
    ring, the T new ones as given (a long prefill needs new keys that the ring cannot hold at once),
    and `mask` is the band over exactly those positions. The ring is written at `commit`, so a forward
    that fails midway overwrites nothing. `spare` extra slots let `truncate` remove up to spare + 1
    positions after any forward (speculative decoding verifies gamma + 1 tokens, then rolls back).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32, spare: int = 0):
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        window=window, max_seq_len=max_seq_len)
        _checks.non_negative_int("spare", spare)
        self.window, self.max_seq_len = window, max_seq_len
        self.capacity = min(window + spare, max_seq_len)
        shape = (batch_size, num_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.oldest = 0       # oldest position whose slot still holds it (older ones were overwritten)
        self._staged = None   # (step, k, v) written to the ring at commit

    def first_key(self, start: int) -> int:
        """Oldest position a query at `start` may attend to (the first key `update` returns)."""
        return max(0, start - self.window + 1)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Return keys/values (B, K, S_w, H) of positions first_key(start) .. start + T - 1; stage the new
        k, v (B, K, T, H) for `commit`."""
        B, K, C, H = self.k.shape
        _check_kv("k", k, B, K, H)
        _check_kv("v", v, B, K, H)
        if k.shape[2] != step.num_new or v.shape[2] != step.num_new:
            raise ValueError(f"k and v must hold the step's {step.num_new} new positions, got {k.shape[2]}")
        if step.end > self.max_seq_len:
            raise ValueError(f"cache overflow: writing positions [{step.start}, {step.end}) into a cache of "
                             f"max_seq_len {self.max_seq_len}")
        first = self.first_key(step.start)
        if first < min(self.oldest, step.start):   # a needed older key was overwritten (window 1 needs none)
            raise ValueError(f"the ring no longer holds positions [{first}, {self.oldest}) that a query at "
                             f"{step.start} needs (oldest intact position: {self.oldest})")
        slots = torch.arange(first, step.start, device=self.k.device) % C
        keys = torch.cat([self.k[:, :, slots], k], dim=2)      # (B, K, S_w, H), in position order
        values = torch.cat([self.v[:, :, slots], v], dim=2)
        keep = min(step.num_new, C)                            # only the last C new positions fit
        self._staged = (step, k.detach()[:, :, step.num_new - keep:], v.detach()[:, :, step.num_new - keep:])
        return keys, values

    def mask(self, step: CacheStep) -> torch.Tensor | None:
        first = self.first_key(step.start)
        return attention_mask(step.num_new, step.end - first, step.start, step.pad, window=self.window,
                              device=self.device, first_key=first)

    def commit(self, step: CacheStep) -> None:
        if self._staged is None or self._staged[0] is not step:
            raise RuntimeError("RollingKVCache.commit: this step was not staged by update (commit follows "
                               "update within one forward)")
        _, k, v = self._staged
        slots = torch.arange(step.end - k.shape[2], step.end, device=self.k.device) % self.capacity
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        self.oldest = max(self.oldest, step.end - self.capacity)
        self._staged = None

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, K, n, H) of the positions the ring still holds, [oldest, length), in order."""
        slots = torch.arange(min(self.oldest, length), length, device=self.k.device) % self.capacity
        return self.k[:, :, slots], self.v[:, :, slots]

    def check_truncate(self, n: int) -> None:
        """The next query (at position n) needs positions [first_key(n), n): each must still be in its slot.
        `oldest` only grows (max over every commit, rolled-back ones included), so a slot overwritten by a
        rejected draft is never mistaken for intact after a later rollback."""
        if self.first_key(n) < min(self.oldest, n):
            raise ValueError(
                f"cannot roll a sliding-window cache back to {n} tokens: the next query needs positions "
                f"[{self.first_key(n)}, {n}) but the ring buffer of {self.capacity} slots no longer holds "
                f"positions before {self.oldest} (overwritten); the shortest length it can roll back to is "
                f"{self.oldest + self.window - 1}; re-prefill to go further back, or build the cache with "
                f"spare slots (model.new_cache(..., max_rollback=...))")

    def truncate(self, n: int) -> None:
        """Positions >= n are forgotten; the slots of [oldest, n) stay intact."""
        self.check_truncate(n)
        self._staged = None
