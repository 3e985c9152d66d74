"""Accounting: FLOPs, bytes and arithmetic intensity, numerically (`formulas`) and symbolically
(`symbolic`, sympy); datasheet `hardware`; real `model_shapes`; a `roofline` measured on this machine.
"""

from . import symbolic
from .communication import allreduce_bytes_per_step, ring_allreduce_seconds, tensor_parallel_step_seconds
from .formulas import (TransformerPerformanceStats, decode_step_bytes, forward_flops, kv_cache_bytes,
                       kv_cache_bytes_per_token, max_batch_size, num_parameters, transformer_performance_stats,
                       weight_bytes, with_kv_heads)
from .hardware import HARDWARE, PRECISION_BYTES, HardwareSpec, get_hardware, precision_bytes
from .model_shapes import REAL_MODELS, ModelShape, get_model_shape
from .roofline import (HardwareMeasurement, RooflineSweep, measure_hardware, measure_matmul_flops,
                       measure_memory_bandwidth, predicted_flops, roofline_sweep)

__all__ = [
    "allreduce_bytes_per_step", "ring_allreduce_seconds", "tensor_parallel_step_seconds",
    "HARDWARE", "HardwareMeasurement", "HardwareSpec", "ModelShape", "PRECISION_BYTES", "REAL_MODELS",
    "RooflineSweep", "TransformerPerformanceStats", "decode_step_bytes", "forward_flops", "get_hardware",
    "get_model_shape", "kv_cache_bytes", "kv_cache_bytes_per_token", "max_batch_size", "measure_hardware",
    "measure_matmul_flops", "measure_memory_bandwidth", "num_parameters", "precision_bytes", "predicted_flops",
    "roofline_sweep", "symbolic", "transformer_performance_stats", "weight_bytes", "with_kv_heads",
]
