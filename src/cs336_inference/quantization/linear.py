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

from .. import _checks
from .core import QuantizedTensor, check_bits, quantize_tensor
from .kernels import (PACKED_MAX_ROWS, PackedWeight, announce_fallback, check_kernel, default_compute_dtype,
                      int4pack_dense, packed_codes_for, packed_layout, packed_matmul, packed_weight_for)
from .fp8 import fp8_dtype, quantize_fp8
from .llm_int8 import absmax_int8, llm_int8_matmul
from .packing import pack_bits, pack_int4, unpack_bits, unpack_int4


class QuantizedLinear(nn.Module):
    """y = (x / input_scale) @ W_hat^T with W_hat = (q - zero_point) * scale per group of the input dim
    (or, given `minimum`, W_hat = q * scale + minimum: GGUF's Q4_1 blocks).

    kernel: "auto" (packed where it fits, else reference, announced once), "reference" (dequantize,
    then matmul) or "packed" (torch's int4pack / int8pack kernels; refused when the layout does not fit).
    The choice is made when the layer is built or moved (`.to`, `.cuda`, a dtype cast, a loaded state
    dict), never per call: `kernel_summary()` says what runs. compute_dtype: the activation dtype of
    the packed kernels (default bf16; fp32 is exact but slow on torch's kernels; our CPU kernel
    `cpu_int4` takes an fp32 model's activations as they are, whatever compute_dtype says).
    """

    def __init__(self, qt: QuantizedTensor, input_scale: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16, out_dtype: torch.dtype | None = None,
                 bias: torch.Tensor | None = None, kernel: str = "auto", compute_dtype: torch.dtype | None = None,
                 minimum: torch.Tensor | None = None):
        super().__init__()
        if qt.q.dim() != 2 or qt.group_size is None:
            raise ValueError("QuantizedLinear needs a 2-D weight quantized per channel or per group")
        if not _all_finite(qt.scale):
            raise ValueError("qt.scale contains NaN/Inf: the weight's scales must be finite (was the weight?)")
        if minimum is not None:
            if qt.symmetric or tuple(minimum.shape) != tuple(qt.scale.shape) or not _all_finite(minimum):
                raise ValueError(f"minimum (w = q * scale + minimum) needs unsigned codes (symmetric=False) and "
                                 f"finite values shaped like the scales {tuple(qt.scale.shape)}, got "
                                 f"{tuple(minimum.shape)} with symmetric={qt.symmetric}")
        self.out_features, self.in_features = qt.q.shape
        self.bits, self.symmetric, self.group_size = check_bits(qt.bits), qt.symmetric, qt.group_size
        self.out_dtype = out_dtype
        self.register_buffer("qweight", self._pack(qt.q))
        scale = qt.scale.float() if minimum is not None else qt.scale.float().clamp(min=torch.finfo(scale_dtype).tiny)
        self.register_buffer("scale", scale.to(scale_dtype))
        # Affine zero points are integers in [0, 2^b - 1]: one byte each. Symmetric: none stored.
        affine = not qt.symmetric and minimum is None
        self.register_buffer("zero_point", qt.zero_point.to(torch.uint8) if affine else None)
        self.register_buffer("minimum", None if minimum is None else minimum.to(scale_dtype))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().to(scale_dtype))
        self.register_buffer("bias", _bias(bias, self.out_features))
        self.compute_dtype = compute_dtype
        # Above `dense_rows` rows (a prefill) the layer dequantizes once and runs a dense matmul, through
        # `dense_fn` for an int4pack layout (`compile_dense_prefill` swaps in a compiled one and, for
        # torch's kernel, a lower bar). None: the packed kernel's own bar (`PackedWeight.max_rows`).
        self.dense_rows: int | None = None
        self.dense_fn = int4pack_dense
        self.kernel = check_kernel(kernel)
        self._packed: PackedWeight | None = None
        self.fallback_reason: str | None = None
        self._choose_kernel(codes=qt.q)

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
            return packed_codes_for(lambda: pack_int4(q, signed=self.symmetric), 4, self.symmetric, tuple(q.shape))
        offset = 2 ** (self.bits - 1) if self.symmetric else 0  # dense packing stores unsigned codes
        return pack_bits(q + offset, self.bits)

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer codes (O, I) as int32 (or only `rows`, token ids (...,) -> (..., I), for 8 and 4 bits)."""
        packed = self.qweight if rows is None or self.bits not in (4, 8) else self.qweight[rows]
        if self.bits == 8:
            codes = packed.to(torch.int32)
        elif self.bits == 4:
            codes = unpack_int4(packed, signed=self.symmetric).to(torch.int32)
        else:
            offset = 2 ** (self.bits - 1) if self.symmetric else 0
            codes = unpack_bits(packed, self.bits, self.out_features * self.in_features) - offset
            codes = codes.reshape(self.out_features, self.in_features)
        return codes if rows is None or self.bits in (4, 8) else codes[rows]

    def dequantized_weight(self, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W_hat (O, I) in `dtype` (default: the dtype of the layer it replaced); with `rows`, only those
        rows (token ids (...,) -> (..., I): an embedding lookup that dequantizes what it reads)."""
        dtype = dtype or self.out_dtype or torch.float32
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        q = self.codes(rows).unflatten(-1, (-1, self.group_size)).to(dtype)      # (..., G, g)
        if self.zero_point is not None:
            q = q - pick(self.zero_point).to(dtype)[..., None]
        w = q * pick(self.scale).to(dtype)[..., None]
        if self.minimum is not None:
            w = w + pick(self.minimum).to(dtype)[..., None]
        return w.flatten(-2)                                                     # (..., I)

    def weight_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows (R,) output indices -> (R, I): what x is multiplied by for them, self(x)[..., rows] =
        x @ weight_rows(rows).T (the kernel's rounding and the bias aside). A draft that ranks a few
        thousand token ids reads only their rows of a quantized LM head (`generation.draft_vocab`)."""
        w = self.dequantized_weight(dtype, rows=rows)
        return w if self.input_scale is None else w / self.input_scale.to(dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W (O, I) in `dtype` for the dense route. In the kernel's activation dtype (bf16) an int4pack
        layer returns its kernel's weights to the bit (`int4pack_dense`), so prefill and decode multiply
        by the same matrix; otherwise (fp32 activations, other layouts) `dequantized_weight`, exact."""
        packed = self._packed
        if packed is None or packed.layout != "int4pack" or dtype != packed.scales.dtype:
            return self.dequantized_weight(dtype)
        return self.dense_fn(self.qweight, packed.scales, packed.group_size, self.symmetric).to(dtype)

    def unsigned_form(self, codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, s, c): unsigned codes (O, I) and fp32 scale and offset (O, G) with W_hat = u * s + c
        (`codes`: this layer's codes when the caller already holds them, saving an unpack)."""
        u, s = (self.codes() if codes is None else codes.to(torch.int32)), self.scale.float()
        if self.symmetric:
            half = 2 ** (self.bits - 1)
            return u + half, s, -half * s
        if self.minimum is not None:
            return u, s, self.minimum.float()
        return u, s, -self.zero_point.float() * s

    def set_kernel(self, kernel: str) -> "QuantizedLinear":
        """Switch between "auto", "reference" and "packed" (refused if packed cannot run here)."""
        check_kernel(kernel)
        if kernel == "packed":
            reason = self.packed_unsupported_reason(self.qweight.device)
            if reason is not None:
                raise ValueError(f"kernel='packed' cannot run this layer ({self.extra_repr()}): {reason}; "
                                 f"use kernel='auto' or 'reference'")
        self.kernel = kernel
        self._choose_kernel()
        return self

    def packed_unsupported_reason(self, device) -> str | None:
        dtype = self.compute_dtype or default_compute_dtype(torch.device(device))
        return packed_layout(self.bits, self.group_size, self.out_features, self.in_features, device, dtype)[1]

    def _choose_kernel(self, rebuild: bool = False, codes: torch.Tensor | None = None) -> None:
        """Decide, for the device the codes live on, what `forward` runs; build the packed layout once
        (again only when the device, the kernel setting or, with `rebuild`, the codes change)."""
        device = self.qweight.device
        dtype = self.compute_dtype or default_compute_dtype(device)
        if not rebuild and getattr(self, "_chosen_for", None) == (device, self.kernel, dtype):
            return
        self._packed, self.fallback_reason, self._chosen_for = None, None, (device, self.kernel, dtype)
        if self.kernel == "reference" or device.type == "meta":
            return
        layout, reason = packed_layout(self.bits, self.group_size, self.out_features, self.in_features, device, dtype)
        if layout is None:
            if self.kernel == "packed":
                raise ValueError(f"kernel='packed' cannot run this layer on {device}: {reason}")
            self.fallback_reason = reason
            announce_fallback(f"QuantizedLinear(int{self.bits}, group_size={self.group_size}, in={self.in_features}, "
                              f"out={self.out_features}) dequantizes its weight on every call, slower than a "
                              f"full-precision matmul: {reason}")
            return
        self._packed = packed_weight_for(lambda: self.unsigned_form(codes), self.bits, self.group_size, layout, device,
                                         dtype, (self.out_features, self.in_features))

    def packed_weight(self, device=None) -> PackedWeight | None:
        """The packed-kernel layout this layer runs (None: the reference kernel), chosen for its device."""
        if device is not None and torch.device(device) != self.qweight.device:
            raise ValueError(f"the layer lives on {self.qweight.device}, not {device}: move it with .to({device!r})")
        return self._packed

    def dense_above(self) -> int:
        """Rows (tokens x batch) above which `forward` dequantizes and runs a dense matmul."""
        if self.dense_rows is not None:
            return self.dense_rows
        return self._packed.max_rows if self._packed is not None else PACKED_MAX_ROWS

    def kernel_summary(self) -> str:
        """What `forward` runs, in words (listed per layer by `TransformerLM.describe()`)."""
        if self._packed is not None:
            dtype = str(self.compute_dtype or default_compute_dtype(self.qweight.device)).removeprefix("torch.")
            grid = "per channel" if self._packed.layout == "int8pack" else f"g{self._packed.group_size}"
            compiled = "compiled " if self.dense_fn is not int4pack_dense else ""
            kernel = "" if self._packed.kernel == "torch" else f" on {self._packed.kernel}"
            if self._packed.kernel != "torch":   # ours also takes fp32 activations, as two bf16 halves
                dtype = f"{dtype} activations, or fp32 split in two bf16 halves"
            else:
                dtype = f"{dtype} activations"
            return (f"{self._packed.layout} {grid}{kernel} ({dtype}; above {self.dense_above()} rows: "
                    f"{compiled}dequantize + dense matmul)")
        if self.kernel == "reference":
            return "reference (dequantize + matmul, as asked)"
        return f"reference (dequantize + matmul): {self.fallback_reason or 'not placed on a device yet'}"

    def _apply(self, fn, *args, **kwargs):
        # A cast of the model (.to(bf16)) changes the activations, not the stored scales: keep their dtype.
        kept = {n: self._buffers.pop(n) for n in ("scale", "minimum") if self._buffers.get(n) is not None}
        try:
            out = super()._apply(fn, *args, **kwargs)
        finally:
            for n, t in kept.items():
                self._buffers[n] = t.to(fn(t[..., :0]).device)
        if self.out_dtype is not None:                 # what dequantized_weight() returns follows the cast
            self.out_dtype = fn(torch.empty(0, dtype=self.out_dtype)).dtype
        self._choose_kernel()
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        out = super()._load_from_state_dict(*args, **kwargs)
        self._choose_kernel(rebuild=True)   # new codes or scales: rebuild the kernel layout
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., I) -> (..., O)
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        packed = self._packed
        # Our CPU kernel takes fp32 activations as they are (near-fp32 sums, fp32 out), and for every row
        # count: a row's result then never depends on how many rows came with it (a request answers the
        # same alone and batched), and no dense fp32 matmul is faster on a prefill. The others take bf16.
        fp32_in = packed is not None and packed.blocks is not None and x.dtype == torch.float32
        rows = packed.max_rows if self.dense_rows is None and packed is not None else self.dense_rows  # dense_above()
        if packed is None or (not fp32_in and x.numel() > rows * self.in_features):   # reference, or prefill-sized
            return F.linear(x, self.dense_weight(x.dtype), _cast(self.bias, x.dtype))
        y = packed_matmul(x if fp32_in else x.to(packed.scales.dtype), packed).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "min-offset" if self.minimum is not None else "symmetric" if self.symmetric else "affine"
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

    def kernel_summary(self) -> str:
        return "reference (dequantize + matmul): no packed fp8 kernel, the fp8 weights are dequantized on every call"

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

    def kernel_summary(self) -> str:
        return ("LLM.int8() decomposed matmul: a readable simulation of the int8 kernel, dequantized in "
                "floating point on every call")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 vector-wise, threshold={self.threshold}"


QUANTIZED_LINEAR_TYPES = (QuantizedLinear, Fp8Linear, LLMInt8Linear)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite. max |t| is NaN or inf iff one is (max propagates NaN), and one
    vectorised reduction is much cheaper than `isfinite` on fp16 scales."""
    return t.numel() == 0 or not t.is_floating_point() or bool(t.abs().amax() < torch.inf)


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
