"""Points of every graded test function: the one table (tests/grading.py reads it). The parametrized
cases of a test share its points equally. Hidden tests added at grading time carry their own points
(`@pytest.mark.points(n)`, default 1). A test of the grader checks that this table and tests/graded/
list the same tests."""

POINTS = {
    # --- sampling (18) ------------------------------------------------------------------------------------
    "test_sampling_rules.py::test_temperature_zero_is_greedy": 1,
    "test_sampling_rules.py::test_temperature_scales_the_logits_before_the_softmax": 1,
    "test_sampling_rules.py::test_top_k_keeps_exactly_the_k_largest": 3,
    "test_sampling_rules.py::test_top_p_boundary_is_exact": 3,
    "test_sampling_rules.py::test_top_p_keeps_the_smallest_nucleus": 2,
    "test_sampling_rules.py::test_temperature_is_applied_before_top_p": 3,
    "test_sampling_rules.py::test_top_k_and_top_p_together": 1,
    "test_sampling_rules.py::test_sampling_frequencies_match_the_distribution": 2,
    "test_sampling_rules.py::test_one_row_gives_one_token_and_seeds_reproduce": 1,
    "test_sampling_rules.py::test_generation_with_the_students_sampler_greedy_and_sampled": 1,
    # --- speculative sampling: the accept/resample rule (5) ----------------------------------------------
    "test_speculative_accept.py::test_outcomes_for_fixed_drafts_match_the_exact_enumeration": 2,
    "test_speculative_accept.py::test_the_first_emitted_token_follows_the_target": 2,
    "test_speculative_accept.py::test_cases_without_randomness": 1,
    # --- attention: GQA, KV cache, MLA, sliding window, rolling buffer (24) -------------------------------
    "test_attention_kernels.py::test_grouped_query_attention_matches_a_loop_over_heads": 4,
    "test_attention_kernels.py::test_prefill_then_decode_with_a_kv_cache_equals_the_full_layer": 4,
    "test_attention_kernels.py::test_decode_at_a_late_position_rotates_by_that_position": 2,
    "test_attention_kernels.py::test_mla_absorbed_attention_equals_the_naive_up_projection": 3,
    "test_attention_kernels.py::test_sliding_window_mask_matches_the_definition": 2,
    "test_attention_kernels.py::test_sliding_window_attention_through_gqa_sees_only_the_window": 1,
    "test_rolling_buffer.py::test_appends_wrap_around_and_the_context_is_the_last_window": 2,
    "test_rolling_buffer.py::test_a_second_rollback_after_the_ring_wrapped_is_refused": 3,
    "test_rolling_buffer.py::test_random_appends_and_rollbacks_match_the_slot_simulation": 3,
    # --- quantization (25) --------------------------------------------------------------------------------
    "test_quantization_kernels.py::test_lecture_worked_example": 1,
    "test_quantization_kernels.py::test_dequantize_by_hand": 1,
    "test_quantization_kernels.py::test_quantize_clamps_codes_to_the_integer_range": 2,
    "test_quantization_kernels.py::test_quantize_and_dequantize_with_one_scale_per_group": 2,
    "test_quantization_kernels.py::test_round_to_nearest_scales_and_round_trip": 2,
    "test_quantization_kernels.py::test_affine_quantization_represents_zero_exactly": 1,
    "test_quantization_kernels.py::test_unpack_int4_by_hand": 1,
    "test_quantization_kernels.py::test_pack_int4_layout_and_round_trip": 1,
    "test_quantization_kernels.py::test_int8_kv_encoding_uses_the_absmax_of_each_vector": 2,
    "test_quantization_kernels.py::test_llm_int8_without_outliers_is_vector_wise_int8": 2,
    "test_quantization_kernels.py::test_llm_int8_outlier_columns_run_in_full_precision": 2,
    "test_quantization_kernels.py::test_llm_int8_a_value_exactly_at_the_threshold_is_not_an_outlier": 2,
    "test_quantization_kernels.py::test_llm_int8_when_every_column_is_an_outlier": 1,
    "test_quantization_kernels.py::test_gptq_equals_the_column_by_column_reference": 3,
    "test_quantization_kernels.py::test_gptq_beats_round_to_nearest_on_the_layer_output": 2,
    # --- serving: block allocator, paged attention, continuous batching (11) ------------------------------
    "test_paged_serving.py::test_allocate_every_block_then_refuse": 2,
    "test_paged_serving.py::test_shared_blocks_are_freed_by_their_last_holder": 2,
    "test_paged_serving.py::test_random_operations_match_a_reference_count_model": 2,
    "test_paged_serving.py::test_paged_attention_matches_attention_over_the_gathered_keys": 2,
    "test_paged_serving.py::test_continuous_batching_step_by_hand": 2,
    "test_paged_serving.py::test_random_steps_match_the_rules": 1,
    # --- accounting, numeric and symbolic (14) ------------------------------------------------------------
    "test_accounting_formulas.py::test_kv_cache_bytes_by_hand": 1,
    "test_accounting_formulas.py::test_llama2_13b_on_an_h100_is_memory_bound_at_small_batch": 1,
    "test_accounting_formulas.py::test_decode_is_compute_bound_when_compute_takes_longer": 2,
    "test_accounting_formulas.py::test_a_short_prompt_prefill_is_bounded_by_reading_the_weights": 2,
    "test_accounting_formulas.py::test_a_small_gqa_model_in_fp32": 1,
    "test_accounting_formulas.py::test_matmul_cost": 1,
    "test_accounting_formulas.py::test_mlp_cost": 1,
    "test_accounting_formulas.py::test_attention_cost": 1,
    "test_accounting_formulas.py::test_the_lectures_intensity_limits": 1,
    "test_accounting_formulas.py::test_generation_flops_against_a_loop_over_steps": 1,
    "test_accounting_formulas.py::test_decode_step_memory_latency_and_throughput": 2,
    # --- data: the batch sampler (3) ----------------------------------------------------------------------
    "test_batch_sampler.py::test_windows_are_slices_and_targets_are_shifted_by_one": 1,
    "test_batch_sampler.py::test_the_only_window_of_a_stream_of_seq_len_plus_one_tokens": 1,
    "test_batch_sampler.py::test_every_valid_start_is_drawn_uniformly": 1,
}
