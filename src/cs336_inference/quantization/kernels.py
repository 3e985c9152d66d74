"""Weight-only quantized matmuls that read the packed codes: torch's int4pack and int8pack kernels.

The readable way to run a quantized linear is to dequantize W_hat = (q - z) * s and call an ordinary
matmul: correct, but it writes the full-precision matrix to memory and reads it back every step, so
a memory-bound decode gets *slower*. Fast kernels instead read the small codes and dequantize inside
the matmul (in registers), so fewer bytes are also fewer milliseconds. torch ships such kernels for
CPU and CUDA (the ones gpt-fast and torchao call):

- int4: `aten._weight_int4pack_mm_for_cpu` / `aten._weight_int4pack_mm` (CUDA) on a weight repacked
  by `aten._convert_weight_to_int4pack[_for_cpu]`. Their grid is unsigned u in [0, 15] with one
  (scale, zero) pair per group of 32/64/128/256 inputs, and the *float* zero sits at the middle code:
      w = (u - 8) * scale + zero.
  Our affine codes mean w = (q - z) * s with an integer zero point z, i.e. u = q and
  zero = (8 - z) * s; our symmetric codes q in [-8, 7] mean u = q + 8 and zero = 0.
- int8: `torch._weight_int8pack_mm(x, q, scale)` = x @ (q * scale)^T with int8 codes and one scale per
  output row. Affine per-row codes fit too: with q' = q - 128 and z' = z - 128,
  x @ ((q - z) * s)^T = x @ (q' * s)^T - (sum_k x_k) * (z' * s).

Activations run in bf16 there: with fp32 activations these CPU kernels take fallback paths that are
several times slower than an fp32 matmul. fp32 activations stay available (slow, but exact up to summation order)
so tests can check the packed layout against the reference without bf16 rounding in the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNELS = ("auto", "reference", "packed")
INT4_GROUP_SIZES = (256, 128, 64, 32)   # what the int4pack kernels accept (largest first)


def check_kernel(kernel) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """bf16: the activation dtype the packed kernels are fast with, on CPU and CUDA alike."""
    return torch.bfloat16


def int4_kernel_group(group_size: int) -> int | None:
    """The kernel group length for our group length: the same when allowed, else the largest allowed
    divisor (a per-channel scale repeats over several kernel groups), else None (unsupported)."""
    return next((g for g in INT4_GROUP_SIZES if group_size % g == 0), None)


def packed_unsupported_reason(bits: int, symmetric: bool, group_size: int, out_features: int,
                              in_features: int, device: torch.device) -> str | None:
    """Why the packed kernels cannot run this layer on `device` (None when they can)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return f"no packed kernels on {device.type}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "torch's packed CUDA kernels need compute capability 8.0 (Ampere) or newer"
    if bits == 8:
        if group_size != in_features:
            return f"int8 packed kernel needs one scale per output row (per channel), got group_size {group_size}"
        return None
    if bits == 4:
        if int4_kernel_group(group_size) is None:
            return f"int4 packed kernels need group_size a multiple of 32, got {group_size}"
        if device.type == "cpu" and out_features % 16:
            return f"int4 CPU kernel needs out_features divisible by 16, got {out_features}"
        if device.type == "cuda" and (out_features % 8 or in_features % 32):
            return (f"int4 CUDA kernel needs out_features % 8 == 0 and in_features % 32 == 0, "
                    f"got {out_features}, {in_features}")
        return None
    return f"no packed kernel for {bits}-bit codes (only 4 and 8)"


@dataclass
class PackedWeight:
    """A quantized weight laid out for one kernel on one device (derived data, never saved)."""

    bits: int
    weight: torch.Tensor              # int4: kernel layout; int8: (O, I) int8 codes
    scales: torch.Tensor              # int4: (I / g, O, 2) scale and zero; int8: (O,) scales
    group_size: int                   # kernel group length (int4)
    zero_term: torch.Tensor | None    # int8 affine: (O,) z' * s, subtracted times sum(x)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call."""
        extra = 0 if self.zero_term is None else self.zero_term.nbytes
        return self.weight.nbytes + self.scales.nbytes + extra


def _inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 tile depth (2, 4 or 8) that divides the input dimension in tiles of 16."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def pack_weight(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
                group_size: int, device: torch.device, dtype: torch.dtype) -> PackedWeight:
    """Codes (O, I) int, scale (O, G), zero_point (O, G) or None (symmetric) -> the kernel's layout.

    The caller checks `packed_unsupported_reason` first.
    """
    device = torch.device(device)
    O, I = codes.shape
    codes, scale = codes.to(device), scale.to(device).float()
    zero = None if zero_point is None else zero_point.to(device).float()
    if bits == 8:
        if zero is None:
            return PackedWeight(8, codes.to(torch.int8), scale[:, 0].to(dtype), I, None)
        # affine: shift both codes and zero points by 128 so the codes fit in int8
        zero_term = (zero[:, 0] - 128) * scale[:, 0]
        return PackedWeight(8, (codes - 128).to(torch.int8), scale[:, 0].to(dtype), I, zero_term.to(dtype))
    g = int4_kernel_group(group_size)
    repeat = group_size // g                       # per-channel (or g512...) scales repeat per kernel group
    scale = scale.repeat_interleave(repeat, dim=1)                            # (O, I / g)
    if zero is None:
        unsigned, offset = codes + 8, torch.zeros_like(scale)
    else:
        unsigned, offset = codes, (8 - zero.repeat_interleave(repeat, dim=1)) * scale
    scales = torch.stack([scale, offset], dim=-1).transpose(0, 1).contiguous().to(dtype)   # (I / g, O, 2)
    unsigned = unsigned.to(torch.int32).contiguous()
    if device.type == "cpu":
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, _inner_k_tiles(I))
    else:  # the CUDA converter takes two codes per byte, the even element in the high nibble
        pairs = (unsigned[:, 0::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        weight = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(I))
    return PackedWeight(4, weight, scales, g, None)


def packed_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x (..., I) in the packed weight's dtype -> x @ W_hat^T (..., O), reading only the packed bytes."""
    lead, I = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, I).contiguous()                                         # (M, I)
    if packed.bits == 8:
        y = torch._weight_int8pack_mm(x2, packed.weight, packed.scales)
        if packed.zero_term is not None:
            y = y - x2.sum(-1, keepdim=True) * packed.zero_term
    elif x2.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed.weight, packed.group_size, packed.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2, packed.weight, packed.group_size, packed.scales)
    return y.reshape(*lead, y.shape[-1])
