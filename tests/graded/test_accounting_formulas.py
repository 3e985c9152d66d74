"""Graded: the lecture's accounting, numeric (KV bytes, memory, latency, throughput, TTFT) and symbolic
(sympy costs of a matmul, an MLP, attention, generation, a decode step). Expected values are computed
here by hand from the definitions; sympy answers are checked by substituting numbers by symbol name
(so any symbol assumptions work) and, for the lecture's limits, symbolically."""

import math
from fractions import Fraction

import pytest
import sympy as sp
from adapters import (run_attention_cost, run_decode_cost, run_generation_flops, run_inference_stats,
                      run_kv_cache_bytes, run_latent_kv_cache_bytes, run_matmul_cost, run_mlp_cost,
                      run_window_kv_cache_bytes)

LLAMA2_13B = dict(vocab_size=32000, d_model=5120, d_ff=13824, num_layers=40, num_heads=40, num_kv_heads=40,
                  head_dim=128)
H100 = dict(peak_flops=989e12, memory_bandwidth=3.35e12)


def params(m) -> int:
    """2VD + 3DFL + (2DNH + 2DKH)L, written out."""
    V, D, F, L, N, K, H = (m[k] for k in ("vocab_size", "d_model", "d_ff", "num_layers", "num_heads", "num_kv_heads",
                                          "head_dim"))
    return 2 * V * D + 3 * D * F * L + (2 * D * N * H + 2 * D * K * H) * L


def expected_stats(m, hw, B, S, e) -> dict:
    P, V, D = params(m), m["vocab_size"], m["d_model"]
    N, H, L = m["num_heads"], m["head_dim"], m["num_layers"]
    kv = B * S * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 2 * e
    memory = P * e + kv
    decode_flops = 2 * B * (P - V * D) + 4 * B * N * S * H * L
    latency = max(memory / hw["memory_bandwidth"], decode_flops / hw["peak_flops"])
    prefill_flops = 2 * B * S * (P - 2 * V * D) + 4 * B * N * S * S * H * L + 2 * B * D * V
    return dict(num_parameters=P, weight_bytes=P * e, kv_cache_bytes=kv, total_memory_bytes=memory,
                decode_flops=decode_flops, latency_per_token_s=latency, throughput_tokens_per_s=B / latency,
                prefill_flops=prefill_flops,
                prefill_time_s=max(prefill_flops / hw["peak_flops"], memory / hw["memory_bandwidth"]))


def check_stats(got, want):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), f"{key}: got {got[key]}, want {value}"


@pytest.mark.parametrize("B, S, L, K, H, e", [(1, 1024, 40, 40, 128, 2), (64, 1024, 40, 8, 128, 2),
                                               (3, 7, 2, 1, 16, 4), (5, 100, 12, 4, 64, 1)])
def test_kv_cache_bytes_by_hand(B, S, L, K, H, e):
    assert run_kv_cache_bytes(B, S, L, K, H, e) == 2 * B * S * L * K * H * e   # key and value, every layer


@pytest.mark.parametrize("B, S, L, K, H, W, every, e", [(1, 100, 4, 2, 16, 32, None, 2), (2, 20, 4, 2, 16, 32, None, 2),
                                                      (3, 4096, 6, 8, 128, 1024, 3, 2), (1, 50, 5, 1, 8, 50, 2, 4),
                                                      (2, 51, 5, 1, 8, 50, 1, 1)])
def test_a_sliding_window_caps_the_local_layers(B, S, L, K, H, W, every, e):
    layers = [S if every is not None and (i + 1) % every == 0 else min(S, W) for i in range(L)]   # positions kept
    assert run_window_kv_cache_bytes(B, S, L, K, H, W, every, e) == sum(2 * B * n * K * H * e for n in layers)


@pytest.mark.parametrize("B, S, L, C, R, e", [(1, 1024, 60, 512, 64, 2), (4, 7, 3, 16, 4, 4), (2, 100, 1, 8, 2, 1)])
def test_mla_caches_one_latent_and_one_rope_key_per_position(B, S, L, C, R, e):
    assert run_latent_kv_cache_bytes(B, S, L, C, R, e) == B * S * L * (C + R) * e


def test_llama2_13b_on_an_h100_is_memory_bound_at_small_batch():
    for B in (1, 64):
        got = run_inference_stats(LLAMA2_13B, H100, B, 1024, 2)
        want = expected_stats(LLAMA2_13B, H100, B, 1024, 2)
        check_stats(got, want)
        assert got["latency_per_token_s"] == pytest.approx(want["total_memory_bytes"] / 3.35e12, rel=1e-9)
    one = run_inference_stats(LLAMA2_13B, H100, 1, 1024, 2)   # the lecture's rounded numbers
    assert round(one["latency_per_token_s"] * 1e3) == 8 and round(one["throughput_tokens_per_s"]) == 125


def test_decode_is_compute_bound_when_compute_takes_longer():
    slow_compute = dict(peak_flops=2e12, memory_bandwidth=3.35e12)
    got = run_inference_stats(LLAMA2_13B, slow_compute, 64, 512, 2)
    want = expected_stats(LLAMA2_13B, slow_compute, 64, 512, 2)
    assert want["decode_flops"] / 2e12 > want["total_memory_bytes"] / 3.35e12      # this case is compute-bound
    check_stats(got, want)


def test_a_short_prompt_prefill_is_bounded_by_reading_the_weights():
    got = run_inference_stats(LLAMA2_13B, H100, 1, 4, 2)
    want = expected_stats(LLAMA2_13B, H100, 1, 4, 2)
    assert want["prefill_time_s"] == want["total_memory_bytes"] / 3.35e12           # memory floor wins here
    check_stats(got, want)


def test_a_small_gqa_model_in_fp32():
    model = dict(vocab_size=1000, d_model=256, d_ff=704, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32)
    hw = dict(peak_flops=1e12, memory_bandwidth=50e9)
    for B, S in [(1, 16), (32, 256)]:
        check_stats(run_inference_stats(model, hw, B, S, 4), expected_stats(model, hw, B, S, 4))


# --- symbolic ---------------------------------------------------------------------------------------------

LETTERS = "B S T D F N K H L V P"
SYM = dict(zip(LETTERS.split(), sp.symbols(LETTERS, positive=True)))
POINTS = [dict(B=3, S=11, T=5, D=64, F=176, N=4, K=2, H=16, L=3, V=1000, P=77777, bandwidth=7),
          dict(B=1, S=1, T=1, D=8, F=8, N=1, K=1, H=8, L=1, V=2, P=5, bandwidth=3)]


def at(expr, values) -> Fraction:
    """expr with numbers substituted for its symbols by name (exact)."""
    expr = sp.sympify(expr)
    unknown = {s.name for s in expr.free_symbols} - set(values)
    assert not unknown, f"unexpected symbols {sorted(unknown)} in {expr}"
    value = sp.nsimplify(expr.subs({s: values[s.name] for s in expr.free_symbols}))
    assert value.is_Rational, f"{expr} did not evaluate to a number: {value}"
    return Fraction(int(value.p), int(value.q))


def ours(expr):
    """expr over our positive symbols (for limits)."""
    expr = sp.sympify(expr)
    return expr.subs({s: SYM[s.name] for s in expr.free_symbols if s.name in SYM})


@pytest.mark.parametrize("v", POINTS)
def test_matmul_cost(v):
    B, D, F = (v[c] for c in "BDF")
    flops, nbytes = run_matmul_cost()
    assert at(flops, v) == 2 * B * D * F and at(nbytes, v) == 2 * (B * D + D * F + B * F)


@pytest.mark.parametrize("v", POINTS)
def test_mlp_cost(v):
    B, T, D, F = (v[c] for c in "BTDF")
    flops, nbytes = run_mlp_cost()
    assert at(flops, v) == 6 * B * T * D * F and at(nbytes, v) == 4 * B * T * D + 4 * B * T * F + 6 * D * F


@pytest.mark.parametrize("v", POINTS)
def test_attention_cost(v):
    B, S, T, D = (v[c] for c in "BSTD")
    flops, nbytes = run_attention_cost()
    assert at(flops, v) == 4 * B * S * T * D and at(nbytes, v) == 4 * B * S * D + 4 * B * T * D


def test_the_lectures_intensity_limits():
    B, S, T, D, F = (SYM[c] for c in "BSTDF")
    flops, nbytes = run_matmul_cost()
    assert sp.simplify(sp.limit(sp.limit(ours(flops) / ours(nbytes), D, sp.oo), F, sp.oo) - B) == 0
    flops, nbytes = run_mlp_cost()
    assert sp.simplify(sp.limit(sp.limit(ours(flops) / ours(nbytes), D, sp.oo), F, sp.oo) - B * T) == 0
    flops, nbytes = run_attention_cost()
    generation = sp.simplify((ours(flops) / ours(nbytes)).subs(T, 1))
    assert sp.simplify(generation - S / (S + 1)) == 0 and B not in generation.free_symbols


@pytest.mark.parametrize("v", POINTS)
def test_generation_flops_against_a_loop_over_steps(v):
    T, P, L, D = (v[c] for c in "TPLD")
    flops = run_generation_flops()
    naive = sum(2 * P * t + 4 * L * D * t * t for t in range(1, T + 1))    # step t runs t tokens
    cached = sum(2 * P + 4 * L * D * t for t in range(1, T + 1))           # step t: 1 token over t keys
    assert at(flops["naive"], v) == naive and at(flops["cached"], v) == cached


@pytest.mark.parametrize("v", POINTS)
def test_decode_step_memory_latency_and_throughput(v):
    B, S, K, H, L = (v[c] for c in "BSKHL")
    cost = run_decode_cost()
    kv = S * K * H * L * 2 * 2                                 # positions x heads x dims x layers x (K, V) x bf16
    weights = 2 * (2 * v["V"] * v["D"] + 3 * v["D"] * v["F"] * L + (2 * v["D"] * v["N"] * H + 2 * v["D"] * K * H) * L)
    assert at(cost["kv_cache_bytes_per_sequence"], v) == kv
    assert at(cost["memory"], v) == B * kv + weights
    assert at(cost["latency"], v) == Fraction(B * kv + weights, v["bandwidth"])
    assert at(cost["throughput"], v) == Fraction(B * v["bandwidth"], B * kv + weights)
    assert math.isclose(float(at(cost["throughput"], v) * at(cost["latency"], v)), B)
