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

from .layers import post_norm_block, qk_norm_attention, rmsnorm, swiglu
from .sampling import logits_to_probs, sample_next_token
from .generation import greedy_generate
from .speculative import greedy_verify, residual_distribution, speculative_accept
from .attention import (ContiguousKVCache, RollingKVCache, attention_with_kv_cache, grouped_query_attention,
                        mla_absorbed_attention, mla_attention, sliding_window_mask)
from .alternatives import fixed_state_step
from .quantization import (awq_search_scales, dequantize, gptq_quantize, llm_int8_matmul, pack_int4, quantize,
                           quantize_kv_int8, quantize_tensor, ste_fake_quantize, unpack_int4)
from .serving import (BlockAllocator, KVCacheManager, continuous_batching_run, continuous_batching_step,
                      paged_attention, postprocess_step)
from .accounting import (attention_cost, decode_cost, generation_flops, inference_stats, kv_cache_bytes,
                         latent_kv_cache_bytes, matmul_cost, mlp_cost, window_kv_cache_bytes)
from .data import bits_per_byte, get_batch
from .compression import distillation_loss, gqa_heads_to_keep, structures_to_keep

__all__ = [
    "rmsnorm", "swiglu", "post_norm_block", "qk_norm_attention",
    "logits_to_probs", "sample_next_token",
    "greedy_generate",
    "speculative_accept", "residual_distribution", "greedy_verify",
    "grouped_query_attention", "attention_with_kv_cache", "mla_absorbed_attention", "mla_attention",
    "ContiguousKVCache", "sliding_window_mask", "RollingKVCache",
    "fixed_state_step",
    "quantize", "dequantize", "quantize_tensor", "pack_int4", "unpack_int4", "quantize_kv_int8", "llm_int8_matmul",
    "gptq_quantize", "awq_search_scales", "ste_fake_quantize",
    "BlockAllocator", "KVCacheManager", "paged_attention", "continuous_batching_step", "continuous_batching_run",
    "postprocess_step",
    "kv_cache_bytes", "window_kv_cache_bytes", "latent_kv_cache_bytes", "inference_stats", "matmul_cost", "mlp_cost",
    "attention_cost", "generation_flops", "decode_cost",
    "get_batch", "bits_per_byte",
    "structures_to_keep", "gqa_heads_to_keep", "distillation_loss",
]
