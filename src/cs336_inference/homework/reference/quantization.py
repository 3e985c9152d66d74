"""The reference solution, quantization: quantize/dequantize, round-to-nearest scales, int4 packing,
the int8 KV cache's encoding, LLM.int8() and GPTQ.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...quantization import awq as _awq
from ...quantization import core as _core
from ...quantization import gptq as _gptq
from ...quantization import kv as _kv
from ...quantization import llm_int8 as _llm_int8
from ...quantization import packing as _packing
from ...quantization import qat as _qat
from ..registry import graded


@graded("quantization")
def quantize(x: torch.Tensor, scale, zero_point, bits: int, symmetric: bool) -> torch.Tensor:
    """q = clamp(round(x / scale) + zero_point, qmin, qmax) as integer codes (round half to even, as
    torch.round).

    x: (..., I) float. scale, zero_point: numbers, or tensors of shape (R, G) for x of R rows (all leading
    dims flattened) whose I columns form G groups of I / G consecutive elements (one scale per group).
    Code range: symmetric -> signed [-2^(bits-1), 2^(bits-1) - 1]; else unsigned [0, 2^bits - 1].
    Returns an integer tensor shaped like x.
    """
    return _core.quantize(x, scale, zero_point, bits, symmetric)


@graded("quantization")
def dequantize(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    """x_hat = (q - zero_point) * scale in float32; scale/zero_point as in `quantize`. Returns q's shape."""
    return _core.dequantize(q, scale, zero_point)


@graded("quantization")
def quantize_tensor(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "tensor",
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of x (..., I) with scales from its own range.

    granularity: "tensor" (one scale), "channel" (one per row: every leading index), "group" (one per
    `group_size` consecutive elements of a row). Per group of values:
      symmetric (absmax): scale = max|x| / (2^(bits-1) - 1), zero_point = 0;
      affine (min/max): lo = min(min x, 0), hi = max(max x, 0) (so 0.0 is exact),
        scale = (hi - lo) / (2^bits - 1), zero_point = clamp(-round(lo / scale), 0, 2^bits - 1);
      a scale of 0 (an all-zero group) becomes 1. Scales are computed in float32.
    Returns (codes (..., I) integer, scale, zero_point): scale/zero_point () for "tensor", (R, G) otherwise
    (R rows, G groups per row; G = 1 for "channel"), as `quantize` takes them.
    """
    qt = _core.quantize_tensor(x, bits, symmetric, granularity, group_size)
    return qt.q, qt.scale, qt.zero_point


@graded("quantization")
def pack_int4(q: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """Two 4-bit codes per byte: q (..., I) integer in [-8, 7] (signed, two's complement nibbles) or
    [0, 15]; I even. Returns uint8 (..., I / 2): byte i holds element 2i in its low nibble and 2i + 1 in
    its high nibble."""
    return _packing.pack_int4(q, signed)


@graded("quantization")
def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 (..., I / 2) -> int8 (..., I)."""
    return _packing.unpack_int4(packed, signed)


@graded("quantization")
def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 KV cache's encoding: one absmax scale per (sequence, head, position) vector of H values.

    x: (B, K, S, H) float keys or values. Returns (codes (B, K, S, H) int8, scale (B, K, S, 1) float16):
    scale = max|x| over H / 127, rounded to float16 (how the cache stores it), at least float16's smallest
    normal number (torch.finfo(torch.float16).tiny: an all-zero vector must not divide by 0);
    codes = round(clamp(x / scale, -127, 127)) with that stored scale, so codes * scale decodes x.
    """
    B, K, S, H = x.shape
    return _kv.QuantizedKVCache(B, K, H, 1, device=x.device, fmt="int8")._encode(x)


@graded("quantization")
def llm_int8_matmul(x: torch.Tensor, weight: torch.Tensor, threshold: float | None = 6.0) -> torch.Tensor:
    """LLM.int8() (Dettmers et al. 2022): y = x W^T with vector-wise int8 and outlier decomposition.

    x: (T, I) float; weight: (O, I) float. Returns (T, O) float32.
    Outlier columns: input features j where some |x[t, j]| > threshold (strictly); threshold None = none.
    They are multiplied in full precision: x[:, outliers] @ W[:, outliers]^T. The other columns go through
    int8: each row of x (restricted to those columns) and each row of W (all I columns) gets an absmax
    scale s = max|row| / 127; codes round(row / s) in [-127, 127]; the int8 x int8 products are summed
    exactly (int32) and rescaled by s_x[t] * s_w[o]. y is the sum of the two parts.
    """
    return _llm_int8.llm_int8_matmul(x, weight, threshold)


@graded("quantization")
def gptq_quantize(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4,
                  group_size: int | None = None) -> torch.Tensor:
    """GPTQ (Frantar et al. 2023): quantize weight (O, I) column by column, pushing each column's rounding
    error onto the columns not yet quantized. Returns W_hat (O, I) float32, the dequantized weights.

    inputs: (n, I) calibration inputs X; H = 2 X^T X / n in float64 (inputs j with H[j, j] = 0 never fire:
    set H[j, j] = 1 and W[:, j] = 0), dampened: H += 0.01 * mean(diag H) * identity.
    For j = 0 .. I - 1 (in order), with Hinv_j = inverse of H restricted to columns j .. I - 1:
      q_j = dequantize(quantize(w_j)) with the current (error-updated) weights;
      w_{j+1:} -= (w_j - q_j) / Hinv_j[0, 0] * Hinv_j[0, 1:]   (the optimal compensation).
    Quantizer: affine min/max (as `quantize_tensor`, affine), one scale and zero point per row of each
    group of `group_size` columns (None: the whole row), computed in float32 from the error-updated
    weights when the group's first column is reached.
    """
    result = _gptq.gptq_quantize(weight, inputs=inputs, bits=bits, group_size=group_size)
    return result.quantized.dequantize(torch.float32)


@graded("quantization")
def awq_search_scales(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4, group_size: int | None = None,
                      grid: int = 20) -> torch.Tensor:
    """AWQ (Lin et al. 2024): per-input-channel scales s (I,) that protect the weights of salient channels.

    weight: (O, I); inputs: (n, I) calibration activations X. Quantize W * s (each column j times s_j) and
    feed X / s, so the layer computes (X / s) Q(W s)^T. Q: affine min/max round to nearest (as
    `quantize_tensor`, affine), one scale and zero point per row (group_size None) or per group of
    group_size columns of a row; dequantized. Search, in float32, alpha = k / grid for k = 0 .. grid - 1:
      a = mean over the n rows of |X| per channel, at least 1e-8;  s = a^alpha / sqrt(max(a^alpha) min(a^alpha));
      error(alpha) = mean over all entries of (X (Q(W s) / s)^T - X W^T)^2.
    Returns the s of the alpha with the smallest error (the first such alpha on ties), (I,) in weight's dtype.
    """
    return _awq.awq_search_scales(weight, inputs, bits, group_size, symmetric=False, grid=grid).scales


@graded("quantization")
def ste_fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int | None = None) -> torch.Tensor:
    """Quantization-aware training's fake quantization with the straight-through estimator (STE).

    w: (O, I) float, usually requiring grad. Forward: Q(w), the affine min/max round-to-nearest
    quantize-then-dequantize of w (as `quantize_tensor`, affine; one scale per row if group_size is None,
    else per group of group_size columns). Backward: the identity (round has zero gradient almost
    everywhere, so the STE pretends Q(w) = w): d loss / d w = d loss / d Q(w). Returns (O, I), connected
    to w's autograd graph.
    """
    return _qat.ste_fake_quantize(w, bits, group_size, symmetric=False)
