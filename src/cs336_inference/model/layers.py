"""The building blocks of the CS336 assignment-1 Transformer: RMSNorm, SwiGLU, rotary embeddings.

RMSNorm: Zhang & Sennrich 2019. SwiGLU: Shazeer 2020. RoPE: Su et al. 2021 (RoFormer), applied to
*adjacent* pairs (x[2k], x[2k+1]) exactly as assignment 1 does, not the "rotate-half" layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# Rows at or below which the CPU few-row path of `Linear` beats one MKL gemm call (measured here on
# the weights of a 330 MB model, 2 idle threads: 1 row 18 -> 10 ms, 8 rows 29 -> 18 ms, 32 rows 55 -> 44 ms).
# On an oversubscribed CPU (other processes busy) any 2-thread kernel stalls; use 1 thread there.
_SPLIT_MAX_ROWS = 64
_SPLIT_ENABLED = True


@contextlib.contextmanager
def few_row_split(enabled: bool):
    """Turn the CPU few-row path of `Linear` on or off (benchmarks compare both)."""
    global _SPLIT_ENABLED
    previous, _SPLIT_ENABLED = _SPLIT_ENABLED, bool(enabled)
    try:
        yield
    finally:
        _SPLIT_ENABLED = previous


class Linear(nn.Linear):
    """A bias-free linear layer, y = x W^T with W of shape (d_out, d_in) as in assignment 1.

    Decode multiplies a handful of rows by every weight matrix: memory-bound matrix-vector work.
    On the CPU, MKL runs that on one thread, leaving half the memory bandwidth of a 2-core machine
    unused. For few-row inputs in inference we therefore split W's output rows into one block per
    thread (a free view) and let `bmm` stream the blocks in parallel. Same numbers, ~2x faster decode.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        w = self.weight
        P = torch.get_num_threads()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (_SPLIT_ENABLED and P > 1 and 0 < rows <= _SPLIT_MAX_ROWS and x.device.type == "cpu"
                and not torch.is_grad_enabled() and w.shape[0] % P == 0 and w.is_contiguous()
                and x.dtype == w.dtype):
            blocks = w.view(P, w.shape[0] // P, w.shape[1])                       # (P, d_out/P, d_in), free
            x2 = x.reshape(1, rows, x.shape[-1]).expand(P, -1, -1)                # (P, M, d_in)
            y = torch.bmm(x2, blocks.transpose(1, 2))                              # (P, M, d_out/P)
            return rearrange(y, "P M O -> M (P O)").reshape(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)


class RMSNorm(nn.Module):
    """y = x / rms(x) * g, computed in fp32 (as assignment 1 does) and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        in_dtype = x.dtype
        if in_dtype != torch.float32:  # upcast only when needed: each op costs per-step overhead in decode
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (SiLU(W1 x) * W3 x); w2 is the down projection (assignment-1 names)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

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
    The pair (x[2k], x[2k+1]) is the complex number x[2k] + i x[2k+1]; rotating it by angle a is
    multiplying by cos a + i sin a: one complex multiply instead of a dozen real ops per call.
    """
    rotation = torch.complex(cos.float(), sin.float())                                  # (..., T, H/2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())         # (..., T, H/2)
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)                 # (..., T, H)


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
