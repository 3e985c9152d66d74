"""Attention: the scaled dot-product kernel, masks, and grouped-query attention (MHA/GQA/MQA).

GQA: Ainslie et al. 2023 (N query heads share K key/value heads; K = N is MHA, K = 1 is MQA,
Shazeer 2019). The cache holds K heads; queries are grouped onto them, never K/V repeated.
Cross-layer attention (CLA, Brandon et al. 2024): with `kv_share_group` g, only the first layer of
each group of g adjacent layers projects keys/values and owns a cache; the others reuse them.

The other variants live next door and are re-exported here: multi-head latent attention
(`attention_mla`) and sliding-window attention (`attention_window`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .config import ModelConfig
from .kv_cache import ContiguousKVCache
from .layers import Linear, apply_rope


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v, scale = 1/sqrt(H) unless given (MLA's absorbed path needs its own).

    q (..., T, H), k (..., S, H), v (..., S, Hv); mask (bool, True = may attend) broadcastable to
    (..., T, S). Softmax runs in fp32 so bf16 inputs do not lose the normalisation.
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of positions, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T, S)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return probs @ v


def attention_mask(num_new: int, num_keys: int, start_pos: int, pad: torch.Tensor | None = None,
                   window: int | None = None, device=None, first_key: int = 0) -> torch.Tensor | None:
    """Bool mask (B or 1, 1, T, S) for T new queries at positions start_pos.. over the S keys at
    positions first_key .. first_key + S - 1 (first_key > 0 when a rolling buffer dropped older ones).

    causal: key j <= query i; window: i - j < window; left padding: keys j < pad[b] are hidden from
    real queries (padding queries see everything causal, so their rows stay finite).
    Returns None when every key is visible (a plain decode step): the fast path.
    """
    if (num_new == 1 and pad is None and (window is None or num_keys <= window)
            and first_key + num_keys == start_pos + 1):
        return None
    i = torch.arange(start_pos, start_pos + num_new, device=device)[:, None]   # (T, 1)
    j = torch.arange(first_key, first_key + num_keys, device=device)[None, :]  # (1, S)
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    mask = mask[None, None]                                                    # (1, 1, T, S)
    if pad is not None:
        pad = pad.to(device)[:, None, None, None]                              # (B, 1, 1, 1)
        mask = mask & ((j >= pad) | (i < pad))
    return mask


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """q (B, N, T, H) over k (B, K, S, H), v (B, K, S, Hv) with N = K * G, without copying K/V G times."""
    B, N, T, H = q.shape
    G = N // k.shape[1]
    q = rearrange(q, "B (K G) T H -> B K (G T) H", G=G)
    if mask is not None:  # (B|1, 1, T, S) -> (B|1, 1, G*T, S)
        mask = rearrange(mask.expand(-1, -1, T, -1).unsqueeze(2).expand(-1, -1, G, -1, -1),
                         "B one G T S -> B one (G T) S")
    out = scaled_dot_product_attention(q, k, v, mask, scale)
    return rearrange(out, "B K (G T) H -> B (K G) T H", G=G)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with N query heads and K key/value heads, RoPE on q and k.

    With CLA (config.kv_share_group > 1) a layer that is not first in its group has no k_proj/v_proj:
    it reads the keys/values its group's first layer computed this forward (passed in `shared`).
    """

    window: int | None = None  # global attention; `SlidingWindowAttention` sets it

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
        q = rearrange(self.q_proj(x), "B T (N H) -> B N T H", H=self.head_dim)
        q = apply_rope(q, cos, sin)
        if self.owns_kv:
            k = rearrange(self.k_proj(x), "B T (K H) -> B K T H", H=self.head_dim)
            v = rearrange(self.v_proj(x), "B T (K H) -> B K T H", H=self.head_dim)
            k = apply_rope(k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, start_pos)  # (B, K, S, H): every key this query may see
            if shared is not None:
                shared[self.layer_idx] = (k, v)
        else:
            k, v = read_shared_kv(shared, self.layer_idx, self.kv_source)
        out = grouped_attention(q, k, v, mask)
        return self.output_proj(rearrange(out, "B N T H -> B T (N H)"))


def read_shared_kv(shared: dict | None, layer_idx: int, kv_source: int):
    """What layer `kv_source` left in `shared` this forward (CLA), with a clear error if it did not."""
    if shared is None or kv_source not in shared:
        raise RuntimeError(f"layer {layer_idx} shares keys/values with layer {kv_source} (cross-layer "
                           f"attention); run it inside TransformerLM.forward, after layer {kv_source}")
    return shared[kv_source]


from .attention_mla import MultiHeadLatentAttention  # noqa: E402  (re-export; they import the kernel above)
from .attention_window import SlidingWindowAttention  # noqa: E402

__all__ = ["GroupedQueryAttention", "MultiHeadLatentAttention", "SlidingWindowAttention", "attention_mask",
           "grouped_attention", "read_shared_kv", "scaled_dot_product_attention"]
