"""The assignment-1 handout's ablations, each picked once when a block is built (never per token).

- `norm="none"`: no RMSNorm (the norms become `nn.Identity`, so no state-dict keys).
- `ffn="silu"`: FFN(x) = W2 SiLU(W1 x), no gate (the handout's SiLU ablation; Shazeer 2020 compares both).
- `positional="none"`: NoPE (Kazemnejad et al. 2023): no rotation; the causal mask alone orders tokens.
- `qk_norm`: RMSNorm over each head of q and k before RoPE (Dehghani et al. 2023; Wortsman et al. 2023;
  OLMo 2 and Qwen3 use it), with a learned gain of H entries (`"gain"`) or without (`"no_gain"`).
- `norm_position="post"`: the block is `PostNormBlock` (in `transformer`, next to the pre-norm block).

The attention modules call `self.rotate_q(q, cos, sin)` and `self.rotate_k(k, cos, sin)`; for the base
model both are `apply_rope` itself (no extra call per token), for NoPE `no_rope`, and with QK-norm the
norm's `rotate` (normalise, then the positional function).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .layers import RMSNorm, SwiGLU, apply_rope


def no_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NoPE: q and k are used as projected (the signature of `apply_rope`, so attention need not branch)."""
    return x


def build_norm(config: ModelConfig, name: str, device=None, dtype=None) -> nn.Module:
    """The block norm `name` ('ln1', 'ln2' or 'ln_final'): an RMSNorm with its eps, or an Identity."""
    built = config.has_final_norm if name == "ln_final" else config.norm == "rmsnorm"
    return RMSNorm(config.d_model, config.eps(name), device=device, dtype=dtype) if built else nn.Identity()


class SiLUFeedForward(nn.Module):
    """FFN(x) = W2 SiLU(W1 x): the handout's SiLU ablation (no w3; it uses d_ff = 4 d_model to match
    SwiGLU's parameter count)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        return self.w2(F.silu(self.w1(x)))


def build_ffn(config: ModelConfig, device=None, dtype=None) -> nn.Module:
    cls = SwiGLU if config.ffn == "swiglu" else SiLUFeedForward
    return cls(config.d_model, config.d_ff, device=device, dtype=dtype)


class QKNorm(nn.Module):
    """RMSNorm over the last dim (one head's H entries) of q or k with a learned gain, in fp32."""

    def __init__(self, head_dim: int, eps: float, rotate, device=None, dtype=None):
        super().__init__()
        self.eps, self.positional = eps, rotate
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, T, H) -> (B, N, T, H)
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normalise, then apply the positional function (RoPE, or none): what attention calls."""
        return self.positional(self(x), cos, sin)


class WeightlessQKNorm(QKNorm):
    """QK-norm without a gain (nothing in the state dict)."""

    def __init__(self, head_dim: int, eps: float, rotate, device=None, dtype=None):
        nn.Module.__init__(self)
        self.eps, self.positional = eps, rotate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def attach_positional(attn: nn.Module, config: ModelConfig, device=None, dtype=None) -> None:
    """Give a grouped-query attention module its `rotate_q` / `rotate_k` (and q_norm / k_norm modules)."""
    rotate = apply_rope if config.positional == "rope" else no_rope
    attn.rotate_q = attn.rotate_k = rotate
    if config.qk_norm != "none":
        cls = QKNorm if config.qk_norm == "gain" else WeightlessQKNorm
        attn.q_norm = cls(config.head_dim, config.eps("qk_norm"), rotate, device=device, dtype=dtype)
        attn.k_norm = cls(config.head_dim, config.eps("qk_norm"), rotate, device=device, dtype=dtype)
        attn.rotate_q, attn.rotate_k = attn.q_norm.rotate, attn.k_norm.rotate


__all__ = ["QKNorm", "WeightlessQKNorm", "SiLUFeedForward", "attach_positional", "build_ffn", "build_norm", "no_rope"]
