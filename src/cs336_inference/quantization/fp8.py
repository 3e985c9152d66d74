"""8-bit floating point: e4m3 (more mantissa, for weights and activations) and e5m2 (more range, for
gradients), with one scale so the tensor's absmax lands on the format's largest finite value.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning". Ranges come from `torch.finfo`:
float8_e4m3fn reaches +-448 (no infinities), float8_e4m3fnuz (the AMD/Graphcore variant) +-240,
float8_e5m2 +-57344. Unlike int8, fp8's grid is non-uniform: relative error is roughly constant
(eps = 2^-3 for e4m3) across magnitudes, so a few large values do not crush the small ones.
"""

from __future__ import annotations

import torch

from .core import check_finite

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e4m3fnuz": torch.float8_e4m3fnuz}


def fp8_dtype(fmt) -> torch.dtype:
    if isinstance(fmt, torch.dtype) and fmt in FP8_DTYPES.values():
        return fmt
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_DTYPES)} (or a torch float8 dtype), got {fmt!r}")
    return FP8_DTYPES[fmt]


def fp8_range(fmt="e4m3") -> tuple[float, float]:
    """(min, max) finite values of the format, straight from torch.finfo."""
    info = torch.finfo(fp8_dtype(fmt))
    return float(info.min), float(info.max)


def quantize_fp8(x: torch.Tensor, fmt="e4m3", per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., I) -> (x8 in the fp8 dtype, scale) with x ~ x8 * scale; scale () or (..., 1) per row."""
    check_finite("x", x)
    dtype = fp8_dtype(fmt)
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(-1, keepdim=True) if per_channel else x.abs().amax()
    scale = (amax.float() / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    x8 = (x.float() / scale).clamp(-fmax, fmax).to(dtype)     # clamp: the cast does not saturate
    return x8, scale


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


def fp8_round_trip(x: torch.Tensor, fmt="e4m3", per_channel: bool = False) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x, fmt, per_channel), dtype=x.dtype)
