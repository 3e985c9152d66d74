"""The building blocks of the CS336 assignment-1 Transformer: RMSNorm, SwiGLU, rotary embeddings.

RMSNorm: Zhang & Sennrich 2019. SwiGLU: Shazeer 2020. RoPE: Su et al. 2021 (RoFormer), applied to
*adjacent* pairs (x[2k], x[2k+1]) exactly as assignment 1 does, not the "rotate-half" layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """y = x / rms(x) * g, computed in fp32 (as assignment 1 does) and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(in_dtype)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (SiLU(W1 x) * W3 x); w2 is the down projection (assignment-1 names)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_angles(head_dim: int, max_seq_len: int, theta: float = 10000.0,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_seq_len, head_dim // 2): angle(i, k) = i * theta^(-2k/H)."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of `x` (..., T, H) by the angles in cos/sin (..., T, H/2).

    cos/sin broadcast against x's leading dims, so per-sequence positions (B, 1, T, H/2) work too.
    """
    x_pairs = x.unflatten(-1, (-1, 2))               # (..., T, H/2, 2)
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]  # (..., T, H/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)                        # (..., T, H)


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables (non-persistent buffers: they are not in the state dict)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0, device=None):
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        cos, sin = rope_angles(head_dim, max_seq_len, theta, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) or (B, T) -> cos, sin of shape (T, H/2) or (B, 1, T, H/2), ready to broadcast."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.angles(positions)
        return apply_rope(x, cos, sin)
