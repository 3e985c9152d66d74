"""Linear layers that *store* quantized weights, so a quantized model's bytes are its true size.

- `QuantizedLinear`: b-bit integer codes (8 bits as int8/uint8, 4 bits packed two per byte, 3 and
  2 bits packed densely), one scale (fp16 by default, as GPTQ/AWQ checkpoints store them) and, when
  affine, one uint8 zero point per group; optional explicit AWQ input scales.
- `Fp8Linear`: float8 weights with one fp32 scale per output channel.
- `LLMInt8Linear`: int8 weights with per-row scales, run through LLM.int8()'s decomposed matmul.

`QuantizedLinear` has two kernels. "reference" dequantizes the whole weight and runs an ordinary
matmul: the readable definition, but an extra pass that materialises the full-precision matrix, so
it costs time instead of saving it. "packed" (int4 and per-channel int8) hands the codes to torch's
int4pack / int8pack kernels, which read the small codes and dequantize inside the matmul, with bf16
activations: fewer bytes, faster memory-bound decode (see `kernels`). "auto" (the default) takes
"packed" where the layer's layout fits a kernel on the input's device and "reference" elsewhere.
`Fp8Linear` and `LLMInt8Linear` dequantize on the fly (reference kernels only).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .. import _checks
from .core import QuantizedTensor, check_bits, quantize_tensor
from .kernels import (PackedWeight, check_kernel, default_compute_dtype, pack_weight, packed_matmul,
                      packed_unsupported_reason)
from .fp8 import fp8_dtype, quantize_fp8
from .llm_int8 import absmax_int8, llm_int8_matmul
from .packing import pack_bits, pack_int4, unpack_bits, unpack_int4


class QuantizedLinear(nn.Module):
    """y = (x / input_scale) @ W_hat^T with W_hat = (q - zero_point) * scale per group of the input dim.

    kernel: "auto" (packed where it fits, else reference), "reference" (dequantize, then matmul) or
    "packed" (torch's int4pack / int8pack kernels; refused when the layout does not fit).
    compute_dtype: the activation dtype of the packed kernels (default bf16; fp32 is exact but slow).
    """

    def __init__(self, qt: QuantizedTensor, input_scale: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16, out_dtype: torch.dtype | None = None,
                 bias: torch.Tensor | None = None, kernel: str = "auto", compute_dtype: torch.dtype | None = None):
        super().__init__()
        if qt.q.dim() != 2 or qt.group_size is None:
            raise ValueError("QuantizedLinear needs a 2-D weight quantized per channel or per group")
        if not torch.isfinite(qt.scale).all():
            raise ValueError("qt.scale contains NaN/Inf: the weight's scales must be finite (was the weight?)")
        self.out_features, self.in_features = qt.q.shape
        self.bits, self.symmetric, self.group_size = check_bits(qt.bits), qt.symmetric, qt.group_size
        self.out_dtype = out_dtype
        self.register_buffer("qweight", self._pack(qt.q))
        tiny = torch.finfo(scale_dtype).tiny
        self.register_buffer("scale", qt.scale.float().clamp(min=tiny).to(scale_dtype))
        # Affine zero points are integers in [0, 2^b - 1]: one byte each. Symmetric: none stored.
        self.register_buffer("zero_point", None if qt.symmetric else qt.zero_point.to(torch.uint8))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().to(scale_dtype))
        self.register_buffer("bias", _bias(bias, self.out_features))
        self.compute_dtype = compute_dtype
        self._packed: tuple[tuple, PackedWeight] | None = None   # (device, dtype) -> kernel layout
        self.set_kernel(kernel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
                    **kwargs) -> "QuantizedLinear":
        """Round-to-nearest (RTN) quantization of an `nn.Linear` (group_size None = per channel)."""
        w = linear.weight.detach()
        granularity = "channel" if group_size is None else "group"
        return cls(quantize_tensor(w, bits, symmetric, granularity, group_size), out_dtype=w.dtype,
                   bias=linear.bias, **kwargs)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return q.to(torch.int8 if self.symmetric else torch.uint8)
        if self.bits == 4:
            if self.in_features % 2:
                raise ValueError(f"4-bit packing needs an even input dimension, got {self.in_features}")
            return pack_int4(q, signed=self.symmetric)
        offset = 2 ** (self.bits - 1) if self.symmetric else 0  # dense packing stores unsigned codes
        return pack_bits(q + offset, self.bits)

    def codes(self) -> torch.Tensor:
        """The integer codes (O, I) as int32."""
        if self.bits == 8:
            return self.qweight.to(torch.int32)
        if self.bits == 4:
            return unpack_int4(self.qweight, signed=self.symmetric).to(torch.int32)
        offset = 2 ** (self.bits - 1) if self.symmetric else 0
        codes = unpack_bits(self.qweight, self.bits, self.out_features * self.in_features) - offset
        return codes.reshape(self.out_features, self.in_features)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W_hat (O, I) in `dtype` (default: the dtype of the layer it replaced)."""
        dtype = dtype or self.out_dtype or torch.float32
        q = rearrange(self.codes(), "O (G g) -> O G g", g=self.group_size).to(dtype)
        if self.zero_point is not None:
            q = q - self.zero_point.to(dtype)[..., None]
        return rearrange(q * self.scale.to(dtype)[..., None], "O G g -> O (G g)")

    def set_kernel(self, kernel: str) -> "QuantizedLinear":
        """Switch between "auto", "reference" and "packed" (refused if packed cannot run here)."""
        check_kernel(kernel)
        if kernel == "packed":
            reason = self.packed_unsupported_reason(self.qweight.device)
            if reason is not None:
                raise ValueError(f"kernel='packed' cannot run this layer ({self.extra_repr()}): {reason}; "
                                 f"use kernel='auto' or 'reference'")
        self.kernel = kernel
        return self

    def packed_unsupported_reason(self, device) -> str | None:
        return packed_unsupported_reason(self.bits, self.symmetric, self.group_size, self.out_features,
                                         self.in_features, torch.device(device))

    def packed_weight(self, device=None) -> PackedWeight | None:
        """The packed-kernel layout for `device` (built once, then reused), or None when this layer runs
        the reference kernel there."""
        device = torch.device(device) if device is not None else self.qweight.device
        if self.kernel == "reference":
            return None
        reason = self.packed_unsupported_reason(device)
        if reason is not None:
            if self.kernel == "packed":
                raise ValueError(f"kernel='packed' cannot run on {device}: {reason}")
            return None
        dtype = self.compute_dtype or default_compute_dtype(device)
        key = (device, dtype)
        if self._packed is None or self._packed[0] != key:
            zero = None if self.zero_point is None else self.zero_point
            self._packed = (key, pack_weight(self.codes(), self.scale, zero, self.bits, self.group_size,
                                             device, dtype))
        return self._packed[1]

    def _apply(self, fn, *args, **kwargs):
        self._packed = None   # .to(device/dtype): the kernel layout is rebuilt on the next call
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = None   # new codes or scales: rebuild the kernel layout
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., I) -> (..., O)
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        packed = self.packed_weight(x.device)
        if packed is None:
            return F.linear(x, self.dequantized_weight(x.dtype), _cast(self.bias, x.dtype))
        y = packed_matmul(x.to(packed.scales.dtype), packed).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "affine"
        return (f"in={self.in_features}, out={self.out_features}, int{self.bits} {kind}, "
                f"group_size={self.group_size}, awq_scales={self.input_scale is not None}, "
                f"kernel={getattr(self, 'kernel', 'auto')}")


class Fp8Linear(nn.Module):
    """float8 weights (e4m3 by default) with a per-output-channel fp32 scale."""

    def __init__(self, linear: nn.Linear, fmt: str = "e4m3"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt, self.out_dtype = fmt, linear.weight.dtype
        w8, scale = quantize_fp8(linear.weight.detach(), fmt, per_channel=True)
        self.register_buffer("weight8", w8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", _bias(linear.bias, self.out_features))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.weight8.float() * self.scale).to(dtype or self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), _cast(self.bias, x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {fp8_dtype(self.fmt)}"


class LLMInt8Linear(nn.Module):
    """int8 weights (row-wise absmax) multiplied by LLM.int8()'s vector-wise matmul with outlier split."""

    def __init__(self, linear: nn.Linear, threshold: float | None = 6.0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.threshold = None if threshold is None else _checks.finite_positive_float("threshold", threshold)
        w_q, w_scale = absmax_int8(linear.weight.detach(), dim=-1)
        self.register_buffer("w_q", w_q)                # (O, I) int8
        self.register_buffer("w_scale", w_scale)        # (O, 1) fp32
        self.register_buffer("bias", _bias(linear.bias, self.out_features))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.w_q.float() * self.w_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = llm_int8_matmul(x, threshold=self.threshold, w_q=self.w_q, w_scale=self.w_scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 vector-wise, threshold={self.threshold}"


QUANTIZED_LINEAR_TYPES = (QuantizedLinear, Fp8Linear, LLMInt8Linear)


def _bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """The replaced layer's bias, kept in full precision (O values: nothing to gain by quantizing it)."""
    if bias is None:
        return None
    if bias.shape != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
    return bias.detach().clone()


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def model_nbytes(model: nn.Module) -> int:
    """Bytes of everything the model stores (its state dict: parameters and persistent buffers),
    each storage counted once. Quantized layers hold packed codes, so this is the true size."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total
