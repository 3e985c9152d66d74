"""AWQ: activation-aware weight quantization by per-input-channel scaling.

Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration".
A few input channels carry much larger activations than the rest; the weights they multiply
matter most. Instead of keeping those weights in fp16 (mixed precision, awkward kernels), scale
input channel i of W up by s_i before quantizing and divide the activation by s_i:
    y = (x / s) @ Q(W * s)^T
which shrinks the *relative* rounding error on salient channels. s = mean|x_i|^alpha, with the
exponent alpha found by a grid search over [0, 1) that minimises the layer's output error on
calibration inputs (alpha = 0 is plain round-to-nearest). The 1/s is folded into the preceding
operation (an RMSNorm weight, or the rows of the linear that produces x) so it costs nothing at run
time, or kept explicit in the quantized layer when there is nothing to fold into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _checks
from .core import check_bits, check_finite, fake_quantize


def _qdq_weight(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool) -> torch.Tensor:
    if group_size is None:
        return fake_quantize(w, bits, symmetric, "channel")
    return fake_quantize(w, bits, symmetric, "group", group_size)


@dataclass
class AWQResult:
    scales: torch.Tensor                  # s (I,): quantize W * s, feed x / s
    alpha: float                          # the chosen exponent
    errors: dict[float, float] = field(default_factory=dict)   # alpha -> output error on calibration inputs


@torch.no_grad()
def awq_search_scales(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4, group_size: int | None = 128,
                      symmetric: bool = False, grid: int = 20, max_rows: int = 4096) -> AWQResult:
    """Grid-search s = mean|x|^alpha for weight (O, I) (or several weights stacked along O that share
    the same input) over calibration inputs (..., I); minimise ||x W^T - (x/s) Q(W s)^T||^2.
    """
    check_bits(bits)
    check_finite("weight", weight)
    if inputs.numel() == 0:
        raise ValueError("calibration inputs are empty; AWQ needs activations to find salient channels")
    check_finite("calibration inputs", inputs)
    _checks.positive_int("grid", grid)
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"inputs have {x.shape[1]} features but the weight has {weight.shape[1]} input features")
    if x.shape[0] > max_rows:  # an evenly spaced subset keeps the search cheap
        x = x[torch.linspace(0, x.shape[0] - 1, max_rows).long()]
    w = weight.float()
    y = x @ w.t()
    act = x.abs().mean(0).clamp(min=1e-8)                       # (I,) per-channel activation magnitude
    best, errors = None, {}
    for k in range(grid):
        alpha = k / grid
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()                      # centre the scales around 1
        w_hat = _qdq_weight(w * s, bits, group_size, symmetric) / s
        err = float((x @ w_hat.t() - y).pow(2).mean())
        errors[alpha] = err
        if best is None or err < best[0]:
            best = (err, alpha, s)
    return AWQResult(scales=best[2].to(weight.dtype), alpha=best[1], errors=errors)


def awq_quantize(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4, group_size: int | None = 128,
                 symmetric: bool = False, grid: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_hat, s): the effective weight W_hat = Q(W s) / s and the scales, for one layer."""
    res = awq_search_scales(weight, inputs, bits, group_size, symmetric, grid)
    return _qdq_weight(weight.float() * res.scales, bits, group_size, symmetric) / res.scales, res.scales
