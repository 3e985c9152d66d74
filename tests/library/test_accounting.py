"""Accounting of the library beyond the graded formulas (tests/graded/test_accounting_formulas.py):
Llama 2 13B / GQA / DeepSeek-V2 numbers from the model shapes, FLOP counts of the real model (torch's
FlopCounterMode) for every attention variant, KV bytes of the real cache, and clear errors."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import adapters

from cs336_inference.accounting.formulas import kv_cache_bytes, kv_cache_bytes_per_token

SYM = adapters.get_symbols()
B, S, T, D, F, N, K, H, L, V, P = (SYM[c] for c in "BSTDFNKHLVP")


CROSS_CONFIG = dict(vocab_size=97, context_length=64, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=96)
VARIANTS = {  # every attention variant the model builds, on one small base
    "mha": dict(num_kv_heads=4), "gqa": {}, "mqa": dict(num_kv_heads=1),
    "cla": dict(kv_share_group=2), "sliding_window": dict(sliding_window=8, global_every=2),
    "mla": dict(attention_type="mla", num_kv_heads=None, kv_lora_rank=32, rope_head_dim=8),
    "mla_q_lora": dict(attention_type="mla", num_kv_heads=None, kv_lora_rank=32, rope_head_dim=8, q_lora_rank=24),
    "mla_cla": dict(attention_type="mla", num_kv_heads=None, kv_lora_rank=32, rope_head_dim=8, kv_share_group=2),
    "tied": dict(tie_embeddings=True), "window_sinks": dict(sliding_window=8, attention_sinks=2),
}


# --- Llama 2 13B: parameters, memory, latency (the lecture's numbers) ---------------------------

LLAMA2_13B = dict(V=32000, D=5120, F=13824, N=40, K=40, H=128, L=40)


def llama_parameter_shapes(V, D, F, N, K, H, L):
    """Every parameter tensor of a Llama-style model, as the checkpoint lists them."""
    shapes = [("embed", (V, D))]
    for i in range(L):
        shapes += [(f"{i}.q", (N * H, D)), (f"{i}.k", (K * H, D)), (f"{i}.v", (K * H, D)), (f"{i}.o", (D, N * H)),
                   (f"{i}.w1", (F, D)), (f"{i}.w2", (D, F)), (f"{i}.w3", (F, D)),
                   (f"{i}.ln1", (D,)), (f"{i}.ln2", (D,))]
    return shapes + [("ln_final", (D,)), ("lm_head", (V, D))]


def count(shapes, skip_norms=False):
    return sum(math.prod(s) for name, s in shapes if not (skip_norms and "ln" in name))


def test_llama2_13b_parameters_match_a_parameter_shape_list():
    shapes = llama_parameter_shapes(**LLAMA2_13B)
    model = adapters.get_real_model("llama2-13b")
    assert adapters.run_num_parameters(model, include_norms=True) == count(shapes)
    lecture = adapters.run_num_parameters(model)  # 2VD + 3DFL + (2DNH + 2DKH)L: no norm gains
    assert lecture == count(shapes, skip_norms=True)
    assert adapters.run_parameter_count_symbolic().subs({SYM[k]: v for k, v in LLAMA2_13B.items()}) == lecture
    assert round(lecture / 1e9, 1) == 13.0


def test_llama2_13b_on_h100_memory_latency_throughput():
    seq_len, bandwidth = 1024, 3.35e12
    weights = 2 * count(llama_parameter_shapes(**LLAMA2_13B), skip_norms=True)
    kv_per_seq = seq_len * 40 * 128 * 40 * 2 * 2   # S K H L (key, value) (bf16 bytes)
    for batch, fits in [(1, True), (64, True), (256, False)]:
        stats = adapters.run_transformer_performance_stats("llama2-13b", "H100", batch, seq_len, "bf16")
        memory = weights + batch * kv_per_seq
        assert stats.total_memory_bytes == memory
        assert stats.fits_in_memory is fits, f"B={batch}: {memory / 1e9:.1f} GB vs 80 GB"
        assert stats.bound == "memory"
        assert stats.latency_per_token_s == pytest.approx(memory / bandwidth, rel=1e-12)
        assert stats.throughput_tokens_per_s == pytest.approx(batch * bandwidth / memory, rel=1e-12)
        assert stats.ttft_s == stats.prefill_time_s > stats.latency_per_token_s
    # the lecture's rounded numbers: 8 ms / 125 tok/s at B=1; 240.8 GB at B=256
    one = adapters.run_transformer_performance_stats("llama2-13b", "H100", 1, seq_len)
    assert round(one.latency_per_token_s * 1e3) == 8 and round(one.throughput_tokens_per_s) == 125
    assert one.total_memory_bytes < 80e9 < adapters.run_transformer_performance_stats(
        "llama2-13b", "H100", 256, seq_len).total_memory_bytes


def test_gqa_k8_at_b64_fits_and_cuts_kv_five_times():
    mha = adapters.run_transformer_performance_stats("llama2-13b", "H100", 64, 1024)
    gqa_model = adapters.run_with_kv_heads(adapters.get_real_model("llama2-13b"), 8)
    gqa = adapters.run_transformer_performance_stats(gqa_model, "H100", 64, 1024)
    assert gqa.kv_cache_bytes * 5 == mha.kv_cache_bytes
    assert gqa.fits_in_memory and gqa.total_memory_bytes < mha.total_memory_bytes
    assert gqa.throughput_tokens_per_s > mha.throughput_tokens_per_s
    assert adapters.run_transformer_performance_stats(gqa_model, "H100", 256, 1024).fits_in_memory


def test_max_batch_size_and_ttft_of_llama2_13b():
    weights = 2 * count(llama_parameter_shapes(**LLAMA2_13B), skip_norms=True)
    kv_per_seq = 1024 * 40 * 128 * 40 * 2 * 2
    assert adapters.run_max_batch_size("llama2-13b", "H100", 1024) == int((80e9 - weights) // kv_per_seq) == 64
    # prefill of 1024 tokens is compute-bound: TTFT = FLOPs / peak, FLOPs = 2 x matmul weights x tokens
    # + attention (4 N S^2 H per layer) + the lm_head for the last position only
    stats = adapters.run_transformer_performance_stats("llama2-13b", "H100", 1, 1024)
    V, D = 32000, 5120
    flops = 2 * (weights // 2 - 2 * V * D) * 1024 + 4 * 40 * 1024 * 1024 * 128 * 40 + 2 * D * V
    assert stats.prefill_flops == flops
    assert stats.ttft_s == pytest.approx(flops / 989e12)


def test_with_kv_heads_on_configs_and_shapes():
    config = adapters.make_config(**CROSS_CONFIG)
    assert adapters.run_with_kv_heads(config, 1).num_kv_heads == 1 and config.num_kv_heads == 2
    llama = adapters.get_real_model("llama2-13b")
    assert adapters.run_with_kv_heads(llama, 8).num_kv_heads == 8 and llama.num_kv_heads == 40
    with pytest.raises(ValueError, match="GQA"):
        adapters.run_with_kv_heads(adapters.get_real_model("deepseek-v2"), 8)


def test_h100_accelerator_intensity_is_295():
    h100 = adapters.get_hardware_table()["H100"]
    assert (h100.peak_flops, h100.memory_bandwidth) == (989e12, 3.35e12)
    assert round(h100.accelerator_intensity) == 295
    for spec in adapters.get_hardware_table().values():
        assert spec.source and spec.peak_flops > 0 and spec.memory_bandwidth > 0


def test_deepseek_v2_mla_caches_latent_plus_rope_per_layer():
    ds = adapters.get_real_model("deepseek-v2")
    assert kv_cache_bytes_per_token(ds, 1) == (512 + 64) * ds.num_layers
    mha = ds.replace(attention_type="gqa")   # same heads without the latent: 2 N H per layer
    assert kv_cache_bytes_per_token(mha, 1) == 2 * 128 * 128 * ds.num_layers
    # the paper: 236B parameters in total, 21B activated per token
    assert adapters.run_num_parameters(ds) == pytest.approx(236e9, rel=0.01)
    assert adapters.run_num_parameters(ds, active_only=True) == pytest.approx(21e9, rel=0.03)


@pytest.mark.parametrize("name,billions", [("llama2-70b", 69.0), ("llama3-8b", 8.0), ("llama3-70b", 70.6)])
def test_other_llamas_have_their_published_size(name, billions):
    assert round(adapters.run_num_parameters(adapters.get_real_model(name)) / 1e9, 1) == billions
    assert adapters.get_real_model(name).source


# --- cross-checks against the model we run ----------------------------------------------------

def counted_flops(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameters_flops_and_kv_bytes_match_the_model_we_run(variant):
    """FlopCounterMode counts matmul-family ops only (mm, bmm, ...), as the formula does, so the two
    agree exactly (tolerance: 0). Elementwise work (RMSNorm, RoPE, softmax, SiLU, residuals) is in
    neither; it is what separates both from the true op count. MLA with a cache attends over the
    latents (absorbed form), so prefill/decode use mla_absorbed=True."""
    config = adapters.make_config(**{**CROSS_CONFIG, **VARIANTS[variant]})
    model = adapters.make_model(config)
    assert adapters.run_num_parameters(config, include_norms=True) == model.num_parameters()
    ids = torch.randint(0, 97, (2, 12))
    assert counted_flops(lambda: model(ids)) == adapters.run_forward_flops(config, 2, 12)
    absorbed = config.attention_type == "mla"
    cache = adapters.make_kv_cache(model, 2, 20)
    prefill = counted_flops(lambda: model(ids, cache=cache, last_only=True))
    assert prefill == adapters.run_forward_flops(config, 2, 12, 0, last_only=True, mla_absorbed=absorbed)
    decode = counted_flops(lambda: model(ids[:, :1], cache=cache))
    assert decode == adapters.run_forward_flops(config, 2, 1, 12, mla_absorbed=absorbed)
    element = model.lm_head.weight.element_size()
    assert cache.bytes_per_token == kv_cache_bytes_per_token(config, element)


def test_the_two_flops_per_weight_rule_misses_exactly_attention():
    config = adapters.make_config(**CROSS_CONFIG)
    model = adapters.make_model(config)
    matmul_weights = model.num_parameters() - 97 * 64 - (2 * 4 + 1) * 64   # minus embedding table, norm gains
    attention = 4 * 2 * 4 * 12 * 12 * 16 * 4                               # 4 B N T S H L
    assert adapters.run_forward_flops(config, 2, 12) == 2 * matmul_weights * 2 * 12 + attention


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_kv_bytes_per_token_match_the_real_cache(num_kv_heads):
    config = adapters.make_config(**{**CROSS_CONFIG, "num_kv_heads": num_kv_heads})
    model = adapters.make_model(config)
    batch, seq = 3, 40
    cache = adapters.make_kv_cache(model, batch, seq)
    element = model.lm_head.weight.element_size()
    assert cache.nbytes / (batch * seq) == kv_cache_bytes_per_token(config, element)
    assert cache.nbytes == kv_cache_bytes(config, batch, seq, element)
    assert cache.bytes_per_token == kv_cache_bytes_per_token(config, element)


# --- bad inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0), "batch_size"), (dict(batch_size=-3), "batch_size"),
    (dict(seq_len=0), "seq_len"), (dict(seq_len=10**6), "context_length"),
    (dict(hardware="H900"), "unknown hardware.*H100"), (dict(precision="fp12"), "unknown precision.*bf16"),
    (dict(config="llama9"), "unknown model.*llama2-13b"),
])
def test_bad_inputs_raise_clear_errors(kwargs, match):
    args = dict(config="llama2-13b", hardware="H100", batch_size=1, seq_len=1024, precision="bf16") | kwargs
    with pytest.raises(ValueError, match=match):
        adapters.run_transformer_performance_stats(**args)


def test_a_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="batch_size must be a positive int, got float 1.5"):
        adapters.run_transformer_performance_stats("llama2-13b", "H100", 1.5, 1024, "bf16")


def test_more_bad_inputs():
    config = adapters.make_config(**CROSS_CONFIG)
    with pytest.raises(ValueError, match="batch_size"):
        kv_cache_bytes(config, 0, 10)
    with pytest.raises(TypeError, match="ModelConfig"):
        kv_cache_bytes_per_token("not a config")
    with pytest.raises(ValueError, match="num_new_tokens"):
        adapters.run_forward_flops(config, 1, 0)
    with pytest.raises(ValueError, match="num_cached"):
        adapters.run_forward_flops(config, 1, 1, -1)
    with pytest.raises(ValueError, match="divide num_heads"):
        adapters.run_with_kv_heads(adapters.get_real_model("llama2-13b"), 7)
    with pytest.raises(ValueError, match="peak_flops"):
        spec = type(adapters.get_hardware_table()["H100"])
        spec("x", peak_flops=-1.0, memory_bandwidth=1.0, memory_bytes=None, source="")
    with pytest.raises(ValueError, match="num_layers"):
        adapters.get_real_model("llama2-13b").replace(num_layers=0)
