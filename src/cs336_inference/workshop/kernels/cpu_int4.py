"""Our own int4 matmul for few rows on CPUs with AVX512-BF16 (`csrc/int4_gemv.cpp`, built by
`cpu_attention`), beside torch's.

torch's int4pack CPU kernel spends most of a decode step turning 4-bit codes into numbers. Ours
multiplies the same grid, w = (u - 8) * scale + zero per group, by turning a code u into the bf16
number 128 + u with one bit operation and letting the CPU's bf16 dot-product instruction do the rest
(the offset 128 comes back out through each group's sum of x; see the C++ file for the algebra). It
is an *implementation* of the int4pack layouts, not a new format: the same scales and zeros, rounded
the same way, so decoded tokens match torch's kernel up to fp32 summation order.

It runs only where it can: an x86 CPU whose flags include avx512_bf16 (Zen 4, Sapphire Rapids and
newer), a C++ compiler (the one torch.compile uses on a CPU), bf16 or fp32 activations (fp32: each
activation split into two bf16 halves, both multiplied by the codes decoded once), out_features % 16 == 0.
It is compiled once per machine, on first use, into the package's cache folder. Anywhere else
(or with CS336_INT4_KERNEL=torch, or inside `torch_kernel_only()`) int4 layers run torch's kernel,
announced once when the build fails.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

from ...device import cpu_has_amx
from ...quantization.kernels import LINEAR, Int4Kernel
from .cpu_attention import build, cpu_supports

NAME = "cs336 avx512-bf16"                   # how `kernel_summary` names it
# Rows (tokens x batch) up to which this kernel beats dequantizing through `compile_dense_prefill` and
# a dense bf16 matmul: it pays the cheap decoding once per row, the dense route a full pass over the
# weight per call, so it wins a 128-token prefill and the two cross a few hundred rows on.
DENSE_ROWS = 512
# ... except where the CPU has AMX: there the dense route's bf16 matmul runs on AMX tiles and wins
# sooner: on SmolLM2's exact-int4 prefill, alternated in one process, ours is ahead for a few dozen rows,
# about even near 64 and behind from there on, at 1 and 2 threads.
DENSE_ROWS_AMX = 64


def dense_rows() -> int:
    """Rows above which an int4 layer on this kernel dequantizes and runs a dense matmul, on this CPU."""
    return DENSE_ROWS_AMX if cpu_has_amx() else DENSE_ROWS


_enabled = os.environ.get("CS336_INT4_KERNEL", "").strip().lower() not in ("torch", "0", "off")


def why_unavailable() -> str | None:
    """None when the kernel runs here (building our CPU kernels if need be), else why it does not."""
    return build()


def available(out_features: int, in_features: int, group_size: int, device: torch.device,
              dtype: torch.dtype) -> bool:
    """Whether an int4pack layer of this shape runs our kernel here (building it on the first yes)."""
    if not (_enabled and device.type == "cpu" and dtype == torch.bfloat16 and out_features % 16 == 0
            and in_features % 32 == 0 and group_size % 32 == 0):
        return False
    reason = build()
    if reason is not None:
        _announce(reason)
    return reason is None


@functools.cache
def _announce(reason: str) -> None:
    if cpu_supports() is None:   # the CPU could run it: a failed build is worth a word (once)
        warnings.warn(f"int4 layers use torch's kernel: {reason}", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def torch_kernel_only():
    """Layers built or moved inside run torch's int4pack kernel (for side-by-side comparisons)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def pack(unsigned: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes u (N, K) in [0, 15] and the int4pack (scale, zero) pairs (K/g, N, 2) -> our layout:
    codes (N/16, K/8, 32) int16 (in word 2i+e of chunk q, nibble j is u[i, 8q + 2j + e]) and
    sz (N/16, K/g, 2, 16) in the pairs' dtype (per block of 16 rows: the scales, then the zeros).
    Builds the kernel first if need be (RuntimeError, saying why, where it cannot run)."""
    if (reason := build()) is not None:
        raise RuntimeError(f"our int4 kernel cannot run here: {reason}")
    N, K = unsigned.shape
    u = unsigned.to(torch.int32).view(N // 16, 16, K // 8, 4, 2).permute(0, 2, 1, 4, 3)   # block, q, i, e, j
    words = u[..., 0] | u[..., 1] << 4 | u[..., 2] << 8 | u[..., 3] << 12                  # (N/16, K/8, 16, 2)
    words = words.reshape(N // 16, K // 8, 32)
    codes = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)   # the same 16 bits, signed
    sz = pairs.view(pairs.shape[0], N // 16, 16, 2).permute(1, 0, 3, 2).contiguous()
    return codes, sz


def matmul(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, split: bool = True) -> torch.Tensor:
    """x (M, K) bf16 -> x @ W^T (M, N) bf16, with W in `pack`'s layout; x fp32 -> fp32, x multiplied as
    two bf16 halves hi + lo (split: close to an fp32 matmul) or rounded once to bf16 (split=False).
    Each row of the result is the same whatever the other rows of x are (batch invariant)."""
    return torch.ops.cs336.int4_gemv(x, codes, sz, split)


def _usable() -> bool:
    return _enabled and why_unavailable() is None


# What the core's int4 layers call (`quantization.kernels.LINEAR`): `matmul` itself on the per-token path.
KERNEL = Int4Kernel(runs=available, pack=pack, matmul=matmul, max_rows=dense_rows, usable=_usable)


def register() -> str:
    """Add this kernel to the core's int4 linear registry under `NAME` (idempotent); int4 layers packed
    from now on take it where it runs. Returns the name."""
    LINEAR.register(NAME, KERNEL)
    return NAME


__all__ = ["DENSE_ROWS", "DENSE_ROWS_AMX", "KERNEL", "NAME", "available", "cpu_supports", "dense_rows", "matmul",
           "pack", "register", "torch_kernel_only", "why_unavailable"]
