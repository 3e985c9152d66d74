"""The reference solution, layers: RMSNorm and the SwiGLU feed-forward of the assignment-1 Transformer.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...model import layers as _layers
from ..registry import graded


@graded("layers")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), as assignment 1 defines it.

    x: (..., D); weight: (D,) the gain g. Returns (..., D) in x's dtype:
    y = x / sqrt(mean over D of x^2 + eps) * g, computed in float32 (eps inside the square root).
    """
    norm = _layers.RMSNorm(weight.shape[0], eps, device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


@graded("layers")
def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The SwiGLU feed-forward (Shazeer 2020), assignment 1's names and layout (y = x W^T).

    x: (..., D); w1, w3: (F, D); w2: (F -> D) of shape (D, F). Returns (..., D):
    W2 (SiLU(W1 x) * W3 x), with SiLU(z) = z * sigmoid(z) applied to the W1 (gate) branch.
    """
    ffn = _layers.SwiGLU(w1.shape[1], w1.shape[0], device=x.device, dtype=w1.dtype)
    ffn.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3})
    with torch.no_grad():
        return ffn(x)
