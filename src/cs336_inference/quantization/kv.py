"""A quantized KV cache: keys and values stored as int8, fp8 or int4 with absmax scales per token.

Decode reads the whole cache every step, so at long contexts and large batches the cache, not the
weights, dominates the bytes moved (Hooper et al. 2024, KVQuant; Liu et al. 2024, KIVI). Storing it in
8 bits halves those bytes relative to bf16 (quarters them relative to fp32). Each (sequence, head,
position) vector of H values gets its own absmax scale, so one large token cannot spoil the rest;
int4 (two codes per byte, `packing.pack_int4`) needs finer scales: one per group of 32 values.

`QuantizedKVCache` implements the layer-cache interface (`model.kv_cache.LayerCache`: `update(k, v,
step)`, `mask(step)`, `commit`, `check_truncate(n)`, `truncate(n)`, `nbytes`, `bytes_per_token`), and
`quantize_kv_cache(model.new_cache(...))` swaps it into a model's `KVCache` in place of the
full-precision layers, so `forward`, `prefill` and `decode_one_token` use it unchanged. Given a cache
that already holds a prefill, it stores those positions quantized: the prompt's own attention ran in
full precision and every decode step reads the compressed cache (what serving engines do).
"""

from __future__ import annotations

import torch

from .. import _checks
from ..model.kv_cache import CacheStep, ContiguousKVCache, KVCache, LayerCache, check_kv_write
from .fp8 import fp8_dtype
from .packing import pack_int4, unpack_int4

KV_FORMATS = ("int8", "e4m3", "e5m2", "int4")
INT4_GROUP = 32  # int4 values per scale (16 levels cannot span a whole 64-128-dim head's range well)


class QuantizedKVCache(LayerCache):
    """One layer's keys and values as codes (B, K, S_max, H) (int4: two per byte, (B, K, S_max, H/2))
    with fp16 absmax scales (B, K, S_max, H / group_size): group_size = H (one per head) unless given."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int, device=None,
                 dtype: torch.dtype = torch.float32, fmt: str = "int8", scale_dtype: torch.dtype = torch.float16,
                 group_size: int | None = None):
        _checks.one_of("fmt", fmt, KV_FORMATS)
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              max_seq_len=max_seq_len)
        if group_size is None:
            group_size = min(INT4_GROUP, head_dim) if fmt == "int4" else head_dim
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or head_dim % group_size:
            raise ValueError(f"group_size must be a positive divisor of head_dim={head_dim}, got {group_size!r}")
        if fmt == "int4" and group_size % 2:
            raise ValueError(f"int4 packs two codes per byte: group_size must be even, got {group_size}")
        self.fmt, self.dtype, self.max_seq_len, self.group_size = fmt, dtype, max_seq_len, group_size
        store = {"int8": torch.int8, "int4": torch.uint8}.get(fmt) or fp8_dtype(fmt)
        self.qmax = {"int8": 127.0, "int4": 7.0}.get(fmt) or torch.finfo(store).max
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim // 2 if fmt == "int4" else head_dim)
        self.k = torch.zeros(shape, device=device, dtype=store)
        self.v = torch.zeros(shape, device=device, dtype=store)
        scale_shape = shape[:-1] + (head_dim // group_size,)
        self.k_scale = torch.ones(scale_shape, device=device, dtype=scale_dtype)
        self.v_scale = torch.ones(scale_shape, device=device, dtype=scale_dtype)
        # the logical (B, K, S_max, H) layout writes are checked against (int4 stores H/2 bytes): no memory
        self._layout = torch.empty(batch_size, num_kv_heads, max_seq_len, head_dim, device="meta")

    @classmethod
    def like(cls, layer, fmt: str = "int8", group_size: int | None = None) -> "QuantizedKVCache":
        """A quantized cache with the shape, device and compute dtype of a `ContiguousKVCache`."""
        if not isinstance(layer, ContiguousKVCache):
            raise TypeError(f"only full-attention layer caches (ContiguousKVCache) can be quantized here; "
                            f"got {type(layer).__name__} (rolling and latent caches keep their own layout)")
        B, K, S, H = layer.k.shape
        return cls(B, K, H, S, device=layer.k.device, dtype=layer.k.dtype, fmt=fmt, group_size=group_size)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, K, T, H) -> codes, scales (B, K, T, H / group_size): absmax per group of values."""
        groups = x.float().unflatten(-1, (-1, self.group_size))                # (B, K, T, H/g, g)
        # clamped after the cast: a tiny scale would round to 0 in fp16, and x / 0 is NaN for an all-zero vector
        scale = (groups.abs().amax(-1) / self.qmax).to(self.k_scale.dtype)
        scale = scale.clamp(min=torch.finfo(self.k_scale.dtype).tiny)
        y = (groups / scale.float()[..., None]).clamp(-self.qmax, self.qmax).flatten(-2)  # scale as stored
        if self.fmt == "int8":
            return torch.round(y).to(torch.int8), scale
        if self.fmt == "int4":
            return pack_int4(torch.round(y).to(torch.int8)), scale
        return y.to(self.k.dtype), scale

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        q = unpack_int4(codes) if self.fmt == "int4" else codes
        groups = q.float().unflatten(-1, (-1, self.group_size)) * scale.float()[..., None]
        return groups.flatten(-2).to(self.dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and write k, v (B, K, T, H) at [start, start + T); return all (dequantized)."""
        end = check_kv_write(k, v, step, self._layout, self.max_seq_len)
        self.k[:, :, step.start:end], self.k_scale[:, :, step.start:end] = self._encode(k.detach())
        self.v[:, :, step.start:end], self.v_scale[:, :, step.start:end] = self._encode(v.detach())
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of the first `length` positions (B, K, length, H)."""
        return (self._decode(self.k[:, :, :length], self.k_scale[:, :, :length]),
                self._decode(self.v[:, :, :length], self.v_scale[:, :, :length]))

    @property
    def spec(self) -> tuple:
        return (self.k.shape[1], self._layout.shape[3], None)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * K heads * (H values of 1 byte, or half a byte for int4, + H / group_size scales)."""
        _, K, _, stored = self.k.shape
        return 2 * K * (stored * self.k.element_size() + self.k_scale.shape[-1] * self.k_scale.element_size())


def quantize_kv_cache(cache: KVCache, fmt: str = "int8", group_size: int | None = None) -> KVCache:
    """Replace every layer of a `KVCache` (from `model.new_cache`) by a `QuantizedKVCache`; returns `cache`.

    An empty cache quantizes everything written later. A cache that already holds a prefill has its
    positions quantized now (the prompt's attention ran in full precision; decode reads the codes).
    Layers that share one cache (cross-layer sharing) keep sharing the replacement. Every check runs
    before any layer is replaced.
    """
    _checks.instance("cache", cache, KVCache, "a KVCache from model.new_cache")
    _checks.one_of("fmt", fmt, KV_FORMATS)
    replaced = {id(layer): QuantizedKVCache.like(layer, fmt, group_size) for layer in cache.unique_layers()}
    if cache.length:
        step = CacheStep(0, cache.length)
        for layer in cache.unique_layers():
            replaced[id(layer)].update(*layer.read(cache.length), step)
    cache.layers = [replaced[id(layer)] for layer in cache.layers]
    return cache
