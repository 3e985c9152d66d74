"""KV caches: keep every past token's keys and values so a decode step only computes the new token.

Without a cache, generating T tokens re-runs the whole prefix each step (O(T^2) tokens through the
model, O(T^3) attention FLOPs); with one, each step processes one token and reads the cache.

Two levels:
- a *layer cache* holds one layer's tensors (`ContiguousKVCache` here; the attention variants add
  their own classes: rolling buffers, latent caches). Layer caches are told where to write.
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


class ContiguousKVCache:
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
        B, K, _, H = self.k.shape
        _check_kv("k", k, B, K, H)
        _check_kv("v", v, B, K, H)
        end = start_pos + k.shape[2]
        if start_pos < 0 or end > self.max_seq_len:
            raise ValueError(f"cache overflow: writing positions [{start_pos}, {end}) into a cache of "
                             f"max_seq_len {self.max_seq_len}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions, as views (B, K, length, H)."""
        return self.k[:, :, :length], self.v[:, :, :length]

    def truncate(self, n: int) -> None:
        """Nothing to free: positions >= n are simply overwritten by the next update."""

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies in this layer: 2 (K and V) * K * H * element size."""
        _, K, _, H = self.k.shape
        return 2 * K * H * self.k.element_size()


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
        for layer in self.unique_layers():
            layer.truncate(n)
        self.length = n
