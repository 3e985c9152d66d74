"""Quantization: fewer bits per weight (and per cached key/value), so memory-bound decode moves fewer
bytes. From one number (scale, zero point) to a quantized `TransformerLM`.

core       quantize / dequantize, scale and zero point (symmetric absmax, affine min/max),
           per-tensor / per-channel / per-group
packing    pack_int4 / unpack_int4 (two per byte), dense b-bit packing
fp8        e4m3 / e5m2 round trips, ranges from torch.finfo
llm_int8   vector-wise int8 matmul with outlier decomposition (Dettmers et al. 2022)
gptq       Hessian-aware column-by-column quantization with error feedback (Frantar et al. 2023)
awq        activation-aware per-channel scaling (Lin et al. 2024)
qat        fake quantization + straight-through estimator fine-tuning
kernels    torch's int4pack / int8pack matmuls on packed codes (bf16 activations): the fast path, chosen
           once per layer; grouped int8 as two int4 planes; slow fallbacks announced once; `LINEAR`, the
           registry of int4 matmuls (the workshop adds its CPU kernel there)
linear     QuantizedLinear / Fp8Linear / LLMInt8Linear storing real low-bit tensors; model_nbytes
model      quantize_model(model, method, bits, group_size, calibration)
kv         QuantizedKVCache (int8 / fp8 per-token scales) and quantize_kv_cache
gguf_exact a GGUF model on its own published Q4_1 / Q8_0 blocks: load_pretrained(name, weights="gguf-exact")
"""

from .awq import AWQResult, awq_quantize, awq_search_scales
from .core import (GRANULARITIES, SUPPORTED_BITS, QuantizedTensor, compute_scale_zero_point, dequantize,
                   fake_quantize, qrange, quantize, quantize_tensor)
from .gguf_exact import exact_linear, gguf_exact_model
from .fp8 import FP8_DTYPES, dequantize_fp8, fp8_range, fp8_round_trip, quantize_fp8
from .gptq import GPTQResult, gptq_quantize, hessian_from_inputs, layer_output_error
from .kv import QuantizedKVCache, quantize_kv_cache
from .linear import Fp8Linear, LLMInt8Linear, QuantizedLinear, model_nbytes
from .kernels import (KERNELS, PackedWeight, SlowKernelWarning, pack_weight, packed_layout, packed_matmul,
                      packed_unsupported_reason)
from .llm_int8 import (absmax_int8, count_activation_outliers, llm_int8_matmul, outlier_columns, planted_outlier_demo,
                       vectorwise_int8_matmul)
from .model import (METHODS, QuantizedEmbedding, capture_linear_inputs, quantize_model, set_quantized_kernel,
                    slow_layers)
from .packing import pack_bits, pack_int4, unpack_bits, unpack_int4
from .qat import FakeQuantLinear, qat_finetune, ste_fake_quantize

__all__ = [
    "AWQResult", "FP8_DTYPES", "KERNELS", "PackedWeight", "pack_weight", "packed_layout", "packed_matmul",
    "packed_unsupported_reason", "set_quantized_kernel", "SlowKernelWarning", "slow_layers", "exact_linear",
    "gguf_exact_model",
    "FakeQuantLinear", "Fp8Linear", "GPTQResult", "GRANULARITIES", "LLMInt8Linear",
    "METHODS", "QuantizedEmbedding", "QuantizedKVCache", "QuantizedLinear", "QuantizedTensor", "SUPPORTED_BITS",
    "absmax_int8", "awq_quantize", "capture_linear_inputs", "awq_search_scales", "compute_scale_zero_point",
    "count_activation_outliers", "dequantize",
    "dequantize_fp8", "fake_quantize", "fp8_range", "fp8_round_trip", "gptq_quantize", "hessian_from_inputs",
    "layer_output_error", "llm_int8_matmul", "model_nbytes", "outlier_columns", "pack_bits", "pack_int4",
    "planted_outlier_demo", "qat_finetune", "qrange", "quantize", "quantize_fp8", "quantize_kv_cache",
    "quantize_model", "quantize_tensor", "ste_fake_quantize", "unpack_bits", "unpack_int4",
    "vectorwise_int8_matmul",
]
