"""Timing helpers every benchmark shares: device sync, medians, and a thread-count context.

Wall-clock timings on a shared CPU are noisy: time the work alone (synchronise the device first),
repeat it, and report the median; compare variants side by side in one run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch


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
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int (a thread count), got {n!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS does not report it."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@contextlib.contextmanager
def busy_cpu(processes: int = 1):
    """Run the body while `processes` Python busy loops hold a core each: the machine other people's
    jobs make. The loops are this process's children and are ended (by their pid) on exit."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise ValueError(f"processes must be a non-negative int, got {processes!r}")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.2)   # let the scheduler see them
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()
