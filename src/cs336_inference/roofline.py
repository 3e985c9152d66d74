"""Measuring this machine: memory bandwidth and peak matmul throughput (the roofline's two roofs).

Williams, Waterman & Patterson 2009 (Roofline). Numbers are medians of repeated runs: the machines
we teach on are shared and noisy.
"""

from __future__ import annotations

import statistics
import time

import torch

from .device import get_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_memory_bandwidth(device=None, nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Streaming read bandwidth in bytes/s: time a reduction over an `nbytes` fp32 tensor."""
    device = get_device(device)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 2**20:
        raise ValueError(f"nbytes must be an int >= 1 MiB (larger than the caches to mean anything), got {nbytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = _median_seconds(lambda: x.sum(), device, repeats)
    return x.nbytes / seconds


def measure_matmul_flops(device=None, n: int = 2048, dtype: torch.dtype | None = None, repeats: int = 5) -> float:
    """Peak matmul throughput in FLOP/s: time an n x n x n matmul (2 n^3 FLOPs)."""
    device = get_device(device)
    if isinstance(n, bool) or not isinstance(n, int) or n < 64:
        raise ValueError(f"n must be an int >= 64, got {n!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds
