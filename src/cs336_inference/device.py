"""Where the library runs: pick a device and dtype, and make runs reproducible.

CPU first (fp32: the CPUs we teach on have no fast bf16 matmul), CUDA when present (bf16).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from . import _checks

_KNOWN = ("cuda", "mps", "cpu")


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """Return `prefer` if given and available, else the best available: cuda, then mps, then cpu."""
    if prefer is not None:
        _checks.instance("prefer", prefer, (str, torch.device), "a str, torch.device or None")
        try:
            device = torch.device(prefer)
        except RuntimeError:
            device = None
        if device is None or device.type not in _KNOWN:
            raise ValueError(f"prefer={str(prefer)!r} is not a supported device type; allowed: {_KNOWN}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("prefer='cuda' but no CUDA device is available")
        if device.type == "mps" and not (torch.backends.mps.is_available()):
            raise ValueError("prefer='mps' but MPS is not available")
        return device
    env = os.environ.get("CS336_DEVICE")
    if env:
        return get_device(env)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the inference default), fp32 on the CPU (no fast bf16 kernels here)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU `torch.Generator` seeded the same way."""
    _checks.non_negative_int("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
