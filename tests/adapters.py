"""The single indirection through which the tests reach graded functions (the CS336 pattern).

Two kinds of adapter live here:
- graded adapters (first block): each `run_NAME` / `make_NAME` calls NAME in the implementation under
  test, resolved at call time by `implementation.get` (the reference solution by default; a student's
  package with `pytest --impl SPEC` or CS336_INFERENCE_IMPL=SPEC). Plain tensors, numbers and weight
  dicts in, tensors out. The names are the registry's (`cs336_inference.homework.registry`): one adapter
  per graded name, nothing else in this block;
- library helpers (the rest): build models, caches, configs and run library code the tests need around
  the graded calls (and the library's own tests). They always use the library, never the student's code.
Group adapters by topic; add new ones at the end of their topic's block.
"""

from __future__ import annotations

import torch

import guard
import implementation
import sandbox

from cs336_inference.device import default_dtype, get_device, seed_everything
from cs336_inference.homework.registry import FORMER_NAMES
from cs336_inference.generation import decode_one_token, generate, prefill
from cs336_inference.model import (ByteTokenizer, ModelConfig, RMSNorm, SwiGLU, TransformerLM, apply_rope, checkpoints,
                                   rope_angles, scaled_dot_product_attention)


def _graded(name: str, returns="any"):
    """NAME in the implementation under test, as a guarded callable (tests/guard.py; a student's package
    runs in a process of its own, tests/sandbox.py): it raises "not implemented: NAME" if the package has
    none, and its result must be of the kind `returns` names
    ("tensor", "int", "number", "bool", "dict", "list", a tuple of those, or {member: kind} for an object).
    A package written to an older skeleton may define NAME under its former name (registry.FORMER_NAMES)."""
    former = [old for old, new in FORMER_NAMES.items() if new == name]

    def call(graded_name, args):
        if implementation.isolated():                  # a student's package: in its worker process
            return sandbox.call(graded_name, args, returns=returns)
        fn = guard.call(graded_name, implementation.get, (graded_name,), returns="raw")
        return guard.call(graded_name, fn, guard.private_copies(args), returns=returns)

    def graded_call(*args):
        try:
            return call(name, args)
        except implementation.NotImplementedGraded as missing:
            if not former or f"defines no {name}" not in str(missing):
                raise
            try:
                return call(former[0], args)
            except implementation.NotImplementedGraded as also_missing:
                if f"defines no {former[0]}" in str(also_missing):
                    raise missing from None        # under neither name: report the current one
                raise
    return graded_call


def watching(watcher_class):
    """A context in which every graded call runs under `watcher_class()` (a torch dispatch or function mode of a
    module in tests/, with `findings()` and `merge(findings)`, e.g. write_checks.DuplicateWrites); yields the
    instance. With a student's package the mode runs in the worker process, around each graded call."""
    if implementation.isolated():
        return sandbox.watching(watcher_class())
    return watcher_class()


def each(adapter, calls) -> list:
    """[adapter(*args) for args in calls], in order. With a student's package the graded calls travel to its
    worker in one message and run there one after another, exactly as they would one by one (tests/sandbox.py
    `script`): for a test that makes thousands of them. `adapter` makes one graded call and returns its result
    unchanged (run_speculative_accept, a method of a graded object such as `manager.ref_count`)."""
    if implementation.isolated():
        return sandbox.each(adapter, calls)
    return [adapter(*args) for args in calls]


def script(*steps) -> list:
    """[step() for step in steps], in order: each step makes one graded call or reads one attribute of a graded
    object (`functools.partial(manager.free, 3)`, `lambda: manager.num_free_blocks`) and returns its result
    unchanged; no step's arguments may depend on another step's result. With a student's package the steps travel
    to its worker in one message, as `each` does for calls of one function: for a test that checks a graded
    object's state after each of many operations."""
    if implementation.isolated():
        return sandbox.script(steps)
    return [step() for step in steps]


T, T2, T3 = "tensor", ("tensor", "tensor"), ("tensor", "tensor", "tensor")


# === graded adapters ==============================================================================
# --- layers ---


def run_rmsnorm(x, weight, eps=1e-5) -> torch.Tensor:
    return _graded("rmsnorm", T)(x, weight, eps)


def run_swiglu(x, w1, w2, w3) -> torch.Tensor:
    return _graded("swiglu", T)(x, w1, w2, w3)


def run_post_norm_block(x, weights, num_heads, eps=1e-5, rope_theta=10000.0) -> torch.Tensor:
    """x (B, T, D), the block's assignment-1 weights -> (B, T, D): ln1(x + attn(x)), then ln2(h + ffn(h))."""
    return _graded("post_norm_block", T)(x, weights, num_heads, eps, rope_theta)


def run_qk_norm_attention(x, weights, num_heads, eps=1e-6, rope_theta=10000.0) -> torch.Tensor:
    """x (B, T, D), weights q/k/v/output_proj and q_norm/k_norm gains -> (B, T, D)."""
    return _graded("qk_norm_attention", T)(x, weights, num_heads, eps, rope_theta)


# --- sampling ---


def run_logits_to_probs(logits, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    return _graded("logits_to_probs", T)(logits, temperature, top_k, top_p)


def run_sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    return _graded("sample_next_token", T)(logits, temperature, top_k, top_p, generator)


# --- generation ---


def run_greedy_generate(model, prompts, max_new_tokens, stop_tokens=None) -> list[list[int]]:
    return [[guard.check("greedy_generate", t, "int") for t in row]
            for row in _graded("greedy_generate", "list")(model, prompts, max_new_tokens, stop_tokens)]


# --- speculative sampling: the accept/resample rule, the residual, greedy verification ---


def run_speculative_accept(p_draft, q_target, draft_tokens, generator=None) -> tuple[int, int]:
    """p_draft (g, V), q_target (g + 1, V), draft_tokens (g,) -> (num_accepted, next_token)."""
    return _graded("speculative_accept", ("int", "int"))(p_draft, q_target, draft_tokens, generator)


def run_residual_distribution(p_draft, q_target) -> torch.Tensor:
    return _graded("residual_distribution", T)(p_draft, q_target)


def run_greedy_verify(draft_tokens, target_logits) -> tuple[int, int]:
    return _graded("greedy_verify", ("int", "int"))(draft_tokens, target_logits)


# --- attention: GQA, KV cache, MLA, sliding window ---


def run_grouped_query_attention(q, k, v, mask=None) -> torch.Tensor:
    return _graded("grouped_query_attention", T)(q, k, v, mask)


def run_attention_with_kv_cache(x, weights, k_cache, v_cache, num_heads, rope_theta=10000.0):
    """-> (out (B, T, D), k_cache' (B, K, S + T, H), v_cache' (B, K, S + T, H))."""
    return _graded("attention_with_kv_cache", T3)(x, weights, k_cache, v_cache, num_heads, rope_theta)


def run_mla_absorbed_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask=None) -> torch.Tensor:
    return _graded("mla_absorbed_attention", T)(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask)


def run_mla_attention(x, weights, num_heads, rope_theta=10000.0) -> torch.Tensor:
    return _graded("mla_attention", T)(x, weights, num_heads, rope_theta)


KV_CACHE = {"length": "int", "nbytes": "int", "bytes_per_token": "int", "append": T2, "truncate": "any"}


def make_graded_contiguous_kv_cache(batch_size, num_kv_heads, head_dim, max_seq_len):
    """One layer's cache: .length, .nbytes, .bytes_per_token, .append(k, v) -> (keys, values), .truncate(n)."""
    return _graded("ContiguousKVCache", KV_CACHE)(batch_size, num_kv_heads, head_dim, max_seq_len)


make_graded_kv_cache = make_graded_contiguous_kv_cache   # deprecated: its former name (graded `KVCache`)


def run_sliding_window_mask(num_new: int, start: int, window: int) -> torch.Tensor:
    return _graded("sliding_window_mask", T)(num_new, start, window)


ROLLING_KV_CACHE = {"length": "int", "nbytes": "int", "append": "any", "context": T2, "truncate": "any"}


def make_graded_rolling_kv_cache(batch_size, num_kv_heads, head_dim, window, capacity):
    """An object with .length, .nbytes, .append(k, v), .context() -> (k, v), .truncate(n)."""
    return _graded("RollingKVCache", ROLLING_KV_CACHE)(batch_size, num_kv_heads, head_dim, window, capacity)


make_rolling_kv_buffer = make_graded_rolling_kv_cache    # deprecated: its former name (graded `RollingKVBuffer`)


# --- alternatives to the Transformer: fixed-state layers ---


def run_fixed_state_step(q, k, v, log_decay, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k (B, N, F), v (B, N, Hv), log_decay (B, N) or None, state (B, N, F, Hv) -> (y, state')."""
    return _graded("fixed_state_step", T2)(q, k, v, log_decay, state)


# --- quantization ---


def run_quantize(x, scale, zero_point=0, bits: int = 8, symmetric: bool = True) -> torch.Tensor:
    return _graded("quantize", T)(x, scale, zero_point, bits, symmetric)


def run_dequantize(q, scale, zero_point=0) -> torch.Tensor:
    return _graded("dequantize", T)(q, scale, zero_point)


def run_quantize_tensor(x, bits=8, symmetric=True, granularity="tensor", group_size=None):
    """-> (codes, scale, zero_point); scale/zero_point are () per tensor, (rows, groups) otherwise."""
    return _graded("quantize_tensor", T3)(x, bits, symmetric, granularity, group_size)


def run_pack_int4(q, signed=True) -> torch.Tensor:
    return _graded("pack_int4", T)(q, signed)


def run_unpack_int4(packed, signed=True) -> torch.Tensor:
    return _graded("unpack_int4", T)(packed, signed)


def run_quantize_kv_int8(x) -> tuple[torch.Tensor, torch.Tensor]:
    return _graded("quantize_kv_int8", T2)(x)


def run_llm_int8_matmul(x, weight, threshold=6.0) -> torch.Tensor:
    return _graded("llm_int8_matmul", T)(x, weight, threshold)


def run_gptq_quantize(weight, inputs, bits=4, group_size=None) -> torch.Tensor:
    """-> the dequantized GPTQ weight W_hat (O, I)."""
    return _graded("gptq_quantize", T)(weight, inputs, bits, group_size)


def run_awq_scales(weight, inputs, bits=4, group_size=None, grid=20) -> torch.Tensor:
    return _graded("awq_search_scales", T)(weight, inputs, bits, group_size, grid)


def run_fake_quantize_ste(w, bits=4, group_size=None) -> torch.Tensor:
    return _graded("ste_fake_quantize", T)(w, bits, group_size)


# --- serving: paged KV memory, continuous batching ---


BLOCK_ALLOCATOR = {"num_free": "int", "allocate": "int", "incref": "any", "free": "bool", "ref_count": "int"}


def make_block_allocator(num_blocks: int, block_size: int):
    """An object with .num_free, .allocate(), .incref(b), .free(b) -> bool, .ref_count(b)."""
    return _graded("BlockAllocator", BLOCK_ALLOCATOR)(num_blocks, block_size)


KV_CACHE_MANAGER = {"num_free_blocks": "int", "allocate": "list", "block_table": "list", "ref_count": "int",
                 "append_needs_block": "bool", "append_slot": "any", "fork": "any", "free": "any"}


def make_graded_kv_cache_manager(num_blocks: int, block_size: int):
    """Block tables over one pool: .allocate(seq, n), .append_slot(seq), .fork(a, b), .free(seq), ..."""
    return _graded("KVCacheManager", KV_CACHE_MANAGER)(num_blocks, block_size)


make_paged_block_manager = make_graded_kv_cache_manager  # deprecated: its former name (graded `BlockManager`)


def run_paged_attention(q, k_pool, v_pool, block_tables, context_lens, query_lens) -> torch.Tensor:
    """q (sum T_b, N, H) over pools (num_blocks, block_size, K, H) -> (sum T_b, N, H)."""
    return _graded("paged_attention", T)(q, k_pool, v_pool, block_tables, context_lens, query_lens)


def run_continuous_batching_step(running, waiting, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                 watermark_blocks) -> dict:
    return _graded("continuous_batching_step", "dict")(running, waiting, num_blocks, block_size, max_num_seqs,
                                               max_num_batched_tokens, watermark_blocks)


def run_continuous_batching_run(requests, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                watermark_blocks) -> list[dict]:
    return _graded("continuous_batching_run", "list")(requests, num_blocks, block_size, max_num_seqs,
                                                      max_num_batched_tokens, watermark_blocks)


def run_postprocess_step(sequences, num_scheduled_tokens, sampled, preempted) -> list[dict]:
    """The sequences (dicts) after one forward: num_computed_tokens, token_ids, finished."""
    return _graded("postprocess_step", "list")(sequences, num_scheduled_tokens, sampled, preempted)


# --- accounting: numeric and symbolic ---


SYMPY2 = ("any", "any")   # (flops, bytes): sympy expressions (any sympy class, or a number)


def run_kv_cache_bytes(batch_size, seq_len, num_layers, num_kv_heads, head_dim, bytes_per_element=2) -> int:
    return _graded("kv_cache_bytes", "number")(batch_size, seq_len, num_layers, num_kv_heads, head_dim,
                                               bytes_per_element)


def run_window_kv_cache_bytes(batch_size, seq_len, num_layers, num_kv_heads, head_dim, window, global_every=None,
                              bytes_per_element=2) -> int:
    return _graded("window_kv_cache_bytes", "number")(batch_size, seq_len, num_layers, num_kv_heads, head_dim,
                                                      window, global_every, bytes_per_element)


def run_latent_kv_cache_bytes(batch_size, seq_len, num_layers, kv_lora_rank, rope_head_dim, bytes_per_element=2):
    return _graded("latent_kv_cache_bytes", "number")(batch_size, seq_len, num_layers, kv_lora_rank, rope_head_dim,
                                                      bytes_per_element)


def run_inference_stats(model: dict, hardware: dict, batch_size, seq_len, bytes_per_element=2) -> dict:
    return _graded("inference_stats", "dict")(model, hardware, batch_size, seq_len, bytes_per_element)


def run_matmul_cost():
    """sympy (flops, bytes) of X (B x D) @ W (D x F) in bf16."""
    return _graded("matmul_cost", SYMPY2)()


def run_mlp_cost():
    return _graded("mlp_cost", SYMPY2)()


def run_attention_cost():
    return _graded("attention_cost", SYMPY2)()


def run_generation_flops() -> dict:
    """{'naive': ..., 'cached': ...} total FLOPs to generate T tokens (sympy, in T, P, L, D)."""
    return _graded("generation_flops", "dict")()


def run_decode_cost() -> dict:
    return _graded("decode_cost", "dict")()


# --- data ---


def run_get_batch(data, batch_size, seq_len, generator=None):
    return _graded("get_batch", T2)(data, batch_size, seq_len, generator)


def run_bits_per_byte(logits, targets, num_bytes) -> float:
    return _graded("bits_per_byte", "number")(logits, targets, num_bytes)


# --- compression: pruning, distillation ---


def run_structures_to_keep(scores, num_keep) -> torch.Tensor:
    return _graded("structures_to_keep", T)(scores, num_keep)


def run_gqa_heads_to_keep(head_scores, num_kv_heads, keep_kv_heads, keep_per_group):
    return _graded("gqa_heads_to_keep", T2)(head_scores, num_kv_heads, keep_kv_heads, keep_per_group)


def run_distillation_loss(student_logits, teacher_logits, temperature=1.0) -> torch.Tensor:
    return _graded("distillation_loss", T)(student_logits, teacher_logits, temperature)


# === library helpers (not graded) =================================================================

# --- foundation: device, layers, model, cache, generation, checkpoints ---------------------------


def run_get_device(prefer=None) -> torch.device:
    return get_device(prefer)


def run_default_dtype(device) -> torch.dtype:
    return default_dtype(device)


def run_seed_everything(seed: int) -> torch.Generator:
    return seed_everything(seed)


def make_config(**kwargs) -> ModelConfig:
    return ModelConfig(**kwargs)


def config_from_name(name: str, **overrides) -> ModelConfig:
    return ModelConfig.from_name(name, **overrides)


def make_model(config: ModelConfig, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config).eval()


def run_model(model, token_ids, cache=None, **kwargs) -> torch.Tensor:
    """A forward: without a cache, or appending at cache.length (start_pos/pad pass through as keywords)."""
    return model(token_ids, cache=cache, **kwargs)


def make_kv_cache(model, batch_size: int, max_seq_len: int | None = None, **kwargs):
    return model.new_cache(batch_size, max_seq_len, **kwargs)


def run_scaled_dot_product_attention(q, k, v, mask=None) -> torch.Tensor:
    return scaled_dot_product_attention(q, k, v, mask)


def run_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate x (..., T, H) at integer positions (T,)."""
    cos, sin = rope_angles(x.shape[-1], int(positions.max()) + 1, theta)
    return apply_rope(x, cos[positions], sin[positions])


def run_library_rmsnorm(weight: torch.Tensor, x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The library's RMSNorm (the graded adapter is run_rmsnorm)."""
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data.copy_(weight)
    return norm(x)


def run_library_swiglu(w1, w2, w3, x) -> torch.Tensor:
    """The library's SwiGLU (the graded adapter is run_swiglu)."""
    ffn = SwiGLU(w1.shape[1], w1.shape[0])
    ffn.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3})
    return ffn(x)


def run_generate(model, prompt_ids, max_new_tokens, **kwargs):
    return generate(model, prompt_ids, max_new_tokens, **kwargs)


def run_prefill(model, prompt_ids, cache):
    return prefill(model, prompt_ids, cache)


def run_decode_one_token(model, token_ids, cache):
    return decode_one_token(model, token_ids, cache)


def get_tokenizer(**kwargs) -> ByteTokenizer:
    return ByteTokenizer(**kwargs)


def run_save_checkpoint(path, model, **kwargs) -> None:
    checkpoints.save(path, model, **kwargs)


def run_load_checkpoint(path, **kwargs):
    return checkpoints.load(path, **kwargs)


def run_load_cs336_checkpoint(path_or_state_dict, config, **kwargs):
    return checkpoints.load_cs336_checkpoint(path_or_state_dict, config, **kwargs)


def run_infer_key_map(state_dict, config):
    return checkpoints.infer_key_map(state_dict, config)


def run_verify_checkpoint(model, student_forward, **kwargs) -> float:
    return checkpoints.verify_checkpoint(model, student_forward, **kwargs)


# --- data, evaluation, training, pruning (trained models) -----------------------------------------

from cs336_inference.data import corpus as _data  # noqa: E402
from cs336_inference.data import evaluation as _evaluation  # noqa: E402


def run_build_corpus(seed: int = 0) -> bytes:
    return _data.build_corpus(seed)


def run_build_documents(seed: int = 0) -> list[str]:
    return _data.build_documents(seed)


def run_load_corpus(split: str = "train", seed: int = 0) -> torch.Tensor:
    return _data.load_corpus(split, seed)


def run_make_recall_probe(num_items, distance, seed=0, **kwargs):
    return _data.make_recall_probe(num_items, distance, seed, **kwargs)


def run_evaluate_lm(model, data, seq_len, **kwargs) -> dict:
    return _evaluation.evaluate_lm(model, data, seq_len, **kwargs)


def run_compare_to_reference(model, reference, data, **kwargs) -> dict:
    return _evaluation.compare_to_reference(model, reference, data, **kwargs)


def run_long_range_recall(model, distances, **kwargs) -> dict:
    return _evaluation.long_range_recall(model, distances, **kwargs)


def run_recall_probes(distance, num_trials, seed=0, **kwargs):
    return _evaluation.recall_probes(distance, num_trials, seed, **kwargs)


# --- KV-cache variants: MLA, sliding window, hybrids, cross-layer sharing ----------------------
from cs336_inference.accounting import formulas as accounting  # noqa: E402
from cs336_inference.model import LatentKVCache, RollingKVCache  # noqa: E402


def set_mla_absorb(model, absorb: bool) -> None:
    """Choose MLA's decode path: absorbed (attend over the latents) or naive (up-project them)."""
    for block in model.layers:
        block.attn.absorb = absorb


def make_mla_attention(config: ModelConfig, layer_idx: int = 0):
    from cs336_inference.model import MultiHeadLatentAttention
    return MultiHeadLatentAttention(config, layer_idx)


def run_attention_module(module, x, positions, mask=None):
    """x (B, T, D) at integer positions (T,) through one attention layer without a cache."""
    rope_dim = getattr(module, "rope_head_dim", None) or module.head_dim
    cos, sin = rope_angles(rope_dim, int(positions.max()) + 1)
    out, _ = module(x, (cos[positions], sin[positions]), mask)
    return out


def run_block(block, x, positions, mask, rope_dim: int) -> torch.Tensor:
    """One TransformerBlock without a cache, with the mask the caller chose."""
    cos, sin = rope_angles(rope_dim, int(positions.max()) + 1)
    out, _ = block(x, (cos[positions], sin[positions]), mask)
    return out


def make_rolling_kv_cache(batch_size, num_kv_heads, head_dim, window, max_seq_len):
    return RollingKVCache(batch_size, num_kv_heads, head_dim, window, max_seq_len)


def make_latent_kv_cache(batch_size, kv_lora_rank, rope_head_dim, max_seq_len):
    return LatentKVCache(batch_size, kv_lora_rank, rope_head_dim, max_seq_len)


def make_cache_step(start: int, num_new: int, pad=None):
    """What one forward writes into a layer cache: T = num_new tokens appended at position `start`."""
    from cs336_inference.model import CacheStep
    return CacheStep(start, num_new, pad)


# --- accounting and roofline: symbolic and numeric FLOP/byte accounting, measured hardware ------

from cs336_inference.accounting import roofline  # noqa: E402
from cs336_inference.accounting import symbolic as accounting_symbolic  # noqa: E402


def run_parameter_count_symbolic():
    return accounting_symbolic.parameter_count()


def get_symbols() -> dict:
    """The lecture's sympy symbols by letter."""
    a = accounting_symbolic
    return dict(B=a.B, S=a.S, T=a.T, D=a.D, F=a.F, N=a.N, K=a.K, H=a.H, L=a.L, V=a.V, P=a.P)


def get_hardware_table() -> dict:
    return accounting.HARDWARE


def get_real_model(name: str):
    return accounting.get_model_shape(name)


def run_num_parameters(model, **kwargs) -> int:
    return accounting.num_parameters(model, **kwargs)


def run_forward_flops(model, batch_size, num_new_tokens, num_cached=0, last_only=False, mla_absorbed=False) -> int:
    return accounting.forward_flops(model, batch_size, num_new_tokens, num_cached, last_only, mla_absorbed)


def run_transformer_performance_stats(config, hardware="H100", batch_size=1, seq_len=1024, precision="bf16"):
    return accounting.transformer_performance_stats(config, hardware, batch_size, seq_len, precision)


def run_with_kv_heads(config, num_kv_heads):
    return accounting.with_kv_heads(config, num_kv_heads)


def run_measure_hardware(device=None, **kwargs):
    return roofline.measure_hardware(device, **kwargs)


def run_roofline_sweep(device=None, **kwargs):
    return roofline.roofline_sweep(device, **kwargs)


def run_max_batch_size(config, hardware="H100", seq_len=1024, precision="bf16") -> int:
    return accounting.max_batch_size(config, hardware, seq_len, precision)


from cs336_inference import compression as _pruning  # noqa: E402
from cs336_inference.data import training as _train  # noqa: E402


def make_train_config(**kwargs):
    return _train.TrainConfig(**kwargs)


def run_train_lm(model_config, train_config, **kwargs):
    return _train.train_lm(model_config, train_config, **kwargs)


def run_lr_at(step, train_config) -> float:
    return _train.lr_at(step, train_config)


def run_importance_scores(model, calibration, **kwargs) -> dict:
    return _pruning.importance_scores(model, calibration, **kwargs)


def run_prune_model(model, calibration, **kwargs):
    return _pruning.prune_model(model, calibration, **kwargs)


def run_distill(student, teacher, train_config, **kwargs):
    return _pruning.distill(student, teacher, train_config, **kwargs)


# --- quantization: mechanics, packing, fp8, LLM.int8(), GPTQ, AWQ, QAT, quantized model, KV cache ---


def run_pack_bits(q, bits) -> torch.Tensor:
    from cs336_inference.quantization import pack_bits
    return pack_bits(q, bits)


def run_unpack_bits(packed, bits, numel) -> torch.Tensor:
    from cs336_inference.quantization import unpack_bits
    return unpack_bits(packed, bits, numel)


def run_fp8_round_trip(x, fmt="e4m3", per_channel=False) -> torch.Tensor:
    from cs336_inference.quantization import fp8_round_trip
    return fp8_round_trip(x, fmt, per_channel)


def get_fp8_range(fmt="e4m3") -> tuple[float, float]:
    from cs336_inference.quantization import fp8_range
    return fp8_range(fmt)


def run_awq_search_scales(weight, inputs, bits=4, group_size=None, symmetric=False) -> torch.Tensor:
    """-> s (I,): AWQ quantizes W * s and feeds x / s."""
    from cs336_inference.quantization import awq_search_scales
    return awq_search_scales(weight, inputs, bits, group_size, symmetric).scales


def run_ste_fake_quantize(w, bits=4, group_size=None, symmetric=False) -> torch.Tensor:
    from cs336_inference.quantization import ste_fake_quantize
    return ste_fake_quantize(w, bits, group_size, symmetric)


def run_quantize_model(model, method="rtn", bits=4, group_size=None, calibration=None, **kwargs):
    from cs336_inference.quantization import quantize_model
    return quantize_model(model, method, bits, group_size, calibration, **kwargs)


def get_model_nbytes(model) -> int:
    from cs336_inference.quantization import model_nbytes
    return model_nbytes(model)


def make_quantized_linear(linear, kind: str = "int4", **kwargs):
    """An nn.Linear replaced by a quantized one: "int4" (RTN, group 16 unless given), "fp8" or "llm_int8"."""
    from cs336_inference.quantization.linear import Fp8Linear, LLMInt8Linear, QuantizedLinear
    if kind == "int4":
        return QuantizedLinear.from_linear(linear, bits=4, group_size=kwargs.pop("group_size", 16), **kwargs)
    return {"fp8": Fp8Linear, "llm_int8": LLMInt8Linear}[kind](linear, **kwargs)


def make_quantized_kv_cache(model, batch_size, max_seq_len=None, fmt="int8"):
    from cs336_inference.quantization import quantize_kv_cache
    return quantize_kv_cache(model.new_cache(batch_size, max_seq_len), fmt)


def run_quantize_kv_cache(cache, fmt="int8", group_size=None):
    """Quantize a model's KVCache in place (an empty one, or one that already holds a prefill)."""
    from cs336_inference.quantization import quantize_kv_cache
    return quantize_kv_cache(cache, fmt, group_size)


def run_recall_nll(model, distances, **kwargs) -> dict:
    return _evaluation.recall_nll(model, distances, **kwargs)


def make_quantized_linear_from_weight(weight, bits=4, group_size=None, symmetric=False, kernel="auto", **kwargs):
    """A `QuantizedLinear` quantizing `weight` (O, I) by round to nearest (group_size None = per channel)."""
    from cs336_inference.quantization import QuantizedLinear, quantize_tensor
    granularity = "channel" if group_size is None else "group"
    qt = quantize_tensor(weight, bits, symmetric, granularity, group_size)
    return QuantizedLinear(qt, kernel=kernel, **kwargs)


def run_set_quantized_kernel(model, kernel):
    from cs336_inference.quantization import set_quantized_kernel
    return set_quantized_kernel(model, kernel)


# --- decode speed options: fused projections, attention kernel ---


def run_fuse_projections(model):
    """In place: q/k/v and w1/w3 each as one matmul; returns the model."""
    return model.fuse_projections()


def run_unfuse_projections(model):
    return model.unfuse_projections()


def run_set_attention_kernel(model, kernel: str):
    """kernel: "reference" (hand-written) or "sdpa" (torch's fused attention); returns the model."""
    return model.set_attention_kernel(kernel)


# --- the real pretrained model (SmolLM2-135M from its GGUF) -----------------------------------


def run_load_pretrained(name: str, **kwargs):
    return checkpoints.load_pretrained(name, **kwargs)


def get_model_tokenizer(name: str):
    from cs336_inference.model import load_tokenizer
    return load_tokenizer(name)


def run_load_gguf_weights(path, dtype=torch.float32, cache_as=None):
    from cs336_inference.model.real_models import load_gguf_weights
    return load_gguf_weights(path, dtype, cache_as=cache_as)


def run_load_gguf_tensors(path, cache_as=None):
    """(config, the file's tensors as stored: {"qtypes", "data"})."""
    from cs336_inference.model.real_models import load_gguf_tensors
    return load_gguf_tensors(path, cache_as=cache_as)


def make_exact_linear(raw, qtype: str):
    """A QuantizedLinear holding one stored GGUF tensor's blocks (raw: its bytes, (O, bytes per row))."""
    from cs336_inference.model.gguf import gguf_blocks
    from cs336_inference.quantization import exact_linear
    return exact_linear(gguf_blocks(raw, qtype))


def make_rescored_head(head, k: int = 16):
    """A quantized lm_head whose top k logits are recomputed in fp32 from its codes."""
    from cs336_inference.quantization.model import RescoredHead
    return RescoredHead(head, k)


def run_gguf_exact_model(config, stored, **kwargs):
    from cs336_inference.quantization import gguf_exact_model
    return gguf_exact_model(config, stored, **kwargs)


def run_packed_matmul(x, layer):
    """x @ W^T through the packed kernel layout `layer` chose (None: it has none)."""
    from cs336_inference.quantization import packed_matmul
    return packed_matmul(x, layer.packed_weight())


def run_int4pack_dense(layer):
    """The dense (O, I) matrix an int4pack `layer`'s kernel multiplies by (`kernels.int4pack_dense`)."""
    from cs336_inference.quantization.kernels import int4pack_dense
    packed = layer.packed_weight()
    return int4pack_dense(layer.qweight, packed.scales, packed.group_size, layer.symmetric)


def run_compile_dense_prefill(model, **kwargs):
    from cs336_inference.workshop.kernels.dense_prefill import compile_dense_prefill
    return compile_dense_prefill(model, **kwargs)


def run_with_attention(model, **changes):
    from cs336_inference.model.convert import with_attention
    return with_attention(model, **changes)


def run_mean_pool_kv_heads(model, num_kv_heads: int):
    from cs336_inference.model.convert import mean_pool_kv_heads
    return mean_pool_kv_heads(model, num_kv_heads)


def run_passkey_trials(tokenizer, context, num_trials, depths=(0.0, 0.25, 0.5, 0.75, 1.0), seed=0):
    from cs336_inference.data.passkey import passkey_trials
    return passkey_trials(tokenizer, context, num_trials, depths, seed)


def make_chat_session(model, tokenizer, **kwargs):
    from cs336_inference.serving import ChatSession
    return ChatSession(model, tokenizer, **kwargs)


def make_conversation_cache(model, max_seq_len: int, decode=None):
    """One conversation's KV cache kept between turns (what a ChatSession's `streams` may be)."""
    from cs336_inference.generation import ConversationCache
    return ConversationCache(model, max_seq_len, decode)


def run_count_activation_outliers(model, batches, threshold=6.0):
    from cs336_inference.quantization import count_activation_outliers
    return count_activation_outliers(model, batches, threshold)


def run_gguf_round_trip(weight, qtype="Q4_1"):
    from cs336_inference.model.gguf import gguf_round_trip
    return gguf_round_trip(weight, qtype)


def run_pydoc_documents(split):
    from cs336_inference.data.real_text import pydoc_documents
    return pydoc_documents(split)


def run_bytes_per_token(tokenizer):
    from cs336_inference.data.real_text import bytes_per_token
    return bytes_per_token(tokenizer)


# --- speculative decoding: accept rule, draft-verify loop, prompt lookup, theory --------------------
from cs336_inference.generation import drafters as _drafters  # noqa: E402
from cs336_inference.generation import prompt_lookup as _prompt_lookup  # noqa: E402
from cs336_inference.generation import speculative as _speculative  # noqa: E402
from cs336_inference.generation import speculative_rule as _accept  # noqa: E402
from cs336_inference.generation import speculative_theory as _spec_theory  # noqa: E402


def run_accept_rule(p_draft, q_target, draft_tokens, generator=None) -> tuple[int, int]:
    """The library's accept rule (for the library's tests; the graded adapter is run_speculative_accept)
    -> (num_accepted, next_token): emit draft_tokens[:num_accepted], then next_token."""
    k, token = _accept.speculative_accept(p_draft, q_target, draft_tokens, generator)
    return int(k), int(token)


def run_acceptance_probability(p_draft, q_target, draft_tokens) -> torch.Tensor:
    """min(1, q_i(x_i) / p_i(x_i)) for p_draft, q_target (g, V) and draft_tokens (g,) -> (g,)."""
    return _accept.acceptance_probability(p_draft, q_target, draft_tokens)


def run_library_residual_distribution(p_draft, q_target) -> torch.Tensor:
    """norm(max(q - p, 0)) over the last dim (the library's; the graded adapter is run_residual_distribution)."""
    return _accept.residual_distribution(p_draft, q_target)


def run_speculative_generate(target, draft, prompt_ids, gamma, temperature=0.0, **kwargs):
    """-> a result with .tokens (list[int]), .proposed / .accepted (per target pass), .alpha,
    .acceptance_by_position, .mean_tokens_per_pass, .target_forwards, .draft_forwards."""
    return _speculative.speculative_generate(target, draft, prompt_ids, gamma, temperature, **kwargs)


def make_speculative_decoder(target, draft, prompt_ids, gamma, temperature=0.0, **kwargs):
    """A stepper: .step() runs one pass; .sequence, .target_cache, .drafter (.cache for a model draft)."""
    return _speculative.SpeculativeDecoder(target, draft, prompt_ids, gamma, temperature, **kwargs)


def get_drafter_protocol():
    """Drafters implement start(prompt, max_seq_len, max_rollback), propose(sequence, n, sampling, generator) ->
    (tokens, probs (n, V) or None), rollback(length) and a `forwards` counter."""
    return _drafters.Drafter


def make_sampling_params(temperature=0.0, top_k=None, top_p=None):
    return _drafters.SamplingParams(temperature, top_k, top_p)


def run_prompt_lookup_propose(sequence, n, max_ngram=3, min_ngram=1) -> list[int]:
    return _prompt_lookup.prompt_lookup_propose(sequence, n, max_ngram, min_ngram)


def make_prompt_lookup_drafter(max_ngram=3, min_ngram=1):
    return _prompt_lookup.PromptLookupDrafter(max_ngram, min_ngram)


def run_expected_tokens_per_pass(alpha, gamma):
    return _spec_theory.expected_tokens_per_pass(alpha, gamma)


def run_expected_speedup(alpha, gamma, cost_ratio, verify_cost=1):
    return _spec_theory.expected_speedup(alpha, gamma, cost_ratio, verify_cost)


def run_optimal_gamma(alpha, cost_ratio, max_gamma=64, verify_cost=1) -> int:
    return _spec_theory.optimal_gamma(alpha, cost_ratio, max_gamma, verify_cost)


def run_acceptance_rate(p, q):
    return _spec_theory.acceptance_rate(p, q)


def run_speculative_output_distribution(p, q) -> dict:
    """Exact (Fractions) -> {'accepted': per token, 'reject': 1 - alpha, 'residual': per token, 'output': per token}."""
    d = _spec_theory.speculative_output_distribution(p, q)
    return dict(accepted=list(d.accepted), reject=d.reject, residual=list(d.residual), output=list(d.output))


# --- serving: paged KV memory (blocks, prefix sharing, copy-on-write), paged attention, schedulers ---


def make_kv_cache_manager(num_blocks: int, block_size: int, prefix_caching: bool = True, hash_fn=None):
    """The library's `KVCacheManager` (block tables of many sequences: allocate / allocate_slots / fork / free /
    cache_blocks, with prefix caching; the graded one is `make_graded_kv_cache_manager`)."""
    from cs336_inference.serving import KVCacheManager, chained_block_hash
    return KVCacheManager(num_blocks, block_size, prefix_caching, hash_fn or chained_block_hash)


def make_contiguous_allocator(num_slots: int):
    from cs336_inference.serving import ContiguousAllocator
    return ContiguousAllocator(num_slots)


def make_contiguous_manager(num_slots: int):
    """The contiguous layout behind the engine's memory interface (one reserved run per sequence)."""
    from cs336_inference.serving import ContiguousManager
    return ContiguousManager(num_slots)


def get_out_of_blocks_error() -> type:
    from cs336_inference.serving import OutOfBlocksError
    return OutOfBlocksError


def make_paged_kv_cache(model, num_blocks: int, block_size: int):
    """K/V block pools for `model`; `.step(tables, context_lens, query_lens)` is one forward's `step=`."""
    from cs336_inference.serving import PagedKVCache
    return PagedKVCache(model, num_blocks, block_size)


def make_request(request_id, prompt, max_new_tokens: int, arrival_time: float = 0.0, **sampling):
    """A trace request; sampling: SamplingParams fields (stop_tokens= is taken as stop_token_ids=)."""
    from cs336_inference.serving import Request, SamplingParams
    if "stop_tokens" in sampling:
        sampling["stop_token_ids"] = sampling.pop("stop_tokens")
    return Request(request_id, tuple(prompt), max_new_tokens, arrival_time, SamplingParams(**sampling))


def make_poisson_trace(source_ids, system_prompt=(), **trace_config):
    """Requests with Poisson arrivals, prompts cut from source_ids (see serving.TraceConfig)."""
    from cs336_inference.serving import TraceConfig, make_trace
    return make_trace(source_ids, TraceConfig(**trace_config), system_prompt=system_prompt)


def run_engine(model, requests, **config):
    """Serve `requests` to completion; the result's `.outputs[i].tokens[j]` is sample j of request i."""
    from cs336_inference.serving import Engine
    return Engine(model, **config).run(requests)


def make_request_output(request_id, prompt_len: int, arrival_time: float, token_times: list[list[float]],
                        first_scheduled_time: float | None = None):
    """A finished request as the engine reports it: per sample, the time each output token existed."""
    from cs336_inference.serving import RequestRecord
    return RequestRecord(request_id=request_id, prompt_len=prompt_len, arrival_time=arrival_time,
                         tokens=[[0] * len(t) for t in token_times],
                         token_times=[list(t) for t in token_times], finish_reasons=["length"] * len(token_times),
                         first_scheduled_time=first_scheduled_time,
                         finish_time=max(t[-1] for t in token_times if t) if any(token_times) else None)


def run_request_metrics(output):
    """One request's TTFT, TPOT, ITLs, E2E and queueing / prefill / decode split (vLLM's definitions)."""
    from cs336_inference.serving import request_metrics
    return request_metrics(output)


def run_benchmark_metrics(outputs, duration: float | None = None) -> dict:
    """A run's counts, throughputs and {mean, median, p99} of ttft, tpot, itl, e2el, queueing, prefill, decode."""
    from cs336_inference.serving import benchmark_metrics
    return benchmark_metrics(outputs, duration)


# --- fixed-state layers (alternatives to the transformer) ---


def run_gated_linear_attention(q, k, v, log_decay=None, state=None, normalizer=None, normalize=False):
    """The parallel form: y_i = sum_{j<=i} (a_{j+1}..a_i) (q_i . k_j) v_j + (a_1..a_i) q_i^T S_0 [/ normaliser]."""
    from cs336_inference.model.state_cache import parallel_form
    return parallel_form(q, k, v, log_decay, state, normalizer, normalize=normalize)


def run_taylor_feature_map(x):
    """BASED's phi: x (..., d) -> (..., 1 + d + d^2)."""
    from cs336_inference.model.linear_attention import taylor_feature_map
    return taylor_feature_map(x)


def run_state_bytes(config, batch_size: int = 1) -> int:
    """Bytes of every fixed-state layer's state for `batch_size` sequences (accounting.fixed_state)."""
    from cs336_inference.accounting.fixed_state import state_bytes
    return state_bytes(config, batch_size)


def make_mqar_task(**kwargs):
    from cs336_inference.data.mqar import MQARTask
    return MQARTask(**kwargs)


def run_mqar_recall(model, task, num_pairs: int, **kwargs) -> float:
    from cs336_inference.data.mqar import mqar_recall
    return mqar_recall(model, task, num_pairs, **kwargs)
