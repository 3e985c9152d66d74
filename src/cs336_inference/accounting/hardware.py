"""Accelerator specs for the lecture's accounting: peak FLOP/s, memory bandwidth, memory size.

Numbers are the vendors' datasheet values for *dense* tensor-core math (the datasheets also print
2x "with sparsity" figures; we never use those). The H100 row is the lecture's: 989e12 bf16 FLOP/s
and 3.35e12 B/s, so its accelerator intensity is 989e12 / 3.35e12 ~ 295 FLOPs per byte.
Memory sizes are in decimal units (80 GB = 80e9 bytes), as the lecture counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _checks

# Bytes per element of each precision name the accounting accepts (int4 packs two per byte).
PRECISION_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def precision_bytes(precision: str) -> float:
    """Bytes per element of `precision` ('fp32', 'bf16', 'fp16', 'fp8', 'int8', 'int4')."""
    if not isinstance(precision, str) or precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; allowed: {sorted(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: peak dense FLOP/s (bf16 unless stated), bandwidth (B/s), memory (bytes)."""

    name: str
    peak_flops: float                 # FLOP/s of the default compute precision (bf16 tensor cores)
    memory_bandwidth: float           # bytes/s of the main memory (HBM)
    memory_bytes: float | None        # capacity in bytes (None: unknown, e.g. a measured CPU)
    source: str
    # FLOP/s for other compute precisions (fp8 tensor cores, TF32). Weight-only formats (int8,
    # int4) are dequantized and multiplied in bf16, so they fall back to `peak_flops`.
    flops_by_precision: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        for attr in ("peak_flops", "memory_bandwidth"):
            _checks.finite_positive_float(attr, getattr(self, attr))
        if self.memory_bytes is not None:
            _checks.finite_positive_float("memory_bytes", self.memory_bytes)
        for precision in self.flops_by_precision:
            precision_bytes(precision)

    @property
    def accelerator_intensity(self) -> float:
        """FLOPs per byte at which compute time equals memory time (the roofline's ridge point)."""
        return self.peak_flops / self.memory_bandwidth

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s when computing in `precision` (bf16 path unless the table says otherwise)."""
        precision_bytes(precision)
        return self.flops_by_precision.get(precision, self.peak_flops)


_NVIDIA = "NVIDIA datasheet, dense (no sparsity)"
HARDWARE: dict[str, HardwareSpec] = {
    "A100": HardwareSpec(
        "A100", peak_flops=312e12, memory_bandwidth=2.039e12, memory_bytes=80e9,
        source=f"{_NVIDIA}: A100 SXM 80GB, bf16 312 TFLOP/s, HBM2e 2,039 GB/s "
               "(https://www.nvidia.com/en-us/data-center/a100/)",
        flops_by_precision={"fp32": 156e12}),          # TF32 tensor cores; no fp8 on Ampere
    "H100": HardwareSpec(
        "H100", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9,
        source=f"{_NVIDIA}: H100 SXM, bf16 989 TFLOP/s, HBM3 3.35 TB/s, 80 GB "
               "(https://www.nvidia.com/en-us/data-center/h100/); the values CS336 lecture 10 uses",
        flops_by_precision={"fp8": 1979e12, "fp32": 494e12}),
    "H200": HardwareSpec(
        "H200", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9,
        source=f"{_NVIDIA}: H200 SXM, bf16 989 TFLOP/s, HBM3e 4.8 TB/s, 141 GB "
               "(https://www.nvidia.com/en-us/data-center/h200/)",
        flops_by_precision={"fp8": 1979e12, "fp32": 494e12}),
    "B200": HardwareSpec(
        "B200", peak_flops=2.25e15, memory_bandwidth=8e12, memory_bytes=180e9,
        source=f"{_NVIDIA}: HGX B200 per GPU (1/8 of the 8-GPU board), bf16 2.25 PFLOP/s, "
               "HBM3e 8 TB/s, 180 GB (https://www.nvidia.com/en-us/data-center/hgx/)",
        flops_by_precision={"fp8": 4.5e15, "fp32": 1.125e15}),
}


def get_hardware(hardware: str | HardwareSpec) -> HardwareSpec:
    """A `HardwareSpec` from a name in `HARDWARE` (case-insensitive) or a spec passed through."""
    if isinstance(hardware, HardwareSpec):
        return hardware
    if isinstance(hardware, str):
        for name, spec in HARDWARE.items():
            if name.lower() == hardware.lower():
                return spec
    raise ValueError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE)} "
                     "(or pass a HardwareSpec, e.g. measure_hardware(device).to_spec())")
