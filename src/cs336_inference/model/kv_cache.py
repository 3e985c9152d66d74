"""KV caches: keep every past token's keys and values so a decode step only computes the new token.

Without a cache, generating T tokens re-runs the whole prefix each step (O(T^2) tokens through the
model, O(T^3) attention FLOPs); with one, each step processes one token and reads the cache.

Two levels:
- a *layer cache* holds one layer's tensors: `ContiguousKVCache` (MHA/GQA/MQA), `RollingKVCache`
  (sliding-window layers), `LatentKVCache` (MLA). Layer caches are told where to write; each reports
  `nbytes`, `bytes_per_token` and supports `truncate(n)` (after `check_truncate(n)` agreed).
- `KVCache` is the model's cache: one layer cache per layer (the same object for layers that share,
  as in cross-layer attention), the number of tokens already cached, and optional left padding.
"""

from __future__ import annotations

import torch


def _check_kv(name: str, x: torch.Tensor, batch: int, heads: int, dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != dim:
        raise ValueError(f"{name} must have shape (B={batch}, K={heads}, T, H={dim}), got {tuple(x.shape)}")


def check_kv_write(k: torch.Tensor, v: torch.Tensor, start_pos: int, buffer: torch.Tensor, max_seq_len: int) -> int:
    """Validate a write of k, v (B, K, T, H) at start_pos into a (B, K, S_max, H) buffer; return its end."""
    B, K, _, H = buffer.shape
    _check_kv("k", k, B, K, H)
    _check_kv("v", v, B, K, H)
    end = start_pos + k.shape[2]
    if start_pos < 0 or end > max_seq_len:
        raise ValueError(f"cache overflow: writing positions [{start_pos}, {end}) into a cache of "
                         f"max_seq_len {max_seq_len}")
    return end


class _KVBuffers:
    """Storage accounting shared by caches that keep K and V buffers of shape (B, K, slots, H)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position of one sequence occupies in this layer: 2 (K, V) * K * H * element size."""
        _, K, _, H = self.k.shape
        return 2 * K * H * self.k.element_size()


class ContiguousKVCache(_KVBuffers):
    """One layer's keys and values in preallocated buffers of shape (B, K, S_max, H).

    Preallocating the maximum length makes append an in-place copy (no torch.cat per step) and
    keeps the readable prefix a view; the price is memory reserved up front (paging fixes that).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, K, T, H) at positions [start_pos, start_pos + T); return all keys/values so far."""
        end = check_kv_write(k, v, start_pos, self.k, self.max_seq_len)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions, as views (B, K, length, H)."""
        return self.k[:, :, :length], self.v[:, :, :length]

    def check_truncate(self, n: int) -> None:
        """Every position < max_seq_len stays intact until overwritten, so any rollback is fine."""

    def truncate(self, n: int) -> None:
        """Nothing to free: positions >= n are simply overwritten by the next update."""



def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class RollingKVCache(_KVBuffers):
    """Sliding-window attention's cache: a ring buffer of exactly min(window, max_seq_len) positions,
    plus, with `sinks` > 0, the first `sinks` positions kept apart for good (attention sinks).

    Position p lives in slot p % capacity (Mistral 7B, Jiang et al. 2023), so memory stays flat however
    long the sequence grows. A query at position i sees keys i - window + 1 .. i (and the sinks), so
    `update` returns the keys of the sink positions 0 .. sink_keys(start_pos) - 1, then of positions
    max(0, start_pos - window + 1) .. start_pos + T - 1 in order: the older ones gathered from the ring,
    the T new ones as given (a long prefill needs new keys that the ring cannot hold at once). The
    model builds its band mask over exactly those positions.
    Rollback (`truncate`) only works while the positions the next query needs are still in the ring.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32, sinks: int = 0):
        _check_positive(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        window=window, max_seq_len=max_seq_len)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be a non-negative int, got {sinks!r}")
        self.window, self.max_seq_len, self.sinks = window, max_seq_len, sinks
        self.capacity = min(window, max_seq_len)
        shape = (batch_size, num_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # sinks only need their own slots once the window can slide past them
        sink_shape = (batch_size, num_kv_heads, min(sinks, max(0, max_seq_len - window)), head_dim)
        self.sink_k = torch.zeros(sink_shape, device=device, dtype=dtype)
        self.sink_v = torch.zeros(sink_shape, device=device, dtype=dtype)
        self.length = 0   # positions written so far (the next start_pos)
        self.oldest = 0   # oldest position not yet overwritten

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.sink_k.nbytes + self.sink_v.nbytes

    def first_key(self, start_pos: int) -> int:
        """Oldest position of the window a query at start_pos attends to."""
        return max(0, start_pos - self.window + 1)

    def sink_keys(self, start_pos: int) -> int:
        """Sink positions returned ahead of the window: those that fell out of it."""
        return min(self.sinks, self.first_key(start_pos))

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, K, T, H) for positions start_pos..; return keys/values (B, K, S_w, H) of the sink
        positions 0 .. sink_keys(start_pos) - 1, then of first_key(start_pos) .. start_pos + T - 1."""
        B, K, C, H = self.k.shape
        _check_kv("k", k, B, K, H)
        _check_kv("v", v, B, K, H)
        T = k.shape[2]
        end = start_pos + T
        if start_pos != self.length:
            raise ValueError(f"start_pos ({start_pos}) must equal the positions already written ({self.length})")
        if end > self.max_seq_len:
            raise ValueError(f"cache overflow: writing positions [{start_pos}, {end}) into a cache of "
                             f"max_seq_len {self.max_seq_len}")
        slots = torch.arange(self.first_key(start_pos), start_pos, device=self.k.device) % C
        n_sink = self.sink_keys(start_pos)
        keys = torch.cat([self.sink_k[:, :, :n_sink], self.k[:, :, slots], k], dim=2)  # in position order
        values = torch.cat([self.sink_v[:, :, :n_sink], self.v[:, :, slots], v], dim=2)
        if start_pos < self.sink_k.shape[2]:                   # the first positions also go to the sinks
            stop = min(end, self.sink_k.shape[2])
            self.sink_k[:, :, start_pos:stop] = k[:, :, :stop - start_pos]
            self.sink_v[:, :, start_pos:stop] = v[:, :, :stop - start_pos]
        keep = min(T, C)                                       # only the last C new positions fit
        new_slots = torch.arange(end - keep, end, device=self.k.device) % C
        self.k[:, :, new_slots] = k[:, :, T - keep:]
        self.v[:, :, new_slots] = v[:, :, T - keep:]
        self.length, self.oldest = end, max(self.oldest, end - C)
        return keys, values

    def held_positions(self) -> range:
        """Positions whose keys/values the ring still holds intact, oldest first."""
        return range(max(self.oldest, self.length - self.capacity), self.length)

    def read(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, K, n, H) of the held positions before `length` (default: all written), in order."""
        held = self.held_positions()
        length = self.length if length is None else length
        if not held.start <= length <= self.length:
            raise ValueError(f"length must be in [{held.start}, {self.length}] (positions the ring holds), got {length}")
        slots = torch.arange(held.start, length, device=self.k.device) % self.capacity
        return self.k[:, :, slots], self.v[:, :, slots]

    def check_truncate(self, n: int) -> None:
        held = self.held_positions().start
        if self.first_key(n) < held:
            raise ValueError(
                f"cannot roll a sliding-window cache back to {n} tokens: the next query needs positions "
                f"[{self.first_key(n)}, {n}) but the ring buffer of {self.capacity} slots only holds "
                f"[{held}, {self.length}) (older ones were overwritten); the shortest length it can "
                f"roll back to is {held + self.window - 1}; re-prefill to go further back")

    def truncate(self, n: int) -> None:
        self.check_truncate(n)
        self.oldest = self.held_positions().start  # positions before it were overwritten for good
        self.length = n



class LatentKVCache:
    """Multi-head latent attention's cache (DeepSeek-V2): per token, the latent c (C dims) and the
    decoupled RoPE key (R dims, shared by all heads), stored side by side as (B, S_max, C + R).

    One tensor (not two) so the absorbed decode path attends over it as a single shared key head
    without concatenating per step; the latent part doubles as the values.
    """

    def __init__(self, batch_size: int, kv_lora_rank: int, rope_head_dim: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        _check_positive(batch_size=batch_size, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
                        max_seq_len=max_seq_len)
        self.kv_lora_rank, self.rope_head_dim, self.max_seq_len = kv_lora_rank, rope_head_dim, max_seq_len
        self.latent = torch.zeros(batch_size, max_seq_len, kv_lora_rank + rope_head_dim, device=device, dtype=dtype)

    def update(self, latent: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Write latent (B, T, C + R) = [c, k_rope] at positions start_pos..; return (B, start_pos + T, C + R)."""
        B, _, E = self.latent.shape
        if not isinstance(latent, torch.Tensor):
            raise TypeError(f"latent must be a torch.Tensor, got {type(latent).__name__}")
        if latent.dim() != 3 or latent.shape[0] != B or latent.shape[2] != E:
            raise ValueError(f"latent must have shape (B={B}, T, C+R={E}), got {tuple(latent.shape)}")
        end = start_pos + latent.shape[1]
        if start_pos < 0 or end > self.max_seq_len:
            raise ValueError(f"cache overflow: writing positions [{start_pos}, {end}) into a cache of "
                             f"max_seq_len {self.max_seq_len}")
        self.latent[:, start_pos:end] = latent
        return self.read(end)

    def read(self, length: int) -> torch.Tensor:
        return self.latent[:, :length]

    def check_truncate(self, n: int) -> None:
        """Like the contiguous cache, every written position stays intact."""

    def truncate(self, n: int) -> None:
        """Nothing to free: positions >= n are overwritten by the next update."""

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes

    @property
    def bytes_per_token(self) -> int:
        """(C + R) * element size: the latent plus the shared RoPE key, whatever the head count."""
        return self.latent.shape[2] * self.latent.element_size()


class KVCache:
    """The model's cache: per-layer caches, the number of cached tokens, and left padding.

    `length` is the number of positions already written (the `start_pos` of the next forward).
    `pad` (B,) counts left-padding slots per sequence in a ragged batch (masked out of attention).
    """

    def __init__(self, layers: list, max_seq_len: int, batch_size: int, pad: torch.Tensor | None = None):
        if not layers:
            raise ValueError("layers must be a non-empty list of layer caches")
        self.layers = list(layers)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.length = 0
        self.pad = pad

    def __len__(self) -> int:
        return self.length

    def unique_layers(self) -> list:
        """Each distinct layer cache once (layers that share a cache count once)."""
        seen, unique = set(), []
        for layer in self.layers:
            if id(layer) not in seen:
                seen.add(id(layer))
                unique.append(layer)
        return unique

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage actually allocated (shared caches counted once)."""
        return sum(layer.nbytes for layer in self.unique_layers())

    @property
    def bytes_per_token(self) -> int:
        """Bytes that one more token of one sequence adds, summed over the model's layers."""
        return sum(layer.bytes_per_token for layer in self.unique_layers())

    def check_room(self, num_new: int, start_pos: int) -> None:
        """Refuse (before anything is written) a write that is out of order or overflows."""
        if start_pos != self.length:
            raise ValueError(f"start_pos ({start_pos}) must equal the number of cached tokens "
                             f"({self.length}); call cache.truncate(start_pos) to roll back first")
        if self.length + num_new > self.max_seq_len:
            raise ValueError(f"cache overflow: {self.length} cached + {num_new} new tokens exceeds "
                             f"max_seq_len {self.max_seq_len}")

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (speculative decoding discards rejected drafts this way)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if not 0 <= n <= self.length:
            raise ValueError(f"n must be in [0, {self.length}] (the cached length), got {n}")
        layers = self.unique_layers()
        for layer in layers:  # every layer agrees before any changes (rolling buffers may refuse)
            layer.check_truncate(n)
        for layer in layers:
            layer.truncate(n)
        self.length = n
