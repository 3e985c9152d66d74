"""Grouped-query attention (MHA/GQA/MQA) and cross-layer KV sharing.

GQA: Ainslie et al. 2023 (N query heads share K key/value heads; K = N is MHA, K = 1 is MQA,
Shazeer 2019). The cache holds K heads; queries are grouped onto them, never K/V repeated.
Cross-layer attention (CLA, Brandon et al. 2024): with `kv_share_group` g, only the first layer of
each group of g adjacent layers projects keys/values and owns a cache; the others reuse them: every
attention module returns the keys/values it attended over, and the model hands the owner's to the
rest of its group (`shared_kv`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .attention import grouped_attention, require_shared_kv
from .config import ModelConfig
from .kv_cache import CacheStep, ContiguousKVCache, LayerCache
from .layers import Linear, fuse_linears, keep_unfused_state_dict_keys, unfuse_linears
from .variants import attach_positional


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with N query heads and K key/value heads, RoPE on q and k (or the
    config's positional / QK-norm variant: `rotate_q`, `rotate_k`, see `variants`).

    With CLA (config.kv_share_group > 1) a layer that is not first in its group has no k_proj/v_proj:
    it attends over the keys/values its group's first layer returned this forward (`shared_kv`).
    """

    window: int | None = None  # global attention; `SlidingWindowAttention` sets it
    attention_kernel: str = "reference"   # or "sdpa" (`TransformerLM.set_attention_kernel`)

    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.kv_source = config.kv_source_layer(layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = Linear(D, N * H, device=device, dtype=dtype)
        if self.owns_kv:
            self.k_proj = Linear(D, K * H, device=device, dtype=dtype)
            self.v_proj = Linear(D, K * H, device=device, dtype=dtype)
        self.output_proj = Linear(N * H, D, device=device, dtype=dtype)
        attach_positional(self, config, device=device, dtype=dtype)   # rotate_q/k: RoPE, NoPE, QK-norm
        keep_unfused_state_dict_keys(self)

    def fuse_projections(self) -> None:
        """q, k and v (same input) as one matmul, `qkv_proj`; the state dict keeps q/k/v_proj."""
        if self.owns_kv and "qkv_proj" not in self._modules:
            fuse_linears(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def unfuse_projections(self) -> None:
        if "qkv_proj" in self._modules:
            unfuse_linears(self, "qkv_proj")

    @property
    def owns_kv(self) -> bool:
        """True if this layer projects keys/values itself (and owns a cache); False for CLA followers."""
        return self.kv_source == self.layer_idx

    def cache_spec(self) -> tuple:
        """(K, H, window): the `LayerCache.spec` this layer's cache must have."""
        return (self.num_kv_heads, self.head_dim, self.window)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> ContiguousKVCache:
        return ContiguousKVCache(batch_size, self.num_kv_heads, self.head_dim, max_seq_len,
                                 device=device, dtype=dtype or self.q_proj.weight.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None,
                cache: LayerCache | None = None, step: CacheStep | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x (B, T, D) -> (out (B, T, D), (keys, values) attended over, each (B, K, S, H)).

        rope = (cos, sin) of the T new positions; mask over the S keys (from the cache, or causal);
        cache/step: this layer's cache and the forward's `CacheStep`; shared_kv: the keys/values of
        this layer's CLA group owner (followers only)."""
        cos, sin = rope
        if "qkv_proj" in self._modules:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), *((self.k_proj(x), self.v_proj(x)) if self.owns_kv else (None, None))
        q = rearrange(q, "B T (N H) -> B N T H", H=self.head_dim)
        q = self.rotate_q(q, cos, sin)
        if self.owns_kv:
            k = rearrange(k, "B T (K H) -> B K T H", H=self.head_dim)
            v = rearrange(v, "B T (K H) -> B K T H", H=self.head_dim)
            kv = (self.rotate_k(k, cos, sin), v)
            if cache is not None:
                kv = cache.update(*kv, step)  # (B, K, S, H): every key the new queries may see
        else:
            kv = require_shared_kv(shared_kv, self.layer_idx, self.kv_source)
        # the kernel choice travels only when it is not the default, so caches that override `attend`
        # without a `kernel` argument keep working with the reference kernel
        options = {} if self.attention_kernel == "reference" else {"kernel": self.attention_kernel}
        if cache is None:
            out = grouped_attention(q, *kv, mask, **options)
        else:
            out = cache.attend(q, kv, mask, step, **options)
        return self.output_proj(rearrange(out, "B N T H -> B T (N H)")), kv
