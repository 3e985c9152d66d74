"""Where a benchmark ran, and how much memory a run took at its peak.

`describe_machine` records what a reader needs to judge a number: CPU model, cores, the threads torch
used, the load average, torch's version and the device. `PeakMemory` measures one run's peak: the CUDA
caching allocator's peak on a GPU; on a CPU the process's peak resident set (Linux's VmHWM, reset at
the start of the run where /proc/self/clear_refs allows it, else the process's peak so far).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import torch

from .._openmp import wait_policy


def cpu_model() -> str:
    """The CPU's model name (lscpu, else /proc/cpuinfo, else platform)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        match = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if match:
            return match.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def describe_machine(device: torch.device) -> dict:
    d = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
         "omp_wait_policy": wait_policy(), "load_avg": load_avg(), "torch": torch.__version__,
         "python": sys.version.split()[0], "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        d["gpu"] = torch.cuda.get_device_name(device)
        d["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return d


def _status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (VmHWM: peak resident set, VmRSS: resident set now) in bytes."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s*(\d+)\s*kB", f.read(), re.M)
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def _vm_hwm_bytes() -> int | None:
    return _status_bytes("VmHWM")


def _reset_vm_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # "5": reset the peak resident set size to the current one
        return True
    except OSError:
        return False


class PeakMemory:
    """`with PeakMemory(device) as peak: ...` then `peak.result()`: {"cuda_peak_bytes"} on a GPU,
    {"rss_start_bytes", "rss_peak_bytes", "rss_peak_is_per_run"} on a CPU (None where the OS does not
    tell): the resident set when the run started (every model the process holds) and its peak during
    the run, so the difference is what the run itself added (KV pool, activations, allocator)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.values: dict = {}

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.values["rss_start_bytes"] = _status_bytes("VmRSS")
            self.values["rss_peak_is_per_run"] = _reset_vm_hwm()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.values["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            self.values["rss_peak_bytes"] = _vm_hwm_bytes()
        return False

    def result(self) -> dict:
        return dict(self.values)


__all__ = ["PeakMemory", "cpu_model", "describe_machine", "load_avg"]
