"""The worked answers to the exercises at the end of each notebook (`notebooks/answers/NN_topic.py`, the
ones a student opens), checked: each answers notebook runs here as plain Python, and the values it
computes are compared with an independent computation written in the test. Small models, one thread:
the whole file runs in a few seconds."""

import runpy
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from cs336_inference import generate

pytestmark = pytest.mark.usefixtures("one_thread")

ANSWERS = Path(__file__).resolve().parents[2] / "notebooks" / "answers"


@cache
def answers(name: str) -> dict:
    """The globals of notebooks/answers/NAME.py after running it top to bottom (once per session)."""
    return runpy.run_path(str(ANSWERS / f"{name}.py"), run_name="__main__")


# --- 00 generation --------------------------------------------------------------------------------

def test_00_exercise_1_own_greedy_loop_reproduces_generate():
    ns = answers("00_generation")
    assert len(ns["my_tokens"]) == 32
    assert ns["my_tokens"] == generate(ns["model"], [ns["prompt"]], 32).tokens[0]


def test_00_exercise_2_cache_bytes_from_the_formula():
    ns = answers("00_generation")
    c = ns["config"]
    by_hand = 2 * 8 * c.num_kv_heads * 512 * (c.d_model // c.num_heads) * c.num_layers * 4   # K and V, fp32
    assert ns["predicted_bytes"] == ns["measured_bytes"] == by_hand
    assert ns["model"].new_cache(batch_size=8, max_seq_len=512).nbytes == by_hand


def test_00_exercise_3_positions_run_through_the_model():
    ns = answers("00_generation")
    P, N = ns["P"], ns["N"]
    assert ns["positions"] == {False: sum(P + t for t in range(N)), True: P + N - 1}


# --- 01 arithmetic intensity ----------------------------------------------------------------------

LLAMA2_13B = dict(V=32000, D=5120, F=13824, N=40, H=128, L=40)   # from the Llama 2 paper, written out here


def _llama2_13b_params(K: int) -> int:
    V, D, F, N, H, L = (LLAMA2_13B[k] for k in "VDFNHL")
    return 2 * V * D + 3 * D * F * L + (2 * D * N * H + 2 * D * K * H) * L


def test_01_exercise_1_smallest_compute_bound_batch():
    by_hand = next(b for b in range(1, 4096) if 2 * b * 4096 * 4096 / (2 * (b * 4096 + 4096 * 4096 + b * 4096))
                   > 989e12 / 3.35e12)
    assert answers("01_arithmetic_intensity")["smallest_batch"] == by_hand
    assert 295 < by_hand < 450   # above B = 295: the D, F terms do not vanish at 4096


def test_01_exercise_2_largest_batch_that_fits():
    largest = answers("01_arithmetic_intensity")["largest_batch"]
    for K in (40, 8):
        kv_per_sequence = 1024 * K * 128 * 40 * 2 * 2
        assert largest[K] == int((80e9 - 2 * _llama2_13b_params(K)) // kv_per_sequence)
    assert largest[8] > 5 * largest[40]   # the cache shrinks 5x, the weights a little too


def test_01_exercise_3_context_where_the_cache_outweighs_the_weights():
    answer = answers("01_arithmetic_intensity")["crossover_context"]
    by_hand = 2 * _llama2_13b_params(40) / (40 * 128 * 40 * 2 * 2)
    assert answer == pytest.approx(by_hand) and 30_000 < answer < 33_000   # far beyond the 4096 context at B = 1


# --- 02 KV cache ----------------------------------------------------------------------------------

def test_02_exercise_1_gqa_cache_shrinks_n_over_k():
    cache_bytes = answers("02_kv_cache")["cache_bytes"]
    for K in (4, 2, 1):
        assert cache_bytes[K] == 2 * K * 128 * 16 * 4 * 4   # K, V x K heads x S x H x L x fp32


def test_02_exercise_2_mla_against_mha_of_the_same_heads():
    ratio = answers("02_kv_cache")["mla_ratio"]
    assert ratio == pytest.approx(2 * 128 * 128 / (512 + 64))   # 2 N H over C + R, per layer (N = 128, H = 128)


def test_02_exercise_3_receptive_field_of_a_window():
    ns = answers("02_kv_cache")
    L, W = ns["L"], ns["W"]
    assert ns["changed_positions"] == list(range(L * (W - 1) + 1))   # positions 0 .. 60 see token 0, 61 on do not
    # independently: token 0 reaches position p iff a chain of L hops of at most W - 1 positions gets there
    reach = {0}
    for _ in range(L):
        reach = {p + d for p in reach for d in range(W) if p + d < 80}
    assert ns["changed_positions"] == sorted(reach)


# --- 03 quantization ------------------------------------------------------------------------------

def test_03_exercise_1_one_outlier_ruins_a_per_tensor_scale_not_per_channel_ones():
    ns = answers("03_quantization")
    mse, w = ns["other_rows_mse"], ns["w"]
    assert mse[("spiked", "channel")] == mse[("plain", "channel")]   # row 0 has its own scale
    assert mse[("spiked", "tensor")] > 100 * mse[("plain", "tensor")]
    # by hand: one absmax scale over the tensor is 100 / 127; every other weight is below half a step, so it
    # rounds to 0 and the error is the weights themselves
    assert w[1:].abs().max() < 100 / 127 / 2 and ns["zeroed"] == 1.0
    assert mse[("spiked", "tensor")] == pytest.approx(float(w[1:].pow(2).mean()))


def test_03_exercise_2_int4_packing_round_trips_and_halves_the_bytes():
    ns = answers("03_quantization")
    packed, codes = ns["packed"], ns["codes"]
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16) and packed.nbytes * 2 == codes.nbytes
    assert ns["round_trip_ok"] and set(codes.flatten().tolist()) == set(range(-8, 8))
    low, high = (packed & 0xF).to(torch.int16), (packed >> 4).to(torch.int16)   # two codes per byte, by hand
    assert sorted(set(low.flatten().tolist()) | set(high.flatten().tolist())) == list(range(16))


def test_03_exercise_3_gptq_gain_holds_on_text_it_was_not_calibrated_on():
    ns = answers("03_quantization")
    x = ns["held_out"].reshape(-1, ns["held_out"].shape[-1]).double()

    def error(w_hat):   # ||X W^T - X W_hat^T||_F, written out
        return float(torch.linalg.matrix_norm(x @ ns["weight"].double().T - x @ w_hat.double().T))

    assert error(ns["rtn_weight"]) == pytest.approx(ns["held_out_error"]["rtn"])
    assert error(ns["gptq_weight"]) == pytest.approx(ns["held_out_error"]["gptq"])
    assert error(ns["gptq_weight"]) < 0.7 * error(ns["rtn_weight"])


# --- 04 pruning and distillation ------------------------------------------------------------------

def test_04_exercise_1_importance_beats_random_channels():
    bpb = answers("04_pruning_distillation")["halved_bpb"]
    assert bpb["target"] < bpb["by importance"] < bpb["at random"] - 0.1


def test_04_exercise_2_parameter_count_of_the_pruned_model():
    pruned = answers("04_pruning_distillation")["pruned"]
    c = pruned.config
    assert (c.num_layers, c.num_kv_heads, c.d_ff) == (3, 1, 320)
    by_hand = sum(p.numel() for p in pruned.parameters())
    V, D, F, N, K, H, L = c.vocab_size, c.d_model, c.d_ff, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    assert answers("04_pruning_distillation")["predicted_parameters"] == by_hand == (
        2 * V * D + L * (3 * D * F + 2 * D * N * H + 2 * D * K * H + 2 * D) + D)


def test_04_exercise_3_drop_the_least_important_layer():
    ns = answers("04_pruning_distillation")
    bpb = ns["dropped_bpb"]
    assert bpb["least important dropped"] < bpb["most important dropped"] - 1.0
    scores = ns["scores"]["layers"]
    assert ns["least"].config.num_layers == ns["most"].config.num_layers == len(scores) - 1


# --- 05 speculative sampling ----------------------------------------------------------------------

def test_05_exercise_1_half_accepted_and_the_residual_on_one_token():
    ns = answers("05_speculative_sampling")
    p, q, d = ns["p"], ns["q"], ns["d"]
    assert ns["alpha"] == sum(min(a, b) for a, b in zip(p, q)) == 0.5   # alpha
    positive = [max(b - a, 0) for a, b in zip(p, q)]
    assert d.residual == tuple(r / sum(positive) for r in positive) == (1, 0, 0) and d.output == q


@pytest.mark.parametrize("v", [1, 1.5])
def test_05_exercise_2_when_one_draft_token_is_best(v):
    from cs336_inference.generation import optimal_gamma

    ns = answers("05_speculative_sampling")
    alpha = ns["a"]

    def speedup(gamma, c):   # E(gamma) / (gamma c + v), written out
        return sum(alpha**k for k in range(gamma + 1)) / (gamma * c + v)

    threshold = ns["threshold"][v]
    assert speedup(1, threshold) == pytest.approx(speedup(2, threshold))   # the break-even point
    for c in (0.5 * threshold, 0.9 * threshold):
        assert optimal_gamma(alpha, c, verify_cost=v) > 1
    for c in (1.1 * threshold, 2 * threshold, 10 * threshold):
        assert optimal_gamma(alpha, c, verify_cost=v) == 1


# --- 06 continuous batching -----------------------------------------------------------------------

def test_06_exercise_1_padding_rows_of_static_batching():
    ns = answers("06_continuous_batching")
    for policy in ("static", "continuous"):
        result = ns["runs"][(policy, 4)]
        assert ns["useful_rows"][policy] == sum(len(t) for o in result.outputs for t in o.tokens)
    assert ns["padding_rows"]["static"] > 0 and ns["padding_rows"]["continuous"] == 0


def test_06_exercise_2_one_sequence_at_a_time_leaves_nothing_to_schedule():
    steps = answers("06_continuous_batching")["steps_taken"]
    assert steps[("static", 1)] == steps[("continuous", 1)]
    assert steps[("continuous", 4)] < steps[("static", 4)]


def test_06_exercise_3_ttft_p99_by_hand():
    ns = answers("06_continuous_batching")
    result = ns["runs"][("continuous", 4)]
    ttft = sorted(min(t[0] for t in o.token_times if t) - o.arrival_time for o in result.outputs)
    # p99 of 6 values with linear interpolation: between the two largest, 95% of the way
    by_hand = ttft[-2] + 0.95 * (ttft[-1] - ttft[-2])
    assert ns["ttft_p99"] == pytest.approx(by_hand) == pytest.approx(result.summary()["ttft_p99_s"])
    assert by_hand == pytest.approx(np.percentile(ttft, 99))


# --- 07 paged attention ---------------------------------------------------------------------------

def test_07_exercise_1_internal_fragmentation_by_hand():
    s = answers("07_paged_attention")["fragmentation_stats"]
    lengths, bs = [37, 5, 60], 16
    reserved = sum(-(-n // bs) * bs for n in lengths)          # ceil(n / bs) blocks each
    assert (s.reserved_tokens, s.used_tokens) == (reserved, sum(lengths)) == (128, 102)
    assert s.internal_fragmentation_tokens == reserved - sum(lengths)   # only the last blocks are partly empty


def test_07_exercise_2_copy_on_write_after_two_forks():
    ns = answers("07_paged_attention")
    # the last block is shared three ways: the first two writers copy it, the last one owns it by then
    assert [len(c) for c in ns["copies"].values()] == [1, 1, 0]
    assert ns["blocks_in_use"] == 2 + 3                  # two shared full blocks, three private tails
    assert ns["used_slots"] == 8 + 3 * 3                 # shared slots once, each tail's 2 + 1 tokens


def test_07_exercise_3_three_requests_behind_one_system_prompt():
    ns = answers("07_paged_attention")
    assert ns["cached_prompt_tokens"] == [0, 64, 64]
    assert ns["shared_blocks_total"] == 4 + 3             # shared prefix + one tail each


# --- 08 alternatives ------------------------------------------------------------------------------

def test_08_exercise_1_linear_attention_state_by_hand():
    ns = answers("08_alternatives")
    N, H, d, L = 2, 32, 4, 2
    per_layer = N * (1 + d + d * d) * H + N * (1 + d + d * d) + 3 * (2 * N * d + N * H)   # state, z, conv
    assert ns["by_hand"] == ns["measured"] == L * per_layer * 4
    kv_at_64 = 2 * 2 * 32 * 64 * L * 4                                                    # K, V x heads x H x T x L
    assert ns["attention_kv_at_64"] == kv_at_64
    state = {dd: L * 4 * (N * (1 + dd + dd * dd) * (H + 1) + 3 * (2 * N * dd + N * H)) for dd in range(1, 33)}
    assert ns["smallest_d"] == min(dd for dd, b in state.items() if b > kv_at_64)


def test_08_exercise_2_jamba_crossover_from_the_paper_numbers():
    mamba_layers, attention_layers = 28, 4
    state = mamba_layers * (8192 * 16 + 3 * 8192) * 2       # d_inner = 2 x 4096, d_state 16, conv 4; bf16
    kv_per_token = attention_layers * 2 * 8 * 128 * 2       # K and V, 8 KV heads of 128
    assert answers("08_alternatives")["crossover"] == pytest.approx(state / kv_per_token)


def test_08_exercise_3_tokens_per_pass_before_compute_binds():
    assert answers("08_alternatives")["free_tokens"] == int(989e12 / 3.35e12) == 295


# --- 09 tensor parallelism ------------------------------------------------------------------------

def test_09_exercise_1_smollm2_bytes_per_decode_step():
    # 2 all-reduces x 30 layers x B x 576 values x 2 bytes (bf16), whatever the world size
    assert answers("09_tensor_parallel")["smollm2_bytes"] == {1: 2 * 30 * 576 * 2, 64: 2 * 30 * 64 * 576 * 2}


def test_09_exercise_2_bandwidth_term_meets_the_latency_term():
    ns = answers("09_tensor_parallel")
    B = ns["crossover_batch"]
    n = B * 8192 * 2
    assert 2 * 7 / 8 * n / 100e9 == pytest.approx(2 * 7 * 5e-6)          # the ring's two terms, written out here
    assert B == pytest.approx(8 * 5e-6 * 100e9 / (8192 * 2)) and round(B) == 244
    assert ns["bandwidth_term"] == pytest.approx(ns["latency_term"]) == pytest.approx(70e-6)


def test_09_exercise_3_what_rank_0_of_2_holds():
    ns = answers("09_tensor_parallel")
    c = ns["whole"].config
    H = c.d_model // c.num_heads
    attention = c.d_model * (c.num_heads + 2 * c.num_kv_heads) * H + c.num_heads * H * c.d_model
    ffn = 3 * c.d_model * c.d_ff
    whole_params = sum(p.numel() for p in ns["whole"].parameters())
    shared = whole_params - c.num_layers * (attention + ffn)        # embedding, norms, output head: kept whole
    assert ns["rank0_params"] == shared + c.num_layers * (attention + ffn) // 2
    assert ns["parameter_fraction"] > 0.5 and ns["cache_fraction"] == 0.5


def test_05_exercise_3_tokens_per_pass_and_best_gamma():
    ns = answers("05_speculative_sampling")
    rates = (0.6, 0.45, 0.35, 0.3)
    # E(gamma) = sum over k = 0..gamma of the product of the first k rates (written out here)
    assert ns["tokens_per_pass"](rates, 2) == pytest.approx(1 + 0.6 + 0.6 * 0.45)
    assert ns["tokens_per_pass"](rates, 4) == pytest.approx(1 + 0.6 + 0.27 + 0.27 * 0.35 + 0.27 * 0.35 * 0.3)

    def speedup(r, g, c):
        e, kept = 1.0, 1.0
        for a in r[:g]:
            kept *= a
            e += kept
        return e / (g * c + 1 + 0.1 * g)
    for name, r, c in (("medusa", rates, 0.0), ("eagle", (0.75, 0.7, 0.7, 0.68, 0.65), 0.1)):
        want = max(range(1, len(r) + 1), key=lambda g: speedup(r, g, c))
        assert ns["best"][name][0] == want
