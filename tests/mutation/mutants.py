"""The planted bugs of the mutation check (run by tests/mutation/run.py).

Graded mutants: realistic student bugs in the code behind a graded function. Each is applied to a copy
of the package (`cs336_inference` copied as `mutant_NN`), whose `homework.reference` is then graded with
`pytest tests/graded --impl mutant_NN.homework.reference`: the reference solution with one change, reached
through the same retargeting a student's package uses. `issue` numbers the twelve holes of issue 15;
`equivalent` marks a mutant that cannot change any output (with the reason), left out of the score.

Library stubs: the issue's stand-ins for library functions that are not graded (pruning importance,
hardware measurement, model quantization), and hole 10 planted in the model's own ring buffer (the issue
asks for the library fix, not only the graded test); `library_stubs.py` patches them in and run.py runs
the library tests of that part, which must fail.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str                          # file inside the package
    edits: tuple[tuple[str, str], ...]  # (old, new): each old must occur exactly once in the file
    what: str
    issue: int | None = None           # the hole of issue 15 it plants (None: our own)
    equivalent: str | None = None      # why no test can notice (an equivalent mutant)


SAMPLING = "generation/sampling.py"
SPECULATIVE = "generation/speculative_rule.py"
ATTENTION = "model/attention.py"
ROLLING = "model/rolling_kv_cache.py"
MLA = "model/mla.py"
CORE = "quantization/core.py"
PACKING = "quantization/packing.py"
LLM_INT8 = "quantization/llm_int8.py"
GPTQ = "quantization/gptq.py"
KV = "quantization/kv.py"
FORMULAS = "accounting/formulas.py"
SYMBOLIC = "accounting/symbolic.py"
CORPUS = "data/corpus.py"
REFERENCE = "homework/reference/attention.py"
ALLOCATOR = "serving/block_allocator.py"
PAGED = "serving/paged_attention.py"
SCHEDULER = "serving/scheduler.py"
LAYERS = "model/layers.py"

MUTANTS: tuple[Mutant, ...] = (
    # --- the twelve holes of issue 15 -----------------------------------------------------------------
    Mutant("topk_keeps_k_minus_1", SAMPLING,
           (("logits.masked_fill(logits < kth,", "logits.masked_fill(logits <= kth,"),),
           "top-k masks the k-th largest logit too (k - 1 tokens survive)", issue=1),
    Mutant("temperature_after_top_p", SAMPLING,
           (("    logits = logits / temperature\n", ""),
            ("        probs = probs / probs.sum(-1, keepdim=True)\n",
             "        probs = probs / probs.sum(-1, keepdim=True)\n"
             "    probs = torch.softmax(torch.log(probs) / temperature, dim=-1)\n")),
           "temperature applied after the top-p filter (the nucleus is chosen on untempered probabilities)", issue=2),
    Mutant("top_p_boundary_strict", SAMPLING,
           (("drop_sorted = mass_before >= top_p", "drop_sorted = mass_before > top_p"),),
           "top-p keeps a token whose predecessors already sum to exactly top_p", issue=3),
    Mutant("quantize_without_clamp", CORE,
           (("return q.clamp(qmin, qmax).to(torch.int32)", "return q.to(torch.int32)"),),
           "quantize never clamps codes to the integer range", issue=4),
    Mutant("llm_int8_threshold_inclusive", LLM_INT8,
           (("return (x.abs() > threshold)", "return (x.abs() >= threshold)"),),
           "a value exactly at the threshold makes its column an outlier", issue=5),
    Mutant("kv_int8_scale_from_max", KV,
           (("scale = (groups.abs().amax(-1) / self.qmax)", "scale = (groups.amax(-1) / self.qmax)"),),
           "int8 KV scale from the max instead of the absmax", issue=6),
    Mutant("latency_memory_time_only", FORMULAS,
           (("latency = max(t_mem, t_compute)", "latency = t_mem"),),
           "decode latency = memory time only (no max with compute time)", issue=7),
    Mutant("prefill_without_memory_floor", FORMULAS,
           (("prefill_time = max(prefill_flops / flops_per_s, memory / hw.memory_bandwidth)",
             "prefill_time = prefill_flops / flops_per_s"),),
           "prefill time = compute time only (no memory floor)", issue=8),
    Mutant("get_batch_misses_last_window", CORPUS,
           (("torch.randint(0, data.numel() - seq_len, (batch_size,)",
             "torch.randint(0, data.numel() - seq_len - 1, (batch_size,)"),),
           "the batch sampler never draws the last valid window", issue=9),
    Mutant("rolling_forgets_overwritten_slots", ROLLING,
           (("self.oldest = max(self.oldest, step.end - self.capacity)", "self.oldest = step.end - self.capacity"),),
           "the ring forgets slots overwritten by rolled-back writes (a second rollback is accepted)", issue=10),
    Mutant("symbolic_kv_bytes_without_k_and_v", SYMBOLIC,
           (("return S * K * H * L * 2 * BYTES", "return S * K * H * L * BYTES"),),
           "symbolic KV bytes miss the factor 2 for keys and values", issue=11),
    Mutant("symbolic_throughput_one_over_latency", SYMBOLIC,
           (("return B / decode_latency()", "return 1 / decode_latency()"),),
           "symbolic throughput = 1 / latency instead of B / latency", issue=12),
    # --- our own ------------------------------------------------------------------------------------------
    Mutant("sampler_is_argmax", SAMPLING,
           (("tokens = torch.multinomial(flat, 1, generator=generator)", "tokens = flat.argmax(-1, keepdim=True)"),),
           "the sampler returns the most likely token instead of drawing one (the issue's argmax stub)"),
    Mutant("sampler_ignores_generator", SAMPLING,
           (("tokens = torch.multinomial(flat, 1, generator=generator)", "tokens = torch.multinomial(flat, 1)"),),
           "the sampler draws from the global RNG, not the generator it was given"),
    Mutant("temperature_multiplies", SAMPLING,
           (("    logits = logits / temperature\n", "    logits = logits * temperature\n"),),
           "logits multiplied by the temperature"),
    Mutant("top_p_not_renormalised", SAMPLING,
           (("        probs = probs / probs.sum(-1, keepdim=True)\n", ""),),
           "the top-p nucleus is not renormalised"),
    Mutant("top_p_mass_includes_the_token_itself", SAMPLING,
           (("mass_before = sorted_probs.cumsum(-1) - sorted_probs", "mass_before = sorted_probs.cumsum(-1)"),),
           "top-p drops the token that crosses the threshold (the nucleus falls short of top_p)"),
    Mutant("sampler_ignores_top_k", SAMPLING,
           (("probs = _probs(logits.float(), temperature, top_k, top_p)",
             "probs = _probs(logits.float(), temperature, None, top_p)"),),
           "sample_next_token forgets to pass top_k on"),
    Mutant("speculative_bonus_from_the_last_draft_position", SPECULATIVE,
           (("dist = q_target[g] if k == g", "dist = q_target[g - 1] if k == g"),),
           "when every draft token is accepted, the bonus token is drawn from q_g instead of q_{g+1}"),
    Mutant("speculative_resamples_from_q", SPECULATIVE,
           (("residual = (q_target - p_draft).clamp_min(0)", "residual = q_target.clone()"),),
           "after a rejection the next token is drawn from q instead of norm(max(q - p, 0))"),
    Mutant("speculative_ratio_p_over_q", SPECULATIVE,
           (("q / p.clamp_min(torch.finfo(p.dtype).tiny)", "p / q.clamp_min(torch.finfo(q.dtype).tiny)"),),
           "draft tokens accepted with probability min(1, p/q) instead of min(1, q/p)"),
    Mutant("speculative_keeps_going_after_a_rejection", SPECULATIVE,
           (("k = rejected.index(True) if True in rejected else g", "k = g - sum(rejected)"),),
           "num_accepted counts every accepted draft token, not the run before the first rejection"),
    Mutant("speculative_ratio_not_capped_at_one", SPECULATIVE,
           (("return ratio.clamp(max=1.0)", "return ratio"),),
           "the acceptance probability q/p is not capped at 1",
           equivalent="a token is accepted when a uniform in [0, 1) falls below the ratio: any ratio >= 1 accepts"),
    Mutant("rope_rotate_half_layout", LAYERS,
           (("x.float().unflatten(-1, (-1, 2)).unbind(-1)", "x.float().unflatten(-1, (2, -1)).unbind(-2)"),
            ("a * sin + b * cos), dim=-1).flatten(-2)", "a * sin + b * cos), dim=-2).flatten(-2)")),
           "RoPE rotates (x[i], x[i + H/2]) (the rotate-half layout) instead of adjacent pairs"),
    Mutant("gqa_heads_interleaved", ATTENTION,
           (('q = rearrange(q, "B (K G) T H -> B K (G T) H", G=G)',
            'q = rearrange(q, "B (G K) T H -> B K (G T) H", G=G)'),),
           "query head n reads key/value head n % K instead of n // G"),
    Mutant("attention_scale_one_over_h", ATTENTION,
           (("scale = q.shape[-1] ** -0.5 if scale is None", "scale = q.shape[-1] ** -1.0 if scale is None"),),
           "scores scaled by 1/H instead of 1/sqrt(H)"),
    Mutant("causal_mask_excludes_self", ATTENTION,
           (("    mask = j <= i\n", "    mask = j < i\n"),),
           "a query may not attend to its own key"),
    Mutant("window_one_too_wide", ATTENTION,
           (("mask = mask & ((i - j < window) | (j < sinks))", "mask = mask & ((i - j <= window) | (j < sinks))"),),
           "the sliding window lets each query see window + 1 keys"),
    Mutant("decode_rope_from_position_zero", REFERENCE,
           (("q = _layers.apply_rope(q, cos[S:], sin[S:])", "q = _layers.apply_rope(q, cos[:T], sin[:T])"),
            ("k = _layers.apply_rope(k, cos[S:], sin[S:])", "k = _layers.apply_rope(k, cos[:T], sin[:T])")),
           "new tokens rotated as if they started at position 0 (RoPE ignores the cache length)"),
    Mutant("decode_mask_not_offset", REFERENCE,
           (("mask = _attention.attention_mask(T, S + T, S, device=x.device)",
             "mask = _attention.attention_mask(T, S + T, 0, device=x.device)"),),
           "the causal mask of new tokens is not offset by the cache length"),
    Mutant("mla_scale_without_rope_dims", MLA,
           (("scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5", "scale = q_nope.shape[-1] ** -0.5"),),
           "MLA's absorbed scores scaled by 1/sqrt(H) instead of 1/sqrt(H + R)"),
    Mutant("mla_value_heads_split_wrong", MLA,
           (('w_uv = rearrange(w_uv, "(N H) C -> N H C", N=N)', 'w_uv = rearrange(w_uv, "(H N) C -> N H C", N=N)'),),
           "W_UV's rows split into heads in the wrong order"),
    Mutant("ring_writes_slot_mod_window", ROLLING,
           (("step.end, device=self.k.device) % self.capacity", "step.end, device=self.k.device) % self.window"),),
           "the ring writes position p to slot p % window, reads it from p % capacity"),
    Mutant("ring_window_one_key_too_many", ROLLING,
           (("return max(0, start - self.window + 1)", "return max(0, start - self.window)"),),
           "the ring's first needed key is one position too early (rollbacks refused or reads off by one)"),
    Mutant("dequantize_adds_zero_point", CORE,
           (("return ((q.float() - zero_point) * scale).to(dtype)",
            "return ((q.float() + zero_point) * scale).to(dtype)"),),
           "dequantize adds the zero point instead of subtracting it"),
    Mutant("affine_zero_point_sign", CORE,
           (("zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)",
             "zero = (qmin + torch.round(lo / scale)).clamp(qmin, qmax)"),),
           "affine zero point with the wrong sign"),
    Mutant("symmetric_scale_over_2_to_the_b_minus_1", CORE,
           (("scale = xg.abs().amax(-1) / qmax", "scale = xg.abs().amax(-1) / (qmax + 1)"),),
           "symmetric scale divides by 2^(b-1) instead of 2^(b-1) - 1 (the absmax overflows the range)"),
    Mutant("int4_nibbles_swapped", PACKING,
           (("return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)",
            "return nibbles[..., 1::2] | (nibbles[..., 0::2] << 4)"),
            ("q = torch.stack((low, high), dim=-1)", "q = torch.stack((high, low), dim=-1)")),
           "element 2i in the high nibble (pack and unpack agree, the byte layout does not)"),
    Mutant("unpack_int4_sign_off_by_one", PACKING,
           (("torch.where(q >= 8, q - 16, q)", "torch.where(q > 8, q - 16, q)"),),
           "nibble 8 unpacked as +8 instead of -8"),
    Mutant("llm_int8_code_range_128", LLM_INT8,
           (("return torch.round(x.float() / scale).clamp(-127, 127)",
            "return torch.round(x.float() / scale).clamp(-128, 127)"),),
           "int8 codes clamped to [-128, 127]",
           equivalent="codes are round(x / (absmax / 127)), so |code| <= 127 already: the clamp never binds"),
    Mutant("llm_int8_outliers_from_quantized_weights", LLM_INT8,
           (("w_hi = (weight if weight is not None else w_q.float() * w_scale)[:, outliers]",
             "w_hi = (w_q.float() * w_scale)[:, outliers]"),),
           "the outlier columns multiply the int8-rounded weights instead of the float weights"),
    Mutant("gptq_error_times_diagonal", GPTQ,
           (("err = (w - q) / Hinv1[i, i]", "err = (w - q) * Hinv1[i, i]"),),
           "GPTQ multiplies the rounding error by [H^-1]_jj instead of dividing"),
    Mutant("gptq_without_dampening", GPTQ,
           (("    H += damp * torch.mean(torch.diag(H))", "    H += 0 * torch.mean(torch.diag(H))"),),
           "GPTQ without the 1% dampening of the Hessian"),
    Mutant("gptq_group_scales_from_original_weights", GPTQ,
           (("s, z = compute_scale_zero_point(torch.cat([W1[:, i:], past], 1)[:, :g],",
             "s, z = compute_scale_zero_point(weight.double()[:, j:j + g],"),),
           "GPTQ group scales from the original weights instead of the error-updated ones"),
    Mutant("gptq_lower_cholesky", GPTQ,
           (("torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)",
             "torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=False)"),),
           "GPTQ takes the lower Cholesky factor of H^-1 (the wrong rows of the inverse)"),
    Mutant("allocator_incref_sets_two", ALLOCATOR,
           (("self._ref_counts[block] += 1", "self._ref_counts[block] = 2"),),
           "sharing a block sets its count to 2 instead of adding one (a third holder is lost)"),
    Mutant("allocator_no_out_of_blocks_error", ALLOCATOR,
           (("        if not self._free:\n", "        if False:\n"),),
           "allocate does not check for an empty free list (fails with a KeyError, not a clear refusal)"),
    Mutant("paged_slots_in_the_wrong_order", PAGED,
           (('"(B n) s K H -> B K (n s) H"', '"(B n) s K H -> B K (s n) H"'),),
           "paged attention gathers slot-major instead of block-major (positions scrambled across blocks)"),
    Mutant("paged_causal_mask_not_offset", PAGED,
           (("positions = (context_lens - query_lens)[:, None] + torch.arange(T_max)",
             "positions = torch.arange(T_max)[None, :].expand(len(context_lens), -1)"),),
           "paged attention's causal mask forgets the cached positions before the new queries"),
    Mutant("scheduler_preempts_the_oldest", SCHEDULER,
           (("victim = queue.pop() if queue else seq", "victim = queue.popleft() if queue else seq"),),
           "under memory pressure the oldest waiting-for-a-slot sequence is preempted, not the youngest"),
    Mutant("scheduler_ignores_the_watermark", SCHEDULER,
           (("self._try_admit(self.waiting[0], batch, self.watermark_blocks)",
             "self._try_admit(self.waiting[0], batch, 0)"),),
           "admission ignores the watermark of free blocks"),
    Mutant("scheduler_token_budget_off_by_one", SCHEDULER,
           (("batch.num_tokens + new_tokens > self.max_num_batched_tokens",
             "batch.num_tokens + new_tokens >= self.max_num_batched_tokens"),),
           "a prefill that exactly fills the token budget is refused"),
    Mutant("scheduler_admits_while_preempting", SCHEDULER,
           (("        if not batch.preempted:  # no admission while memory is short", "        if True:"),),
           "new sequences are admitted in the same step that preempted one",
           equivalent="a victim re-prefills its tokens plus the one it was to decode, one block more than it "
                      "freed, and waits at the front: without shared blocks (the graded functions have none) "
                      "nothing behind it can be admitted in that step"),
    Mutant("kv_bytes_without_k_and_v", FORMULAS,
           (("return 2 * config.num_kv_heads * config.head_dim", "return config.num_kv_heads * config.head_dim"),),
           "numeric KV bytes miss the factor 2 for keys and values"),
    Mutant("params_count_lm_head_once", FORMULAS,
           (("total = (1 if s.tie_embeddings else 2) * s.vocab_size", "total = 1 * s.vocab_size"),),
           "parameters count one V x D table (the untied lm_head is missing)"),
    Mutant("throughput_one_over_latency", FORMULAS,
           (("throughput_tokens_per_s=batch_size / latency", "throughput_tokens_per_s=1 / latency"),),
           "numeric throughput = 1 / latency"),
    Mutant("prefill_lm_head_on_every_position", FORMULAS,
           (("prefill_flops = forward_flops(s, batch_size, seq_len, 0, last_only=True)",
             "prefill_flops = forward_flops(s, batch_size, seq_len, 0, last_only=False)"),),
           "prefill FLOPs count the lm_head on every prompt position"),
    Mutant("symbolic_matmul_forgets_output", SYMBOLIC,
           (("nbytes = BYTES * B * D + BYTES * D * F + BYTES * B * F", "nbytes = BYTES * B * D + BYTES * D * F"),),
           "matmul bytes forget writing Y"),
    Mutant("symbolic_attention_forgets_pv", SYMBOLIC,
           (("flops = 2 * B * S * T * D + 2 * B * S * T * D", "flops = 2 * B * S * T * D"),),
           "attention FLOPs count q k^T but not p v"),
    Mutant("symbolic_cached_generation_reruns_weights", SYMBOLIC,
           (("cached = sp.summation(2 * P + 4 * L * D * t, (t, 1, T))",
            "cached = sp.summation(2 * P * t + 4 * L * D * t, (t, 1, T))"),),
           "cached generation still multiplies the whole prefix by the weights"),
    Mutant("get_batch_targets_not_shifted", CORPUS,
           (("x, y = windows[:, :-1], windows[:, 1:]", "x, y = windows[:, :-1], windows[:, :-1]"),),
           "targets equal the inputs (not shifted by one)"),
)

# Library stubs (not graded): name -> (what, the library tests that must notice)
LIBRARY_STUBS: dict[str, tuple[str, str]] = {
    "importance_all_zero": ("pruning importance scores all zero (shapes kept)", "tests/library/test_pruning.py"),
    "hardware_constant": ("measure_hardware returns constants (arguments still checked)",
                          "tests/library/test_roofline.py"),
    "quantize_model_times_1_01": ("quantize_model returns the model with every block weight x 1.01",
                                  "tests/library/test_quantization_model.py"),
    "ring_forgets_overwritten_slots": ("the model's RollingKVCache forgets slots overwritten by a rolled-back "
                                       "draft (issue 15, hole 10, in the library)",
                                       "tests/library/test_kv_variant_caches.py"),
}
