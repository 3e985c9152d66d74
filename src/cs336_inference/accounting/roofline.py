"""Measuring this machine: memory bandwidth and peak matmul throughput (the roofline's two roofs).

Williams, Waterman & Patterson 2009 (Roofline). Numbers are medians of repeated runs: the machines
we teach on are shared and noisy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .. import _checks
from ..device import cpu_model, default_dtype, get_device
from ..timing import median_seconds
from .hardware import HardwareSpec


def measure_memory_bandwidth(device=None, nbytes: int = 512 * 2**20, repeats: int = 7, empty=None) -> float:
    """Streaming read bandwidth in bytes/s: time a reduction over an `nbytes` fp32 tensor.

    empty(numel, dtype): allocates the CPU buffer (default `torch.empty`). The workshop passes
    `huge_pages.empty`, which puts it on 2 MB pages where Linux grants them, as `tune_for_cpu` puts the
    weights: on 4 KB pages a reduction also spends time walking page tables."""
    return bandwidth_probe(device, nbytes, repeats, empty)()


def bandwidth_probe(device=None, nbytes: int = 512 * 2**20, repeats: int = 3, empty=None):
    """`measure_memory_bandwidth` as a function to call again and again on one buffer, allocated once:
    a benchmark samples the bandwidth right beside each timing it compares with it, because on a
    shared host the bandwidth one VM gets can change by half within seconds."""
    device = get_device(device)
    _checks.integer("nbytes", nbytes, 2**20, allowed="an int >= 1 MiB (larger than the caches to mean anything)")
    _checks.positive_int("repeats", repeats)
    if empty is not None and not callable(empty):
        raise TypeError(f"empty must be a function (numel, dtype) -> tensor, or None, got {type(empty).__name__}")
    if device.type == "cpu":
        x = (empty or torch.empty)(nbytes // 4, dtype=torch.float32).fill_(1.0)
    else:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return lambda: x.nbytes / median_seconds(lambda: x.sum(), device, repeats)


def measure_matmul_flops(device=None, n: int = 2048, dtype: torch.dtype | None = None, repeats: int = 5) -> float:
    """Peak matmul throughput in FLOP/s: time an n x n x n matmul (2 n^3 FLOPs)."""
    device = get_device(device)
    _checks.integer("n", n, 64)
    _checks.positive_int("repeats", repeats)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds


# --- the machine as one record ----------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
    return device.type


@dataclass(frozen=True)
class HardwareMeasurement:
    """This machine's two roofs, measured: peak matmul FLOP/s and streaming memory bandwidth."""

    device: str                 # e.g. "cpu (AMD EPYC ..., 2 threads)" or "NVIDIA H200"
    dtype: str                  # the matmul precision the peak was measured in
    peak_flops: float
    memory_bandwidth: float
    flops_unit: str = "FLOP/s"
    bandwidth_unit: str = "B/s"
    intensity_unit: str = "FLOP/B"

    @property
    def accelerator_intensity(self) -> float:
        """The ridge point: FLOPs per byte above which a kernel can be compute-bound here."""
        return self.peak_flops / self.memory_bandwidth

    def to_spec(self) -> HardwareSpec:
        """As a `HardwareSpec`, so `transformer_performance_stats` can predict for this machine."""
        precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, "bf16")
        return HardwareSpec(f"measured {self.device}", peak_flops=self.peak_flops,
                            memory_bandwidth=self.memory_bandwidth, memory_bytes=None,
                            source=f"measured by roofline.measure_hardware ({self.dtype} matmul, fp32 sum)",
                            flops_by_precision={precision: self.peak_flops})

    def summary(self) -> str:
        return (f"{self.device}: peak {self.peak_flops / 1e9:,.1f} GFLOP/s ({self.dtype} matmul), "
                f"bandwidth {self.memory_bandwidth / 1e9:,.1f} GB/s, "
                f"accelerator intensity {self.accelerator_intensity:,.1f} {self.intensity_unit}")


def measure_hardware(device=None, dtype: torch.dtype | None = None, quick: bool = False,
                     empty=None) -> HardwareMeasurement:
    """Measure peak matmul FLOP/s and memory bandwidth of `device` (cpu, cuda, mps; default: best).

    quick: smaller problems and fewer repeats (a fraction of a second), for the lecture; the full
    measurement streams 512 MiB and times 2048^3 (CPU) / 8192^3 (CUDA) matmuls.
    dtype: the matmul precision (default: bf16 on CUDA, fp32 elsewhere).
    """
    device = get_device(device)
    _checks.boolean("quick", quick)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    dtype = dtype or default_dtype(device)
    big = device.type == "cuda"
    nbytes = (128 if quick else 512) * 2**20 * (4 if big else 1)
    n = (4096 if quick else 8192) if big else (1024 if quick else 2048)
    bandwidth = measure_memory_bandwidth(device, nbytes=nbytes, repeats=3 if quick else 7, empty=empty)
    flops = measure_matmul_flops(device, n=n, dtype=dtype, repeats=3 if quick else 5)
    return HardwareMeasurement(_device_name(device), str(dtype).removeprefix("torch."), flops, bandwidth)


# --- the roofline sweep -----------------------------------------------------------------------


def predicted_flops(intensity: float, peak_flops: float, memory_bandwidth: float) -> float:
    """The roofline: min(peak, intensity * bandwidth) FLOP/s."""
    return min(peak_flops, intensity * memory_bandwidth)


@dataclass
class RooflineSweep:
    """Y = X (B x D) @ W (D x F) for each B: measured time, achieved FLOP/s, the roofline's prediction."""

    hardware: HardwareMeasurement
    d_in: int
    d_out: int
    dtype: str
    batch_sizes: list[int]
    seconds: list[float]
    intensity: list[float]           # 2BDF / (e (BD + DF + BF)) FLOPs per byte
    achieved_flops: list[float]
    predicted_flops: list[float]

    @property
    def ridge_batch_size(self) -> float:
        """B at which intensity(B) * bandwidth = peak (where the two roofs meet for this W)."""
        e = _element_size(self.dtype)
        D, F, a = self.d_in, self.d_out, self.hardware.accelerator_intensity
        # 2BDF = a e (BD + DF + BF)  =>  B = a e D F / (2 D F - a e (D + F))
        denom = 2 * D * F - a * e * (D + F)
        return float("inf") if denom <= 0 else a * e * D * F / denom

    def knee_batch_size(self, fraction: float = 0.8) -> int | None:
        """Smallest measured B that reaches `fraction` of the best achieved FLOP/s (the practical knee)."""
        best = max(self.achieved_flops)
        return next((b for b, f in zip(self.batch_sizes, self.achieved_flops) if f >= fraction * best), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["hardware"]["accelerator_intensity"] = self.hardware.accelerator_intensity
        data["ridge_batch_size"] = self.ridge_batch_size
        data["knee_batch_size_80pct"] = self.knee_batch_size()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "RooflineSweep":
        """The sweep back from `to_dict()` (a benchmark's JSON), to plot it again."""
        fields = {k: v for k, v in data.items() if k not in ("ridge_batch_size", "knee_batch_size_80pct")}
        hardware = {k: v for k, v in fields.pop("hardware").items() if k != "accelerator_intensity"}
        return cls(HardwareMeasurement(**hardware), **fields)


def _element_size(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def roofline_sweep(device=None, batch_sizes=tuple(2**i for i in range(11)), d_in: int | None = None,
                   d_out: int | None = None, dtype: torch.dtype | None = None, repeats: int = 5,
                   hardware: HardwareMeasurement | None = None) -> RooflineSweep:
    """Time Y = X @ W for B in `batch_sizes` with a W larger than the caches; compare to the roofline.

    Default W: 4096 x 4096 fp32 on the CPU (64 MiB, twice a 32 MiB L3), 8192 x 8192 bf16 on CUDA
    (128 MiB, more than the L2). `hardware` (default: measured now) gives the two roofs.
    """
    device = get_device(device)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    dtype = dtype or default_dtype(device)
    big = 8192 if device.type == "cuda" else 4096
    d_in, d_out = d_in or big, d_out or big
    _checks.integer("d_in", d_in, 64)
    _checks.integer("d_out", d_out, 64)
    batch_sizes = list(batch_sizes)
    if not batch_sizes:
        raise ValueError("batch_sizes must be a non-empty list of positive ints, got []")
    for b in batch_sizes:
        _checks.positive_int("batch_sizes[i]", b)
    _checks.positive_int("repeats", repeats)
    if hardware is not None:
        _checks.instance("hardware", hardware, HardwareMeasurement,
                         "a HardwareMeasurement (from measure_hardware) or None")
    hardware = hardware or measure_hardware(device, dtype=dtype)
    w = torch.randn(d_in, d_out, device=device, dtype=dtype)
    e = w.element_size()
    seconds, intensity, achieved, predicted = [], [], [], []
    for b in batch_sizes:
        x = torch.randn(b, d_in, device=device, dtype=dtype)
        t = median_seconds(lambda x=x: x @ w, device, repeats)
        flops = 2 * b * d_in * d_out
        ai = flops / (e * (b * d_in + d_in * d_out + b * d_out))
        seconds.append(t)
        intensity.append(ai)
        achieved.append(flops / t)
        predicted.append(predicted_flops(ai, hardware.peak_flops, hardware.memory_bandwidth))
    return RooflineSweep(hardware, d_in, d_out, str(dtype).removeprefix("torch."), batch_sizes, seconds,
                         intensity, achieved, predicted)
