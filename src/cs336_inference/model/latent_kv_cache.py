"""Multi-head latent attention's cache: one latent per token, read as a single shared key head.

DeepSeek-V2 (DeepSeek-AI 2024). Implements the `kv_cache.LayerCache` interface with the same
`update(k, v, step)` shape as every other cache.
"""

from __future__ import annotations

import torch

from .. import _checks
from .kv_cache import CacheStep, LayerCache, _check_kv, _with_new, check_kv_write


class LatentKVCache(LayerCache):
    """Multi-head latent attention's cache (DeepSeek-V2): per token, the latent c (C dims) and the
    decoupled RoPE key (R dims, shared by all heads), stored side by side as (B, 1, S_max, C + R).

    To attention it is one shared key head of C + R dims whose values are its first C dims (MQA over
    latents), so `update(k, v, step)` has the shape of every other cache: k (B, 1, T, C + R) and
    v = k[..., :C] (a view, not stored twice).
    """

    def __init__(self, batch_size: int, kv_lora_rank: int, rope_head_dim: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        _checks.positive_ints(batch_size=batch_size, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
                        max_seq_len=max_seq_len)
        self.kv_lora_rank, self.rope_head_dim, self.max_seq_len = kv_lora_rank, rope_head_dim, max_seq_len
        self.latent = torch.zeros(batch_size, 1, max_seq_len, kv_lora_rank + rope_head_dim, device=device, dtype=dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k = [c, k_rope] (B, 1, T, C + R) at positions start..; return (B, 1, end, C + R) and its
        first C dims as the values (B, 1, end, C)."""
        B, _, _, E = self.latent.shape
        C = self.kv_lora_rank
        _check_kv("k", k, B, 1, E)
        _check_kv("v", v, B, 1, C)
        if v.data_ptr() != k.data_ptr() or v.stride() != k.stride():
            raise ValueError("LatentKVCache stores the latent once: v must be k[..., :kv_lora_rank] (a view of k)")
        end = check_kv_write(k, k, step, self.latent, self.max_seq_len)
        self.latent[:, :, step.start:end] = k.detach()
        if k.requires_grad:
            keys = _with_new(self.latent, k, step)
            return keys, keys[..., :C]
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.latent[:, :, :length]
        return keys, keys[..., :self.kv_lora_rank]

    @property
    def spec(self) -> tuple:
        return (1, self.latent.shape[-1], None)

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes

    @property
    def bytes_per_token(self) -> int:
        """(C + R) * element size: the latent plus the shared RoPE key, whatever the head count."""
        return self.latent.shape[-1] * self.latent.element_size()
