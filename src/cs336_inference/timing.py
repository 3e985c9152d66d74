"""Timing helpers every benchmark shares: device sync, medians, and a thread-count context.

Wall-clock timings on a shared CPU are noisy: time the work alone (synchronise the device first),
repeat it, and report the median; compare variants side by side in one run.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from . import _checks


def sync_device(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall-clock seconds of `fn()` over `repeats` runs after `warmup` runs (device-synchronised)."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def num_threads(n: int):
    """Run the body with torch using `n` intra-op threads, then restore the previous count."""
    _checks.positive_int("n", n)
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
