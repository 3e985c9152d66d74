"""Multi-head latent attention (MLA), DeepSeek-V2 (DeepSeek-AI 2024), Section 2.1.

Instead of caching N heads of keys and values (2 N H numbers per token per layer), MLA caches one
low-rank latent c = W_DKV h of C = kv_lora_rank dims, and up-projects it to every head's key and
value when needed: k_n = W_UK,n c, v_n = W_UV,n c. RoPE does not commute with that up-projection, so
position goes into a separate *decoupled* key k_R = RoPE(W_KR h) of R = rope_head_dim dims that all
heads share; each head's query has a matching rotated part. Per token per layer the cache holds
C + R numbers (DeepSeek-V2: 512 + 64 = 576 instead of 2 * 128 * 128 = 32768).

Two ways to attend over the cached latents:
- naive: up-project every cached latent to per-head K and V, then ordinary attention
  (the training / prefill path: it costs O(S N H C) extra FLOPs per step at decode time);
- absorbed: q_n . k_n = q_n . (W_UK,n c) = (W_UK,n^T q_n) . c, so fold W_UK into the query and
  attend directly over the latents as one shared key head (MQA-like); likewise fold W_UV into the
  output. Decode then reads only the (C + R)-dim cache: this is where MLA's bandwidth win comes from.

We follow the paper's equations (9)-(14): no extra RMSNorm on the latents (the released checkpoints
add one), so a full-rank MLA (C >= 2 N H) can express any MHA whose keys carry a shared rotated part.
State-dict keys: q_proj (or q_down_proj + q_up_proj with q_lora_rank), kv_down_proj, k_rope_proj,
k_up_proj, v_up_proj, output_proj. CLA followers have no kv_down_proj / k_rope_proj.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import einsum, rearrange

from .attention import grouped_attention, require_shared_kv, scaled_dot_product_attention
from .config import ModelConfig
from .kv_cache import CacheStep, LayerCache
from .latent_kv_cache import LatentKVCache
from .layers import apply_rope


class MultiHeadLatentAttention(nn.Module):
    """MLA with N heads of H = D / N "content" dims plus R rotated dims, over a C-dim latent cache.

    `absorb` (default True) picks the absorbed path whenever a cache is used (prefill and decode);
    the full forward without a cache (training) always uses the naive path.
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        if config.attention_type != "mla":
            raise ValueError(f"MultiHeadLatentAttention needs attention_type='mla', got {config.attention_type!r}")
        self.layer_idx = layer_idx
        self.kv_source = config.kv_source_layer(layer_idx)
        self.owns_kv = self.kv_source == layer_idx   # False for CLA followers: no k/v projections, no cache
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.kv_lora_rank, self.rope_head_dim = config.kv_lora_rank, config.rope_head_dim
        self.absorb = True
        D, N, H, C, R = config.d_model, config.num_heads, config.head_dim, config.kv_lora_rank, config.rope_head_dim
        kw = dict(bias=False, device=device, dtype=dtype)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * (H + R), **kw)
        else:  # queries are compressed too (saves activation memory in training, not cache)
            self.q_down_proj = nn.Linear(D, config.q_lora_rank, **kw)
            self.q_up_proj = nn.Linear(config.q_lora_rank, N * (H + R), **kw)
        if self.owns_kv:
            self.kv_down_proj = nn.Linear(D, C, **kw)      # W_DKV: h -> latent c
            self.k_rope_proj = nn.Linear(D, R, **kw)       # W_KR: h -> shared key to rotate
        self.k_up_proj = nn.Linear(C, N * H, **kw)         # W_UK: c -> per-head keys
        self.v_up_proj = nn.Linear(C, N * H, **kw)         # W_UV: c -> per-head values
        self.output_proj = nn.Linear(N * H, D, **kw)

    def cache_spec(self) -> tuple:
        """(1, C + R, None): one shared latent key head, global."""
        return (1, self.kv_lora_rank + self.rope_head_dim, None)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> LatentKVCache:
        return LatentKVCache(batch_size, self.kv_lora_rank, self.rope_head_dim, max_seq_len,
                             device=device, dtype=dtype or self.k_up_proj.weight.dtype)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> queries (B, N, T, H + R): H content dims then R dims to rotate."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_up_proj(self.q_down_proj(x))
        return rearrange(q, "B T (N E) -> B N T E", N=self.num_heads)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> what the cache stores per token: [c, RoPE(W_KR x)] as one key head (B, 1, T, C + R)."""
        c = self.kv_down_proj(x)[:, None]                              # (B, 1, T, C)
        k_rope = apply_rope(self.k_rope_proj(x)[:, None], cos, sin)    # (B, 1, T, R): one shared head;
        return torch.cat([c, k_rope], dim=-1)                          # cos may be per-sequence (B, 1, T, R/2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None,
                cache: LayerCache | None = None, step: CacheStep | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x (B, T, D) -> (out (B, T, D), (keys (B, 1, S, C + R), values (B, 1, S, C))); rope = (cos, sin)
        of R/2 angles for the T new positions. The keys are the latents: one head shared by all N."""
        cos, sin = rope
        H, R = self.head_dim, self.rope_head_dim
        q_nope, q_rope = self.query(x).split([H, R], dim=-1)          # (B, N, T, H), (B, N, T, R)
        q_rope = apply_rope(q_rope, cos, sin)
        if self.owns_kv:
            latent = self.latent(x, cos, sin)                          # (B, 1, T, C + R)
            kv = (latent, latent[..., :self.kv_lora_rank])             # the latent doubles as the values
            if cache is not None:
                kv = cache.update(*kv, step)                           # (B, 1, S, C + R), (B, 1, S, C)
        else:
            kv = require_shared_kv(shared_kv, self.layer_idx, self.kv_source)
        if cache is not None and self.absorb:
            out = self.attend_absorbed(q_nope, q_rope, kv[0], None, cache, step)
        else:
            out = self.attend_naive(q_nope, q_rope, kv[0], mask if cache is None else cache.mask(step))
        return self.output_proj(rearrange(out, "B N T H -> B T (N H)")), kv

    def attend_naive(self, q_nope, q_rope, latent, mask) -> torch.Tensor:
        """Up-project the latents (B, 1, S, C + R) to per-head keys and values: (B, N, T, H)."""
        N, C = self.num_heads, self.kv_lora_rank
        c, k_rope = latent.split([C, self.rope_head_dim], dim=-1)     # (B, 1, S, C), (B, 1, S, R)
        k_nope = rearrange(self.k_up_proj(c[:, 0]), "B S (N H) -> B N S H", N=N)
        v = rearrange(self.v_up_proj(c[:, 0]), "B S (N H) -> B N S H", N=N)
        k = torch.cat([k_nope, k_rope.expand(-1, N, -1, -1)], dim=-1)  # (B, N, S, H + R)
        q = torch.cat([q_nope, q_rope], dim=-1)                        # (B, N, T, H + R)
        return scaled_dot_product_attention(q, k, v, mask)             # scale 1/sqrt(H + R)

    def attend_absorbed(self, q_nope, q_rope, latent, mask, cache=None, step=None) -> torch.Tensor:
        """Attend over the latents (B, 1, S, C + R) themselves: W_UK folded into q, W_UV applied after. (B, N, T, H)."""
        attend = None if cache is None else (lambda q, kv, mask, scale: cache.attend(q, kv, step, scale=scale))
        return absorbed_attention(q_nope, q_rope, latent, self.k_up_proj.weight, self.v_up_proj.weight, mask, attend)


def absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, mask: torch.Tensor | None, attend=None) -> torch.Tensor:
    """MLA's decode path over the cached latents, without up-projecting them to per-head keys and values.

    q_nope (B, N, T, H) and q_rope (B, N, T, R) (already rotated) over latent (B, 1, S, C + R): the C-dim
    latents c followed by the shared rotated key k_R. w_uk, w_uv (N H, C): the up-projections (k_up_proj,
    v_up_proj weights). q_n . (W_UK,n c) = (W_UK,n^T q_n) . c, so the query is folded into latent space and
    every head attends over the same single key head [c, k_R] (MQA-like); the output W_UV,n o_n comes after.
    The scores are the naive path's, so the scale stays 1/sqrt(H + R). `attend(q, kv, mask, scale)`:
    the attention over one shared key head (default `grouped_attention`). Returns (B, N, T, H).
    """
    N, C = q_nope.shape[1], w_uk.shape[1]
    w_uk = rearrange(w_uk, "(N H) C -> N H C", N=N)
    w_uv = rearrange(w_uv, "(N H) C -> N H C", N=N)
    q_latent = einsum(q_nope, w_uk, "B N T H, N H C -> B N T C")   # W_UK,n^T q_n
    q = torch.cat([q_latent, q_rope], dim=-1)                      # (B, N, T, C + R)
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5          # the scores are the naive ones
    kv = (latent, latent[..., :C])                                 # one shared key head and value head c
    if attend is None:
        out_latent = grouped_attention(q, *kv, mask, scale=scale)  # (B, N, T, C)
    else:
        out_latent = attend(q, kv, mask, scale)
    return einsum(out_latent, w_uv, "B N T C, N H C -> B N T H")   # W_UV,n o_n
