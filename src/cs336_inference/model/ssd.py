"""Mamba-2's state-space layer (SSD): a gated recurrence whose decay depends on the input.

Dao & Gu 2024, "Transformers are SSMs": per head, a state S (head_dim x state_dim) evolves as
S_t = a_t S_{t-1} + dt_t x_t B_t^T and the layer reads y_t = S_t C_t + D x_t, with a step size
dt_t = softplus(w . u_t + bias) chosen by each token and a decay a_t = exp(-exp(A) dt_t) in (0, 1):
a token can keep the state (dt near 0) or overwrite it (large dt). B_t, C_t (state_dim each) are
shared by the heads, like one key/value group. Written as gated linear attention (`state_cache`):
key dt_t B_t, query C_t, value x_t, decay a_t; the parallel form is the paper's quadratic "dual"
(attention-like) form, the recurrent form its SSM. As in Mamba-2, a short convolution and SiLU come
before the recurrence, and the output is gated by SiLU(z) and normalised before the projection.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .config import ModelConfig
from .layers import RMSNorm
from .short_conv import ShortConv
from .state_cache import StateCache, parallel_form, valid_positions


class StateSpaceLayer(nn.Module):
    """N heads of Mamba-2's SSD with state_dim-dimensional B, C shared across heads."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        D, N, H, n = config.d_model, config.num_heads, config.head_dim, config.state_dim
        self.num_heads, self.head_dim, self.state_dim = N, H, n
        self.x_proj = nn.Linear(D, N * H, bias=False, device=device, dtype=dtype)
        self.b_proj = nn.Linear(D, n, bias=False, device=device, dtype=dtype)
        self.c_proj = nn.Linear(D, n, bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(D, N * H, bias=False, device=device, dtype=dtype)
        self.dt_proj = nn.Linear(D, N, bias=False, device=device, dtype=dtype)
        self.conv = ShortConv(N * H + 2 * n, config.conv_width, device=device, dtype=dtype)
        # Mamba-2's initialisation: dt log-uniform in [1e-3, 1e-1] (through the inverse softplus), A in [1, 16]
        dt = torch.exp(torch.empty(N).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(device=device, dtype=dtype))
        self.a_log = nn.Parameter(torch.empty(N).uniform_(1, 16).log().to(device=device, dtype=dtype))
        self.d_skip = nn.Parameter(torch.ones(N, device=device, dtype=dtype))
        self.norm = RMSNorm(N * H, eps=config.norm_eps, device=device, dtype=dtype)
        self.output_proj = nn.Linear(N * H, D, bias=False, device=device, dtype=dtype)

    def cache_spec(self) -> tuple:
        return ("ssd", self.num_heads, self.state_dim, self.head_dim, self.conv.weight.shape[0], self.conv.width)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> StateCache:
        """A state of N x state_dim x head_dim per sequence; max_seq_len changes nothing."""
        return StateCache(batch_size, self.num_heads, self.state_dim, self.head_dim, self.conv.weight.shape[0],
                          self.conv.width, normalized=False, kind="ssd", device=device,
                          dtype=dtype or self.x_proj.weight.dtype)

    def forward(self, x: torch.Tensor, rope=None, mask: torch.Tensor | None = None, cache: StateCache | None = None,
                step=None, shared_kv=None):
        """x (B, T, D) -> (out (B, T, D), None); mask and cache as in `LinearAttention.forward`."""
        valid = mask if cache is None else valid_positions(step.start, step.num_new, step.pad, x.device)
        u = torch.cat([self.x_proj(x), self.b_proj(x), self.c_proj(x)], dim=-1)      # (B, T, C)
        dt = F.softplus(self.dt_proj(x) + self.dt_bias)                              # (B, T, N)
        if valid is not None:
            u = torch.where(valid[..., None], u, 0.0)
            dt = torch.where(valid[..., None], dt, 0.0)                             # padding: a = 1, nothing added
        u = F.silu(self.conv(u, None if cache is None else cache.conv_window(u, step)))
        xs, b, c = u.split([self.num_heads * self.head_dim, self.state_dim, self.state_dim], dim=-1)
        v = rearrange(xs, "B T (N H) -> B N T H", N=self.num_heads)                  # values: x_t
        dt = rearrange(dt, "B T N -> B N T").float()
        log_decay = -torch.exp(self.a_log.float())[:, None] * dt                      # log a_t (B, N, T)
        k = dt[..., None] * b[:, None].float()                                       # dt_t B_t (B, N, T, n)
        q = c[:, None].float().expand_as(k)                                          # C_t
        if cache is None:
            y = parallel_form(q, k, v.float(), log_decay).to(x.dtype)
        else:
            y = cache.attend(q, cache.update(k, v, step, log_decay=log_decay), step).to(x.dtype)
        y = y + self.d_skip[:, None, None] * v                                        # D x_t
        y = rearrange(y, "B N T H -> B T (N H)")
        return self.output_proj(self.norm(y * F.silu(self.gate_proj(x)))), None

    def extra_repr(self) -> str:
        return f"state_dim={self.state_dim}"
