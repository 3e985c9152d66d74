"""Grouped-query attention (MHA/GQA/MQA) and cross-layer KV sharing.

GQA: Ainslie et al. 2023 (N query heads share K key/value heads; K = N is MHA, K = 1 is MQA,
Shazeer 2019). The cache holds K heads; queries are grouped onto them, never K/V repeated.
Cross-layer attention (CLA, Brandon et al. 2024): with `kv_share_group` g, only the first layer of
each group of g adjacent layers projects keys/values and owns a cache; the others reuse them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .attention import grouped_attention, read_shared_kv
from .config import ModelConfig
from .kv_cache import ContiguousKVCache
from .layers import Linear, apply_rope, fuse_linears, keep_unfused_state_dict_keys, unfuse_linears


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with N query heads and K key/value heads, RoPE on q and k.

    With CLA (config.kv_share_group > 1) a layer that is not first in its group has no k_proj/v_proj:
    it reads the keys/values its group's first layer computed this forward (passed in `shared`).
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

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None) -> ContiguousKVCache:
        return ContiguousKVCache(batch_size, self.num_kv_heads, self.head_dim, max_seq_len,
                                 device=device, dtype=dtype or self.q_proj.weight.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache=None,
                start_pos: int = 0, mask: torch.Tensor | None = None, shared: dict | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). rope = (cos, sin) for the T new positions; cache = this layer's cache;
        shared: per-forward dict layer -> keys/values, filled by owners and read by CLA followers."""
        cos, sin = rope
        if "qkv_proj" in self._modules:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), *((self.k_proj(x), self.v_proj(x)) if self.owns_kv else (None, None))
        q = rearrange(q, "B T (N H) -> B N T H", H=self.head_dim)
        q = apply_rope(q, cos, sin)
        if self.owns_kv:
            k = rearrange(k, "B T (K H) -> B K T H", H=self.head_dim)
            v = rearrange(v, "B T (K H) -> B K T H", H=self.head_dim)
            k = apply_rope(k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, start_pos)  # (B, K, S, H): every key this query may see
            if shared is not None:
                shared[self.layer_idx] = (k, v)
        else:
            k, v = read_shared_kv(shared, self.layer_idx, self.kv_source)
        out = grouped_attention(q, k, v, mask, kernel=self.attention_kernel)
        return self.output_proj(rearrange(out, "B N T H -> B T (N H)"))
