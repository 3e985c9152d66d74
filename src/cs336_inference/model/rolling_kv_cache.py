"""The sliding-window layer's cache: a ring buffer that holds the last window (+ spare) positions,
and, with attention sinks (StreamingLLM, Xiao et al. 2024), the first few positions for good.

Mistral 7B (Jiang et al. 2023). It alone knows the window's geometry: which positions `update` returns
and the band mask over them. Implements the `kv_cache.LayerCache` interface.
"""

from __future__ import annotations

import torch

from .. import _checks
from .attention import attention_mask, grouped_attention
from .kv_cache import CacheStep, KVBuffers, _check_kv


class RollingKVCache(KVBuffers):
    """Sliding-window attention's cache: a ring buffer of min(window + spare, max_seq_len) positions.

    Position p lives in slot p % capacity (Mistral 7B, Jiang et al. 2023), so memory stays flat however
    long the sequence grows. A query at position i sees keys i - window + 1 .. i, so `update` returns
    the keys of positions first_key(start) .. start + T - 1 in order: the older ones gathered from the
    ring, the T new ones as given (a long prefill needs new keys that the ring cannot hold at once),
    and `mask` is the band over exactly those positions. The ring is written at `commit`, so a forward
    that fails midway overwrites nothing. `spare` extra slots let `truncate` remove up to spare + 1
    positions after any forward (speculative decoding verifies gamma + 1 tokens, then rolls back).
    With `sinks` > 0 the first `sinks` positions are also kept apart, returned ahead of the window once
    it has slid past them, and stay visible to every query.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32, spare: int = 0, sinks: int = 0):
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        window=window, max_seq_len=max_seq_len)
        _checks.non_negative_int("spare", spare)
        _checks.non_negative_int("sinks", sinks)
        self.window, self.max_seq_len, self.sinks = window, max_seq_len, sinks
        self.capacity = min(window + spare, max_seq_len)
        self.allocate((batch_size, num_kv_heads, self.capacity, head_dim), device, dtype)
        # sinks only need slots of their own once the window can slide past them
        sink_shape = (batch_size, num_kv_heads, min(sinks, max(0, max_seq_len - window)), head_dim)
        self.sink_k = torch.zeros(sink_shape, device=device, dtype=dtype)
        self.sink_v = torch.zeros(sink_shape, device=device, dtype=dtype)
        self.oldest = 0       # oldest position whose slot still holds it (older ones were overwritten)
        self._staged = None   # (step, k, v, new sink k, new sink v) written at commit

    @property
    def spec(self) -> tuple:
        return (self.k.shape[1], self.k.shape[3], self.window, self.sinks)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.sink_k.nbytes + self.sink_v.nbytes

    def first_key(self, start: int) -> int:
        """Oldest position of the window a query at `start` attends to."""
        return max(0, start - self.window + 1)

    def sink_keys(self, start: int) -> int:
        """Sink positions returned ahead of the window for a query at `start`: those it slid past."""
        return min(self.sinks, self.first_key(start))

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Return keys/values (B, K, S_w, H) of the sink positions 0 .. sink_keys(start) - 1, then of
        first_key(start) .. start + T - 1; stage the new k, v (B, K, T, H) for `commit` (joins step.staged)."""
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
        n_sink = self.sink_keys(step.start)
        keys = torch.cat([self.sink_k[:, :, :n_sink], self.k[:, :, slots], k], dim=2)  # in position order
        values = torch.cat([self.sink_v[:, :, :n_sink], self.v[:, :, slots], v], dim=2)
        keep = min(step.num_new, C)                            # only the last C new positions fit
        to_sinks = max(0, min(step.end, self.sink_k.shape[2]) - step.start)  # new positions that are sinks
        self._staged = (step, k.detach()[:, :, step.num_new - keep:], v.detach()[:, :, step.num_new - keep:],
                        k.detach()[:, :, :to_sinks], v.detach()[:, :, :to_sinks])
        step.staged.append(self)
        return keys, values

    def attend(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], step: CacheStep,
               scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
        """Grouped attention under the band mask of this ring's window (`mask`)."""
        return grouped_attention(q, *kv, self.mask(step), scale, kernel=kernel)

    def mask(self, step: CacheStep) -> torch.Tensor | None:
        first, n_sink = self.first_key(step.start), self.sink_keys(step.start)
        return attention_mask(step.num_new, n_sink + step.end - first, step.start, step.pad, window=self.window,
                              device=self.device, first_key=first, sinks=self.sinks, sink_keys=n_sink)

    def commit(self, step: CacheStep) -> None:
        if self._staged is None or self._staged[0] is not step:
            raise RuntimeError("RollingKVCache.commit: this step was not staged by update (commit follows "
                               "update within one forward)")
        _, k, v, sink_k, sink_v = self._staged
        slots = torch.arange(step.end - k.shape[2], step.end, device=self.k.device) % self.capacity
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        self.sink_k[:, :, step.start:step.start + sink_k.shape[2]] = sink_k
        self.sink_v[:, :, step.start:step.start + sink_v.shape[2]] = sink_v
        self.oldest = max(self.oldest, step.end - self.capacity)
        self._staged = None

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, K, n, H) of the positions the ring still holds, [oldest, length), in order
        (the sinks, if any, are in sink_k / sink_v)."""
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
