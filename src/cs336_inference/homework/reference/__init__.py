"""The reference solution of the homework: every graded function with the signature and docstring a
student implements, each a thin wrapper over the library (where the algorithm lives once).

Plain tensors, numbers and weight dicts in, tensors (or sympy expressions, or numbers) out, as in the
CS336 assignments: nothing here asks a student to reproduce a library object. Letters in shapes: B batch,
S positions already cached (or the key length), T new tokens, D d_model, F d_ff, N query heads, K key/value
heads, H head dim, R rotated (RoPE) dims, C latent dims (MLA), L layers, V vocabulary, I/O input/output
features, g group size. The grader (`pytest tests/graded --impl PACKAGE`) calls these names in PACKAGE;
`python -m cs336_inference homework init DIR` writes the skeleton from these modules (one per area, as in
the student's package; importing them in this order registers every graded name in the skeleton's order).
"""

from .sampling import logits_to_probs, sample_next_token
from .speculative import speculative_accept
from .attention import (RollingKVBuffer, attention_with_kv_cache, grouped_query_attention, mla_absorbed_attention,
                        sliding_window_mask)
from .quantization import (dequantize, gptq_quantize, llm_int8_matmul, pack_int4, quantize, quantize_kv_int8,
                           quantize_tensor, unpack_int4)
from .serving import BlockAllocator, continuous_batching_step, paged_attention
from .accounting import (attention_cost, decode_cost, generation_flops, inference_stats, kv_cache_bytes, matmul_cost,
                         mlp_cost)
from .data import get_batch

__all__ = [
    "logits_to_probs", "sample_next_token",
    "speculative_accept",
    "grouped_query_attention", "attention_with_kv_cache", "mla_absorbed_attention", "sliding_window_mask",
    "RollingKVBuffer",
    "quantize", "dequantize", "quantize_tensor", "pack_int4", "unpack_int4", "quantize_kv_int8", "llm_int8_matmul",
    "gptq_quantize",
    "BlockAllocator", "paged_attention", "continuous_batching_step",
    "kv_cache_bytes", "inference_stats", "matmul_cost", "mlp_cost", "attention_cost", "generation_flops",
    "decode_cost",
    "get_batch",
]
