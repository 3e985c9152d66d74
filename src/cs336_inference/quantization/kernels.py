"""Weight-only quantized matmuls that read the packed codes: torch's int4pack and int8pack kernels.

The readable way to run a quantized linear is to dequantize W_hat and call an ordinary matmul:
correct, but it writes the full-precision matrix to memory and reads it back every step, so a
memory-bound decode gets *slower*. Fast kernels instead read the small codes and dequantize inside
the matmul (in registers), so fewer bytes are also fewer milliseconds. torch ships such kernels for
CPU and CUDA (the ones gpt-fast and torchao call). Every layout below starts from one form,
unsigned codes u with a per-group scale s and offset c, w = u * s + c (symmetric codes q in
[-2^(b-1), 2^(b-1)) are u = q + 2^(b-1), c = -2^(b-1) s; affine ones c = -z s; GGUF's Q4_1 stores
c = m directly):

- "int4pack": `aten._weight_int4pack_mm_for_cpu` / `aten._weight_int4pack_mm` (CUDA). Its grid is
  w = (u - 8) * scale + zero with one (scale, zero) pair per group of 32/64/128/256 inputs and a
  *float* zero, so scale = s and zero = c + 8 s: any 4-bit form maps on without re-quantizing.
- "int8pack": `torch._weight_int8pack_mm(x, t, scale)` = x @ (t * scale)^T with int8 codes t = u - 128
  and one scale per output row; w = t s + (c + 128 s), so a nonzero c + 128 s is subtracted as
  (sum_k x_k) * (c + 128 s).
- "int8 as two int4 planes" (grouped int8, which int8pack cannot hold): u = 16 h + l with nibbles
  h, l in [0, 15], so w = h * 16s + (l * s + c): two int4 grids side by side, run as one int4pack
  matmul of [x, x] against [W_h | W_l]. Exact (no re-quantization), 8 bits per weight.

Activations run in bf16: with fp16 or fp32 activations these CPU kernels take fallback paths many
times slower (fp32 stays available: exact up to summation order, so tests can check a layout without
bf16 rounding in the way). The kernels' real limits were learned by sweeping shapes in a subprocess
(tests/library/test_kernel_shapes.py):
int8pack with bf16 activations crashes or returns garbage on CPU unless in_features % 16 == 0, and
the int4 CPU kernel needs out_features % 16 == 0; `packed_layout` refuses what would misbehave.

A packed layout is built once, when a layer is built or moved (`QuantizedLinear`), never per call.
It serves the few-row matmuls of decode; prefill's many-row matmuls are compute-bound, where these
kernels are slower than dequantizing once and calling the dtype's dense matmul (`PACKED_MAX_ROWS`).
An int4pack layer dequantizes to exactly the matrix its kernel multiplies by (`int4pack_dense`), so
a prompt and the tokens decoded after it see the same weights.

Whose matmul runs an int4 layout is a name in the `LINEAR` registry, decided when the layer is packed:
the core registers "torch" (torch's int4pack kernels, which run every int4 layout); the performance
workshop registers its own CPU kernel beside it (`workshop.register_kernels()`), which a layer takes
where it runs.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.kernel_registry import KernelRegistry

KERNELS = ("auto", "reference", "packed")
INT4_GROUP_SIZES = (256, 128, 64, 32)   # what the int4pack kernels accept (largest first)
# Above this many rows (tokens x batch) the layer dequantizes once and runs a dense matmul instead: the
# packed CPU kernels are tuned for matrix-vector work, and on a long prefill a dense bf16 matmul wins
# even after paying for the dequantization (on SmolLM2's exact weights the two cross near this size).
PACKED_MAX_ROWS = 128


class SlowKernelWarning(UserWarning):
    """A quantized layer dequantizes its weight on every call (no packed kernel fits it)."""


_announced: set[str] = set()
_collectors: list[list[str]] = []


def announce_fallback(message: str) -> None:
    """Warn once per distinct message (or hand it to the innermost `collect_fallbacks`)."""
    if _collectors:
        _collectors[-1].append(message)
    elif message not in _announced:
        _announced.add(message)
        warnings.warn(message, SlowKernelWarning, stacklevel=4)


@contextlib.contextmanager
def collect_fallbacks():
    """Gather the fallbacks announced inside (one summary warning per model, not one per layer)."""
    _collectors.append(found := [])
    try:
        yield found
    finally:
        _collectors.remove(found)


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


def _int4_reason(group_size: int, out_features: int, in_features: int, device: torch.device) -> str | None:
    if int4_kernel_group(group_size) is None:
        return f"int4pack needs group_size a multiple of 32, got {group_size}"
    if device.type == "cpu" and out_features % 16:
        return f"the int4pack CPU kernel needs out_features % 16 == 0, got {out_features}"
    if device.type == "cuda" and (out_features % 8 or in_features % 32):
        return f"the int4pack CUDA kernel needs out_features % 8 == 0 and in_features % 32 == 0, got " \
               f"{out_features}, {in_features}"
    return None


def packed_layout(bits: int, group_size: int, out_features: int, in_features: int, device,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[str | None, str | None]:
    """(layout, None) for the packed kernel that runs this layer on `device` with `dtype` activations,
    or (None, why none can)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return None, f"no packed kernels on {device.type}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return None, "torch's packed CUDA kernels need compute capability 8.0 (Ampere) or newer"
    if bits == 4:
        reason = _int4_reason(group_size, out_features, in_features, device)
        return ("int4pack", None) if reason is None else (None, reason)
    if bits == 8:
        if group_size == in_features and (device.type == "cuda" or dtype != torch.bfloat16 or in_features % 16 == 0):
            return "int8pack", None
        planes = _int4_reason(group_size, out_features, 2 * in_features, device)
        if planes is None:
            return "int8 as two int4 planes", None
        if group_size != in_features:
            return None, f"grouped int8 runs as two int4 planes, and {planes.replace('int4pack', 'that')}"
        return None, (f"int8pack with bf16 activations needs in_features % 16 == 0 on CPU (it crashes "
                      f"otherwise), got {in_features}, and the two-int4-plane form: {planes}")
    return None, f"no packed kernel for {bits}-bit codes (only 4 and 8)"


def packed_unsupported_reason(bits: int, symmetric: bool, group_size: int, out_features: int,
                              in_features: int, device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why no packed kernel can run this layer on `device` (None when one can)."""
    return packed_layout(bits, group_size, out_features, in_features, device, dtype)[1]


@dataclass
class PackedWeight:
    """A quantized weight laid out for one kernel on one device (derived data, never saved)."""

    layout: str                       # "int4pack", "int8pack" or "int8 as two int4 planes"
    weight: torch.Tensor              # int4: the kernel's layout; int8pack: (O, I) int8 codes
    scales: torch.Tensor              # int4: (I / g, O, 2) scale and zero; int8pack: (O,) scales
    group_size: int                   # kernel group length (int4 layouts)
    zero_term: torch.Tensor | None    # int8pack with an offset: (O,) subtracted times sum(x)
    kernel: str = "torch"             # whose matmul runs it: a name in `LINEAR` ("torch", or one the workshop added)
    blocks: torch.Tensor | None = None  # a registered kernel's own layout of the scales and zeros, if it has one
    max_rows: int = PACKED_MAX_ROWS   # above this many rows a dense matmul is faster

    def __post_init__(self):
        # Its shapes are fixed by the layer. A compiled decode step (dynamic=True) would otherwise make
        # them symbols, like any input's, and check a shape guard per size relation, in Python, before
        # every step (thousands of them on SmolLM2).
        for t in (self.weight, self.scales, self.zero_term, self.blocks):
            if t is not None:
                mark_static(t)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call."""
        if self.blocks is not None:      # ours reads the codes and its own copy of the scales
            return self.weight.nbytes + self.blocks.nbytes
        extra = 0 if self.zero_term is None else self.zero_term.nbytes
        return self.weight.nbytes + self.scales.nbytes + extra


def mark_static(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static(t)` (every dim of `t` static in a compiled step), without importing
    torch's compiler where nothing imported it yet: a plain load never compiles, and the import is
    slow. The marks are the attributes `mark_static` sets outside a compile (`test_quantized_kernels`
    checks that they agree)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.mark_static(t)
    elif t.dim():
        t._dynamo_static_indices = set(range(t.dim()))
        t._has_dynamo_dim_marking = True


def _inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 tile depth (2, 4 or 8) that divides the input dimension in tiles of 16."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


@dataclass(frozen=True)
class Int4Kernel:
    """A matmul for the int4pack layouts (w = (u - 8) * scale + zero per group), registered in `LINEAR`.

    runs(out_features, in_features, group_size, device, dtype): whether a layer of that shape runs on it
    here (asked when the layer is packed); pack(unsigned (O, I), pairs (I / g, O, 2)) -> (codes, blocks):
    its layout of the codes and of the (scale, zero) pairs; matmul(x (M, I), codes, blocks) -> (M, O);
    max_rows(): rows above which the layer dequantizes and runs a dense matmul instead; usable(): whether
    a layout packed for it by an earlier process (`PackedStore`) can run in this one."""

    runs: Callable[[int, int, int, torch.device, torch.dtype], bool]
    pack: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    max_rows: Callable[[], int] = lambda: PACKED_MAX_ROWS
    usable: Callable[[], bool] = lambda: True


def _torch_int4_pack(unsigned: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _int4_weight(unsigned, pairs.device), None


def _torch_int4_runs(out_features: int, in_features: int, group_size: int, device, dtype) -> bool:
    return True   # `packed_layout` has checked the shape already


# Int4 matmuls by name. "torch" (torch's kernels, registered below) runs every layout `packed_layout`
# accepts and reads the pairs (`PackedWeight.scales`) itself: its matmul is inlined in `packed_matmul`.
LINEAR = KernelRegistry("int4 linear kernel", workshop=("cs336 avx512-bf16",))


def _int4_packed(layout: str, unsigned: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedWeight:
    """An int4 layout (u in [0, 15] (O, I) and the kernel's (I / g, O, 2) pairs) for the most recently
    registered kernel in `LINEAR` that runs this layer here ("torch" runs every one)."""
    O, I = unsigned.shape
    for name in reversed(LINEAR.names()):
        kernel = LINEAR.kernels[name]
        if kernel.runs(O, I, group_size, scales.device, scales.dtype):
            codes, blocks = kernel.pack(unsigned, scales)
            return PackedWeight(layout, codes, scales, group_size, None, name, blocks, kernel.max_rows())
    raise RuntimeError(f"no int4 linear kernel runs this layer: {LINEAR!r}")


def _int4_weight(unsigned: torch.Tensor, device: torch.device) -> torch.Tensor:
    unsigned = unsigned.to(device=device, dtype=torch.int32).contiguous()
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, _inner_k_tiles(unsigned.shape[1]))
    pairs = (unsigned[:, 0::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)   # CUDA: the even element high
    return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(unsigned.shape[1]))


def _int4_scales(scale: torch.Tensor, zero: torch.Tensor, repeat: int, dtype: torch.dtype) -> torch.Tensor:
    """(O, G) scale and zero -> the kernel's (G * repeat, O, 2), each group repeated `repeat` times."""
    pair = torch.stack([scale.repeat_interleave(repeat, 1), zero.repeat_interleave(repeat, 1)], dim=-1)
    return pair.transpose(0, 1).contiguous().to(dtype)


def pack_weight(unsigned: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group_size: int,
                layout: str, device, dtype: torch.dtype = torch.bfloat16) -> PackedWeight:
    """Unsigned codes u (O, I), scale and offset (O, I / group_size) with w = u * s + c -> `layout`.

    The caller picks `layout` with `packed_layout` first. The scales and zeros are computed in fp32 and
    rounded once, to the activation dtype the kernels take.
    """
    device = torch.device(device)
    O, I = unsigned.shape
    s, c = scale.to(device).float(), offset.to(device).float()
    if layout == "int8pack":
        t = (unsigned.to(device) - 128).to(torch.int8)
        zero = c[:, 0] + 128 * s[:, 0]                                    # w = t s + zero
        zero_term = None if bool((zero == 0).all()) else zero.to(dtype)
        return PackedWeight(layout, t, s[:, 0].to(dtype), I, zero_term)
    g = int4_kernel_group(group_size)
    repeat = group_size // g
    if layout == "int4pack":
        return _int4_packed(layout, unsigned.to(device), _int4_scales(s, c + 8 * s, repeat, dtype), g)
    if layout != "int8 as two int4 planes":
        raise ValueError(f"unknown packed layout {layout!r}")
    high, low = unsigned.to(device) >> 4, unsigned.to(device) & 15         # u = 16 h + l
    scales = torch.cat([_int4_scales(16 * s, 128 * s, repeat, dtype),       # 16 s h = (h - 8) 16 s + 128 s
                        _int4_scales(s, c + 8 * s, repeat, dtype)])         # l s + c = (l - 8) s + c + 8 s
    return _int4_packed(layout, torch.cat([high, low], dim=1), scales, g)  # (O, 2I) codes


class PackedStore:
    """Packed layouts kept from an earlier build of the same model, and the ones built now (`reuse_packed`).

    `entries`: what an earlier build recorded ({"key", and `PackedWeight`'s fields}, in the order the layers
    were packed), or None. Each layer packed inside `reuse_packed` takes the entry at its position if the
    key matches (layout, shape, bits, group, dtype, device) and its kernel can run here; otherwise it
    packs as usual. `made` lists every layout of this build, for the caller to keep."""

    def __init__(self, entries: list[dict] | None = None):
        self.entries, self.made, self.reused = entries or [], [], 0

    def get(self, key: str, pack) -> PackedWeight:
        i = len(self.made)
        entry = self.entries[i] if i < len(self.entries) else None
        packed = None
        if entry is not None and entry.get("key") == key:
            fields = {f: entry[f] for f in PackedWeight.__dataclass_fields__ if f in entry}
            kernel = LINEAR.kernels.get(fields.get("kernel", "torch"))
            if kernel is None or not kernel.usable():   # its kernel must be registered and load here
                fields = None
            else:                                       # at this CPU's bar
                fields["max_rows"] = kernel.max_rows()
            if fields is not None:
                packed = PackedWeight(**fields)
                self.reused += 1
        if packed is None:
            packed = pack()
        self.made.append({"key": key, **{f: getattr(packed, f) for f in PackedWeight.__dataclass_fields__}})
        return packed

    def tensor(self, key: str, make) -> torch.Tensor:
        """The tensor an earlier build kept at this position under `key` (its shape and dtype in the key),
        else `make()`; recorded in `made` either way (a layer's packed codes: `packed_codes_for`)."""
        i = len(self.made)
        entry = self.entries[i] if i < len(self.entries) else None
        if entry is not None and entry.get("key") == key and isinstance(entry.get("tensor"), torch.Tensor):
            t = entry["tensor"]
            self.reused += 1
        else:
            t = make()
        self.made.append({"key": key, "tensor": t})
        return t


_store: list[PackedStore] = []


@contextlib.contextmanager
def reuse_packed(store: PackedStore):
    """Layers packed inside take their layouts from `store` where it has them (see `PackedStore`)."""
    _store.append(store)
    try:
        yield store
    finally:
        _store.remove(store)


def packed_weight_for(inputs, bits: int, group_size: int, layout: str, device, dtype: torch.dtype,
                      shape: tuple[int, int]) -> PackedWeight:
    """`pack_weight(*inputs(), ...)`, or, inside `reuse_packed`, the layout its store kept for this layer
    (then `inputs()`, the unsigned form, is never computed)."""
    make = lambda: pack_weight(*inputs(), bits, group_size, layout, device, dtype)   # noqa: E731
    if not _store:
        return make()
    key = f"{layout}|{shape[0]}x{shape[1]}|{bits}|g{group_size}|{dtype}|{torch.device(device)}"
    return _store[-1].get(key, make)


def packed_codes_for(make, bits: int, signed: bool, shape: tuple[int, int]) -> torch.Tensor:
    """`make()`, a layer's codes packed for storage (`QuantizedLinear.qweight`), or, inside `reuse_packed`,
    the ones its store kept for this layer (then `make` is never called). The store's file is keyed by
    the model file and this code, and checksummed (the workshop's `startup.cached_packed_weights`)."""
    if not _store:
        return make()
    key = f"codes|{shape[0]}x{shape[1]}|{bits}|{'signed' if signed else 'unsigned'}"
    return _store[-1].tensor(key, make)


LINEAR.register("torch", Int4Kernel(_torch_int4_runs, _torch_int4_pack, matmul=None))


def int4pack_dense(nibbles: torch.Tensor, scales: torch.Tensor, group_size: int, signed: bool) -> torch.Tensor:
    """The matrix an int4pack kernel multiplies by, dense: (O, I) in the scales' dtype.

    nibbles (O, I/2) uint8: our two-per-byte codes (`pack_int4`: input 2k in the low nibble, 2k+1 in
    the high one; two's complement when `signed`, whose unsigned code u = q + 8 flips the top bit).
    scales (I/group_size, O, 2): the kernel's (scale, zero) pairs, w = (u - 8) * scale + zero. Computed
    in fp32 and rounded once, as the kernel does: equal to its weights to the bit.
    """
    O = nibbles.shape[0]
    if signed:
        nibbles = nibbles ^ 0x88
    # unpacked here in uint8, not through `unpack_int4` (int8 via a flatten): compiled per shape, this
    # form fuses into one loop, which made a whole prefill on SmolLM2 faster
    u = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).view(O, -1, group_size)   # (O, G, g)
    scale, zero = (scales[..., i].t().float()[..., None] for i in (0, 1))           # (O, G, 1) each
    return torch.addcmul(zero - 8 * scale, u.float(), scale).to(scales.dtype).reshape(O, -1)


def packed_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x (..., I) in the packed weight's dtype (or fp32, on our CPU kernel) -> x @ W_hat^T (..., O), in x's
    dtype, reading only the packed bytes."""
    lead, I = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, I).contiguous()                                         # (M, I)
    if packed.layout == "int8pack":
        y = torch._weight_int8pack_mm(x2, packed.weight, packed.scales)
        if packed.zero_term is not None:
            y = y + x2.sum(-1, keepdim=True) * packed.zero_term
        return y.reshape(*lead, y.shape[-1])
    if packed.layout != "int4pack":                                            # two planes: [x, x] @ [W_h | W_l]^T
        x2 = torch.cat([x2, x2], dim=1)
    if packed.kernel != "torch":                                               # a registered kernel of our own
        y = LINEAR.kernels[packed.kernel].matmul(x2, packed.weight, packed.blocks)
    elif x2.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed.weight, packed.group_size, packed.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2, packed.weight, packed.group_size, packed.scales)
    return y.reshape(*lead, y.shape[-1])
