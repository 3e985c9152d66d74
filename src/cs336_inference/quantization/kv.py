"""An 8-bit KV cache: keys and values stored as int8 (or fp8) with one scale per token and head.

Decode reads the whole cache every step, so at long contexts and large batches the cache, not the
weights, dominates the bytes moved (Hooper et al. 2024, KVQuant; Liu et al. 2024, KIVI). Storing it in
8 bits halves those bytes relative to bf16 (quarters them relative to fp32). Each (sequence, head,
position) vector of H values gets its own absmax scale, so one large token cannot spoil the rest.

`QuantizedKVCache` implements the layer-cache interface (`model.kv_cache.LayerCache`: `update(k, v,
step)`, `mask(step)`, `commit`, `check_truncate(n)`, `truncate(n)`, `nbytes`, `bytes_per_token`), and
`quantize_kv_cache(model.new_cache(...))` swaps it into a model's `KVCache` in place of the
full-precision layers, so `forward`, `prefill` and `decode_one_token` use it unchanged.
"""

from __future__ import annotations

import torch

from .. import _checks
from ..model.kv_cache import CacheStep, ContiguousKVCache, KVCache, LayerCache, check_kv_write
from .fp8 import fp8_dtype

KV_FORMATS = ("int8", "e4m3", "e5m2")


class QuantizedKVCache(LayerCache):
    """One layer's keys and values in 8 bits, (B, K, S_max, H), with fp16 scales (B, K, S_max, 1)."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int, device=None,
                 dtype: torch.dtype = torch.float32, fmt: str = "int8", scale_dtype: torch.dtype = torch.float16):
        _checks.one_of("fmt", fmt, KV_FORMATS)
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              max_seq_len=max_seq_len)
        self.fmt, self.dtype, self.max_seq_len = fmt, dtype, max_seq_len
        store = torch.int8 if fmt == "int8" else fp8_dtype(fmt)
        self.qmax = 127.0 if fmt == "int8" else torch.finfo(store).max
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=store)
        self.v = torch.zeros(shape, device=device, dtype=store)
        self.k_scale = torch.ones(shape[:-1] + (1,), device=device, dtype=scale_dtype)
        self.v_scale = torch.ones(shape[:-1] + (1,), device=device, dtype=scale_dtype)

    @classmethod
    def like(cls, layer, fmt: str = "int8") -> "QuantizedKVCache":
        """A quantized cache with the shape, device and compute dtype of a `ContiguousKVCache`."""
        if not isinstance(layer, ContiguousKVCache):
            raise TypeError(f"only full-attention layer caches (ContiguousKVCache) can be quantized here; "
                            f"got {type(layer).__name__} (rolling and latent caches keep their own layout)")
        B, K, S, H = layer.k.shape
        return cls(B, K, H, S, device=layer.k.device, dtype=layer.k.dtype, fmt=fmt)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # clamped after the cast: a tiny scale would round to 0 in fp16, and x / 0 is NaN for an all-zero vector
        scale = (x.float().abs().amax(-1, keepdim=True) / self.qmax).to(self.k_scale.dtype)
        scale = scale.clamp(min=torch.finfo(self.k_scale.dtype).tiny)
        y = (x.float() / scale.float()).clamp(-self.qmax, self.qmax)      # scale as stored, so decode matches
        return (torch.round(y).to(torch.int8) if self.fmt == "int8" else y.to(self.k.dtype)), scale

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and write k, v (B, K, T, H) at [start, start + T); return all (dequantized)."""
        end = check_kv_write(k, v, step, self.k, self.max_seq_len)
        self.k[:, :, step.start:end], self.k_scale[:, :, step.start:end] = self._encode(k.detach())
        self.v[:, :, step.start:end], self.v_scale[:, :, step.start:end] = self._encode(v.detach())
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of the first `length` positions (B, K, length, H)."""
        k = (self.k[:, :, :length].float() * self.k_scale[:, :, :length].float()).to(self.dtype)
        v = (self.v[:, :, :length].float() * self.v_scale[:, :, :length].float()).to(self.dtype)
        return k, v

    @property
    def spec(self) -> tuple:
        return (self.k.shape[1], self.k.shape[3], None)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * K heads * (H one-byte values + one scale)."""
        _, K, _, H = self.k.shape
        return 2 * K * (H * self.k.element_size() + self.k_scale.element_size())


def quantize_kv_cache(cache: KVCache, fmt: str = "int8") -> KVCache:
    """Replace every layer of an empty `KVCache` (from `model.new_cache`) by a `QuantizedKVCache`.

    Layers that share one cache (cross-layer sharing) keep sharing the replacement. Returns `cache`.
    """
    _checks.instance("cache", cache, KVCache, "a KVCache from model.new_cache")
    if cache.length != 0:
        raise ValueError(f"quantize an empty cache (this one already holds {cache.length} tokens)")
    _checks.one_of("fmt", fmt, KV_FORMATS)
    replaced = {id(layer): QuantizedKVCache.like(layer, fmt) for layer in cache.unique_layers()}
    cache.layers = [replaced[id(layer)] for layer in cache.layers]
    return cache
