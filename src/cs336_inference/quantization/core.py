"""Integer quantization of one number, a tensor, or a weight matrix: scale, zero point, round, clamp.

    q = clamp(round(x / scale) + zero_point, qmin, qmax)        x_hat = (q - zero_point) * scale

Symmetric (absmax): zero_point = 0, scale = max|x| / qmax, signed codes [-2^(b-1), 2^(b-1) - 1].
Affine (min/max): scale = (max - min) / (2^b - 1), zero_point = round(-min / scale), unsigned codes
[0, 2^b - 1]; the range is widened to contain 0 so that 0.0 is represented exactly (padding, ReLU
zeros and pruned weights stay exactly zero).

Granularity: one scale per tensor, per output channel (row of a (out, in) weight), or per group of
`group_size` consecutive input-dim elements of each row (Dettmers & Zettlemoyer 2023, "The case for
4-bit precision"; GPTQ and AWQ use groups of 128). Smaller groups track local ranges better at the
price of one scale (and zero point) per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from .. import _checks

SUPPORTED_BITS = (2, 3, 4, 8)
GRANULARITIES = ("tensor", "channel", "group")


def check_bits(bits) -> int:
    _checks.integer("bits", bits, allowed=f"an int, one of {SUPPORTED_BITS}")
    return _checks.one_of("bits", bits, SUPPORTED_BITS)


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer code range: signed [-2^(b-1), 2^(b-1)-1] when symmetric, unsigned [0, 2^b-1] when affine."""
    check_bits(bits)
    _checks.boolean("symmetric", symmetric)   # a truthy string must not pick the signed range
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def check_finite(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); quantization needs finite values")


def resolve_group_size(in_features: int, granularity: str, group_size: int | None) -> int | None:
    """The group length along the last dim: None for per-tensor, in_features for per-channel."""
    _checks.one_of("granularity", granularity, GRANULARITIES)
    if granularity == "tensor":
        return None
    if granularity == "channel":
        return in_features
    _checks.integer("group_size", group_size, 1, allowed="a positive int for granularity='group'")
    if in_features % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide the input dimension {in_features}; "
                         f"choose a divisor of {in_features}")
    return group_size


def _grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """x (..., I) -> (R, G, g): rows, groups per row, group length (one group for per-tensor)."""
    if group_size is None:
        return x.reshape(1, 1, -1)
    return rearrange(x.reshape(-1, x.shape[-1]), "R (G g) -> R G g", g=group_size)


def compute_scale_zero_point(x: torch.Tensor, bits: int = 8, symmetric: bool = True,
                             granularity: str = "tensor", group_size: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for x (..., I): shapes () per tensor, (R, G) otherwise (R = rows, G = I / g).

    Computed in fp32 whatever x's dtype; a constant-zero group gets scale 1 (any scale is exact).
    """
    check_finite("x", x)
    qmin, qmax = qrange(bits, symmetric)
    g = resolve_group_size(x.shape[-1], granularity, group_size)
    xg = _grouped(x.float(), g)                                    # (R, G, g)
    if symmetric:
        scale = xg.abs().amax(-1) / qmax
        zero = torch.zeros_like(scale)
    else:
        lo = xg.amin(-1).clamp(max=0.0)                            # include 0: it must be exact
        hi = xg.amax(-1).clamp(min=0.0)
        scale = (hi - lo) / (qmax - qmin)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if g is None:
        return scale.reshape(()), zero.reshape(())
    return scale.reshape(xg.shape[:2]), zero.reshape(xg.shape[:2])


def _expand(param: torch.Tensor, x_shape: torch.Size) -> torch.Tensor:
    """Broadcast a () or (R, G) scale/zero point to x's shape (..., I) by repeating over each group."""
    param = torch.as_tensor(param)
    if param.dim() == 0:
        return param
    rows = x_shape[:-1].numel() if len(x_shape) > 1 else 1
    if param.shape[0] != rows or x_shape[-1] % param.shape[1] != 0:
        raise ValueError(f"scale/zero_point of shape {tuple(param.shape)} do not fit a tensor of shape "
                         f"{tuple(x_shape)} (need (rows={rows}, groups dividing {x_shape[-1]}))")
    g = x_shape[-1] // param.shape[1]
    return param.repeat_interleave(g, dim=1).reshape(x_shape)


def quantize(x, scale, zero_point=0, bits: int = 8, symmetric: bool | None = None) -> torch.Tensor:
    """q = clamp(round(x / scale) + zero_point, qmin, qmax) as int32 codes.

    `scale`/`zero_point` are numbers or the () / (R, G) tensors of `compute_scale_zero_point`.
    `symmetric` picks the code range (default: signed when zero_point is 0, else unsigned).
    """
    x = torch.as_tensor(x, dtype=torch.float32) if not isinstance(x, torch.Tensor) else x
    if x.is_floating_point() and not torch.isfinite(x).all():   # round(NaN) cast to int32 would be -2^31
        raise ValueError(f"x contains {int((~torch.isfinite(x)).sum())} NaN/Inf value(s); only finite values "
                         f"have a code")
    if symmetric is None:
        symmetric = bool(torch.all(torch.as_tensor(zero_point) == 0))
    qmin, qmax = qrange(bits, symmetric)
    scale = _expand(torch.as_tensor(scale, dtype=torch.float32, device=x.device), x.shape)
    zero_point = _expand(torch.as_tensor(zero_point, dtype=torch.float32, device=x.device), x.shape)
    if not torch.isfinite(scale).all() or torch.any(scale <= 0):
        raise ValueError(f"scale must be finite and positive, got values in [{scale.min().item()}, "
                         f"{scale.max().item()}] (NaN/Inf or <= 0)")
    q = torch.round(x.float() / scale) + zero_point
    return q.clamp(qmin, qmax).to(torch.int32)


def dequantize(q: torch.Tensor, scale, zero_point=0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = (q - zero_point) * scale, in `dtype`."""
    q = torch.as_tensor(q)
    scale = _expand(torch.as_tensor(scale, dtype=torch.float32, device=q.device), q.shape)
    zero_point = _expand(torch.as_tensor(zero_point, dtype=torch.float32, device=q.device), q.shape)
    return ((q.float() - zero_point) * scale).to(dtype)


@dataclass
class QuantizedTensor:
    """Integer codes plus what is needed to map them back: x_hat = (q - zero_point) * scale."""

    q: torch.Tensor            # int32 codes, same shape as the original tensor
    scale: torch.Tensor        # () per tensor, (R, G) per channel (G = 1) / per group
    zero_point: torch.Tensor   # same shape as scale (all 0 when symmetric)
    bits: int
    symmetric: bool
    group_size: int | None     # None: per tensor; I: per channel; g: per group

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, dtype)


def quantize_tensor(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "tensor",
                    group_size: int | None = None) -> QuantizedTensor:
    """Round-to-nearest (RTN) quantization of x (..., I) with scales from its own range."""
    scale, zero = compute_scale_zero_point(x, bits, symmetric, granularity, group_size)
    q = quantize(x, scale, zero, bits, symmetric)
    return QuantizedTensor(q, scale, zero, bits, symmetric, resolve_group_size(x.shape[-1], granularity, group_size))


def fake_quantize(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "tensor",
                  group_size: int | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the value a quantized model actually computes with."""
    return quantize_tensor(x, bits, symmetric, granularity, group_size).dequantize(x.dtype)
