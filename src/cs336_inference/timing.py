"""Timing helpers every benchmark shares: device sync, medians, a thread-count context, a busy core, and
the peak memory of a run (`PeakMemory`).

Wall-clock timings on a shared CPU are noisy: time the work alone (synchronise the device first),
repeat it, and report the median; compare variants side by side in one run.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import subprocess
import sys
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


def alternating_timings(fns: dict, repeats: int = 3, warmup: int = 1, device: torch.device | None = None,
                        clock: str = "wall") -> dict[str, dict]:
    """Time every function of `fns` ({name: fn}) `repeats` times, alternating A, B, A, B, ... so that a
    change of machine load during the run hits every variant alike (after `warmup` untimed rounds).

    Returns {name: {"median", "min", "max", "times"}} in seconds. clock: "wall" (time.perf_counter) or
    "cpu" (this process's CPU time, time.process_time: with one thread, the time the work ran rather
    than the time it waited for a core another process held).
    """
    if not isinstance(fns, dict) or not fns or not all(callable(f) for f in fns.values()):
        raise ValueError(f"fns must be a non-empty dict of name -> callable, got {fns!r:.80}")
    _checks.positive_int("repeats", repeats)
    _checks.non_negative_int("warmup", warmup)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    if clock not in clocks:
        raise ValueError(f"clock must be one of {sorted(clocks)}, got {clock!r}")
    now = clocks[clock]
    device = device if device is not None else torch.device("cpu")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(warmup + repeats):
        for name, fn in fns.items():
            sync_device(device)
            t0 = now()
            fn()
            sync_device(device)
            if round_ >= warmup:
                times[name].append(now() - t0)
    return {name: {"median": statistics.median(t), "min": min(t), "max": max(t), "times": t}
            for name, t in times.items()}


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


class PeakMemory:
    """`with PeakMemory(device) as peak: ...` then `peak.result()`: {"cuda_peak_bytes"} on a GPU;
    on a CPU {"rss_start_bytes", "rss_peak_bytes", "rss_peak_is_per_run"} (None where the OS does
    not tell): the resident set when the run started and Linux's peak resident set (VmHWM) during it,
    reset at the start where /proc/self/clear_refs allows (else the process's peak so far)."""

    def __init__(self, device: torch.device):
        self.device, self.values = torch.device(device), {}

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.values["rss_start_bytes"] = rss_bytes()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")   # "5": reset the peak resident set to the current one
                self.values["rss_peak_is_per_run"] = True
            except OSError:
                self.values["rss_peak_is_per_run"] = False
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.values["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            self.values["rss_peak_bytes"] = _status_bytes("VmHWM")
        return False

    def result(self) -> dict:
        return dict(self.values)


def rss_bytes() -> int | None:
    """This process's resident set now (Linux), in bytes; None where the OS does not tell."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (VmHWM: peak resident set, VmRSS: now) in bytes."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s*(\d+)\s*kB", f.read(), re.M)
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None
