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

from .attention import grouped_attention, require_shared_kv
from .config import ModelConfig
from .kv_cache import ContiguousKVCache, ForwardStep, LayerCache
from .layers import fuse_linears, keep_unfused_state_dict_keys, unfuse_linears
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
        self.owns_kv = self.kv_source == layer_idx   # False for CLA followers: no k/v projections, no cache
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(D, N * H, bias=False, device=device, dtype=dtype)
        if self.owns_kv:
            self.k_proj = nn.Linear(D, K * H, bias=False, device=device, dtype=dtype)
            self.v_proj = nn.Linear(D, K * H, bias=False, device=device, dtype=dtype)
        self.output_proj = nn.Linear(N * H, D, bias=False, device=device, dtype=dtype)
        attach_positional(self, config, device=device, dtype=dtype)   # rotate_q/k: RoPE, NoPE, QK-norm
        keep_unfused_state_dict_keys(self)

    def fuse_projections(self) -> None:
        """q, k and v (same input) as one matmul, `qkv_proj`; the state dict keeps q/k/v_proj."""
        if self.owns_kv and "qkv_proj" not in self._modules:
            fuse_linears(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def unfuse_projections(self) -> None:
        if "qkv_proj" in self._modules:
            unfuse_linears(self, "qkv_proj")

    def cache_spec(self) -> tuple:
        """(K, H, window): the `LayerCache.spec` this layer's cache must have."""
        return (self.num_kv_heads, self.head_dim, self.window)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> ContiguousKVCache:
        return ContiguousKVCache(batch_size, self.num_kv_heads, self.head_dim, max_seq_len,
                                 device=device, dtype=dtype or self.q_proj.weight.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None,
                cache: LayerCache | None = None, step: ForwardStep | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x (B, T, D) -> (out (B, T, D), the keys/values attended over: (B, K, S, H) each, or what the cache returns).

        rope = (cos, sin) of the T new positions; mask: over the S keys of a forward without a cache
        (with one, the cache picks it); cache/step: this layer's cache and the forward's step;
        shared_kv: the keys/values of this layer's CLA group owner (followers only)."""
        cos, sin = rope
        if "qkv_proj" in self._modules:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), *((self.k_proj(x), self.v_proj(x)) if self.owns_kv else (None, None))
        # Heads split with view/transpose, not einops: torch.compile re-traces einops' pattern parsing
        # on every call (it is cached only when eager), which tripled the compile of a decode step.
        B, T, H = x.shape[0], x.shape[1], self.head_dim
        q = self.rotate_q(q.view(B, T, -1, H).transpose(1, 2), cos, sin)          # (B, N, T, H)
        if self.owns_kv:
            k = self.rotate_k(k.view(B, T, -1, H).transpose(1, 2), cos, sin)      # (B, K, T, H)
            kv = (k, v.view(B, T, -1, H).transpose(1, 2))
            if cache is not None:
                kv = cache.update(*kv, step)  # every key the new queries may see
        else:
            kv = require_shared_kv(shared_kv, self.layer_idx, self.kv_source)
        if cache is None:
            out = grouped_attention(q, *kv, mask, kernel=self.attention_kernel)
        else:
            out = cache.attend(q, kv, step, kernel=self.attention_kernel)
        return self.output_proj(out.transpose(1, 2).reshape(B, T, -1)), kv             # (B, T, N*H)
