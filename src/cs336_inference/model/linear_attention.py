"""Linear attention with BASED's Taylor feature map: a fixed-size state instead of a KV cache.

Softmax attention weighs key j by exp(q . k_j), so every key must be kept. Replacing the exponential
by a dot product of feature maps, phi(q) . phi(k_j), lets the sum over keys be regrouped:
sum_j phi(q)^T phi(k_j) v_j^T = phi(q)^T (sum_j phi(k_j) v_j^T), one F x H matrix per head that a new
token only adds to (Katharopoulos et al. 2020, "Transformers are RNNs"). BASED (Arora et al. 2024)
picks phi so that phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d'), the second-order Taylor
expansion of exp(s), on q and k projected to d' = `feature_dim` dims per head: F = 1 + d' + d'^2.
The state's size, N F H, is the knob between recall and memory (Zoology; the MQAR experiment).
BASED pairs these layers with a few small sliding-window attention layers (`ModelConfig.global_every`
with `sliding_window`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from .config import ModelConfig
from .short_conv import ShortConv
from .state_cache import StateCache, parallel_form, valid_positions


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """x (..., d') -> (..., 1 + d' + d'^2) with phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / sqrt(d')."""
    d = x.shape[-1]
    x = x / d ** 0.25                                              # s = q . k / sqrt(d') after both are scaled
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2)   # (x x^T) / sqrt(2), flattened
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)


class LinearAttention(nn.Module):
    """N heads of normalised linear attention: q, k projected to feature_dim dims per head, values
    to head_dim; a short convolution over [q, k, v] first; y_t = phi(q_t)^T S_t / phi(q_t)^T z_t."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        D, N, H, d = config.d_model, config.num_heads, config.head_dim, config.feature_dim
        self.num_heads, self.head_dim, self.feature_dim = N, H, d
        self.q_proj = nn.Linear(D, N * d, bias=False, device=device, dtype=dtype)
        self.k_proj = nn.Linear(D, N * d, bias=False, device=device, dtype=dtype)
        self.v_proj = nn.Linear(D, N * H, bias=False, device=device, dtype=dtype)
        self.conv = ShortConv(2 * N * d + N * H, config.conv_width, device=device, dtype=dtype)
        self.output_proj = nn.Linear(N * H, D, bias=False, device=device, dtype=dtype)

    @property
    def state_features(self) -> int:
        """F = 1 + d' + d'^2: the key features one head's state has a row for."""
        return 1 + self.feature_dim + self.feature_dim ** 2

    def cache_spec(self) -> tuple:
        return ("linear", self.num_heads, self.state_features, self.head_dim, self.conv.weight.shape[0],
                self.conv.width)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> StateCache:
        """A state of N x F x H (+ the normaliser z, N x F) per sequence; max_seq_len changes nothing."""
        return StateCache(batch_size, self.num_heads, self.state_features, self.head_dim, self.conv.weight.shape[0],
                          self.conv.width, normalized=True, kind="linear", device=device,
                          dtype=dtype or self.q_proj.weight.dtype)

    def forward(self, x: torch.Tensor, rope=None, mask: torch.Tensor | None = None, cache: StateCache | None = None,
                step=None, shared_kv=None):
        """x (B, T, D) -> (out (B, T, D), None). mask: without a cache, (B, T) True for real tokens (None:
        no padding); with one, the step's padding says it. rope is unused (positions come from the order)."""
        valid = mask if cache is None else valid_positions(step.start, step.num_new, step.pad, x.device)
        u = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)      # (B, T, C)
        if valid is not None:
            u = torch.where(valid[..., None], u, 0.0)                               # padding never enters the state
        u = self.conv(u, None if cache is None else cache.conv_window(u, step))
        q, k, v = u.split([self.num_heads * self.feature_dim] * 2 + [self.num_heads * self.head_dim], dim=-1)
        q = taylor_feature_map(rearrange(q, "B T (N d) -> B N T d", N=self.num_heads))   # (B, N, T, F)
        k = taylor_feature_map(rearrange(k, "B T (N d) -> B N T d", N=self.num_heads))
        v = rearrange(v, "B T (N H) -> B N T H", N=self.num_heads)
        if valid is not None:
            k = torch.where(valid[:, None, :, None], k, 0.0)                          # phi(0) = [1, 0, 0] is not 0
        if cache is None:
            y = parallel_form(q.float(), k.float(), v.float(), None, normalize=True).to(x.dtype)
        else:
            y = cache.attend(q, cache.update(k, v, step), step)
        return self.output_proj(rearrange(y, "B N T H -> B T (N H)")), None

    def extra_repr(self) -> str:
        return f"feature_dim={self.feature_dim}, state_features={self.state_features}"
