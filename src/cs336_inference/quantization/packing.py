"""Real storage for sub-byte codes: two int4 values per byte, or any b-bit codes packed densely.

PyTorch has no int4 dtype, so a "4-bit" model kept in int8 tensors would occupy 8 bits per weight.
Packing makes a quantized model's measured bytes its true size. Layout (little-endian nibbles,
as in GPTQ/AWQ kernels and llama.cpp's Q4 blocks): byte i of the last dim holds element 2i in its low
nibble and element 2i+1 in its high nibble.
"""

from __future__ import annotations

import torch

from .. import _checks


def _check_codes(q: torch.Tensor, lo: int, hi: int, name: str = "q") -> None:
    if not isinstance(q, torch.Tensor) or q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer torch.Tensor, got "
                        f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{name} values must lie in [{lo}, {hi}], got [{int(q.min())}, {int(q.max())}]")


def pack_int4(q: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """q (..., I) with values in [-8, 7] (signed) or [0, 15] -> uint8 (..., I/2); I must be even."""
    lo, hi = (-8, 7) if signed else (0, 15)
    _check_codes(q, lo, hi)
    if q.dim() == 0 or q.shape[-1] % 2 != 0:
        raise ValueError(f"the last dim of q must be even to pack two values per byte, got shape {tuple(q.shape)}")
    nibbles = q if q.dtype == torch.uint8 else (q.to(torch.int16) & 0xF).to(torch.uint8)   # two's complement
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """uint8 (..., I/2) -> int8 (..., I): the inverse of `pack_int4`."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 torch.Tensor, got "
                        f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    low, high = (packed & 0xF).to(torch.int8), (packed >> 4).to(torch.int8)
    q = torch.stack((low, high), dim=-1).flatten(-2)               # (..., I/2, 2) -> (..., I)
    return torch.where(q >= 8, q - 16, q) if signed else q


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned b-bit codes (values in [0, 2^b - 1]), flattened, -> uint8 of ceil(n * b / 8) bytes.

    Eight codes make exactly b bytes, so 3-bit weights cost 3/8 byte each (the last partial block is
    zero-padded). Shape is not stored: pass `numel` (and reshape) to `unpack_bits`.
    """
    _checks.integer("bits", bits, 1, 7, allowed="an int in [1, 7] for pack_bits")
    _check_codes(q, 0, 2**bits - 1)
    flat = q.reshape(-1).to(torch.int64)
    pad = (-flat.numel()) % 8
    flat = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, 8)   # (blocks, 8 codes)
    shifts = torch.arange(8, device=q.device) * bits
    word = (flat << shifts).sum(-1)                                # 8 * b <= 56 bits per block
    byte_shifts = torch.arange(bits, device=q.device) * 8
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)   # (blocks * b,)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The inverse of `pack_bits`: uint8 bytes -> int32 codes of length `numel`."""
    _checks.integer("bits", bits, 1, 7, allowed="an int in [1, 7] for unpack_bits")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError("packed must be a uint8 torch.Tensor (from pack_bits)")
    blocks = packed.reshape(-1, bits).to(torch.int64)              # (blocks, b bytes)
    word = (blocks << (torch.arange(bits, device=packed.device) * 8)).sum(-1)
    codes = (word[:, None] >> (torch.arange(8, device=packed.device) * bits)) & (2**bits - 1)
    codes = codes.reshape(-1)
    if numel > codes.numel():
        raise ValueError(f"numel {numel} exceeds the {codes.numel()} codes held in {packed.numel()} bytes")
    return codes[:numel].to(torch.int32)
