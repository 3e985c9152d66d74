"""A quantized TransformerLM: true bytes, cached decode = its own full forward, generate unchanged,
clear errors that leave the original model bit-identical, and the int8 KV cache."""

import math

import pytest
import torch
from adapters import (get_model_nbytes, make_config, make_kv_cache, make_model, make_quantized_kv_cache,
                      run_generate, run_model, run_quantize_kv_cache, run_quantize_model, run_set_quantized_kernel)

CFG = dict(vocab_size=257, context_length=48, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128)
CALIB = [torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def model():
    return make_model(make_config(**CFG), seed=0)


def _bit_snapshot(model):
    return {k: v.detach().clone().view(torch.uint8) if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}


def _assert_bit_identical(model, snapshot):
    now = _bit_snapshot(model)
    assert now.keys() == snapshot.keys()
    for k in now:
        assert torch.equal(now[k], snapshot[k]), f"{k} changed after a failed call"


METHODS = [("rtn", 8, None), ("rtn", 4, 32), ("rtn", 3, 16), ("gptq", 4, 32), ("gptq", 3, None), ("awq", 4, 32),
           ("awq", 3, 32), ("fp8", 8, None), ("llm_int8", 8, None)]


@pytest.mark.parametrize("method,bits,group_size", METHODS)
def test_quantized_cached_decode_equals_its_full_forward(model, method, bits, group_size):
    snapshot = _bit_snapshot(model)
    # the reference kernel: fp32 activations, so cached and full forwards agree to fp32 rounding
    # (the packed kernels' bf16 activations are checked in test_quantized_kernels.py)
    q = run_quantize_model(model, method, bits, group_size, CALIB, kernel="reference")
    _assert_bit_identical(model, snapshot)          # quantize_model works on a copy
    x = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        full = run_model(q, x)
        cache = make_kv_cache(q, 2)
        steps = [run_model(q, x[:, :12], cache)]
        steps += [run_model(q, x[:, t:t + 1], cache) for t in range(12, 20)]
        ref = run_model(model, x)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    assert not torch.equal(full, ref), "the quantized model should differ from the original"
    assert (full.softmax(-1) - ref.softmax(-1)).abs().max() < 0.5, "quantized model is far off the original"


def _naive_rtn_fp16_scales(w, bits, group, symmetric):
    """Round to nearest per group of `group` columns (rows if None), scales computed in float32 and stored
    in float16 as the quantized layer keeps them: the weight the quantized model must compute with."""
    g = group or w.shape[1]
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], g):
        chunk = w[:, start:start + g].float()
        if symmetric:
            lo_code, hi_code = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
            scale, zero = chunk.abs().amax(1, keepdim=True) / hi_code, torch.zeros(w.shape[0], 1)
        else:
            lo_code, hi_code = 0, 2**bits - 1
            lo, hi = chunk.amin(1, keepdim=True).clamp(max=0), chunk.amax(1, keepdim=True).clamp(min=0)
            scale = (hi - lo) / hi_code
            zero = (-torch.round(lo / scale)).clamp(lo_code, hi_code)
        codes = torch.clamp(torch.round(chunk / scale) + zero, lo_code, hi_code)
        out[:, start:start + g] = (codes - zero) * scale.half().float()
    return out


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (8, None, True), (3, 16, False)])
def test_rtn_model_computes_with_the_naively_rounded_weights(model, bits, group_size, symmetric):
    """Not only self-consistent: its logits are those of the original model whose block weights were
    rounded here, by a loop (a "quantizer" that merely perturbs the weights fails)."""
    q = run_set_quantized_kernel(run_quantize_model(model, "rtn", bits, group_size, symmetric=symmetric),
                                 "reference")   # fp32 dequantize-then-matmul (the packed kernels run in bf16)
    reference = make_model(make_config(**CFG))
    state = {k: (_naive_rtn_fp16_scales(v, bits, group_size, symmetric) if k.startswith("layers.") and v.dim() == 2
                 else v) for k, v in model.state_dict().items()}
    reference.load_state_dict(state)
    x = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(run_model(q, x), run_model(reference, x), atol=1e-5, rtol=1e-5)


def test_generate_runs_unchanged_on_a_quantized_model(model):
    q = run_quantize_model(model, "gptq", 4, 32, CALIB)
    cached = run_generate(q, [[1, 2, 3], [4, 5]], max_new_tokens=8)
    naive = run_generate(q, [[1, 2, 3], [4, 5]], max_new_tokens=8, use_cache=False)
    assert cached.tokens == naive.tokens


def _linear_shapes(cfg):
    D, F, H = cfg["d_model"], cfg["d_ff"], cfg["d_model"] // cfg["num_heads"]
    N, K = cfg["num_heads"], cfg["num_kv_heads"]
    per_layer = [(N * H, D), (K * H, D), (K * H, D), (D, N * H), (F, D), (D, F), (F, D)]   # (O, I)
    return per_layer * cfg["num_layers"]


@pytest.mark.parametrize("bits,group_size,symmetric", [(8, None, True), (4, 32, False), (3, 16, False)])
def test_measured_bytes_are_the_true_packed_size(model, bits, group_size, symmetric):
    q = run_quantize_model(model, "rtn", bits, group_size, symmetric=symmetric)
    V, D, L = CFG["vocab_size"], CFG["d_model"], CFG["num_layers"]
    kept = (2 * V * D + (2 * L + 1) * D) * 4                   # embedding, lm_head, norms in fp32
    expected = kept
    for O, I in _linear_shapes(CFG):
        groups = I // (group_size or I)
        codes = O * I if bits == 8 else (O * I // 2 if bits == 4 else math.ceil(O * I / 8) * bits)
        expected += codes + O * groups * 2 + (0 if symmetric else O * groups)   # fp16 scales, uint8 zeros
    assert get_model_nbytes(q) == expected
    assert get_model_nbytes(model) == sum(p.numel() for p in model.parameters()) * 4


@pytest.mark.parametrize("call,match", [
    (dict(method="rtn", bits=5), "bits"),
    (dict(method="rtn", bits=16), "bits"),
    (dict(method="gptq", bits=4, group_size=48), "does not divide"),
    (dict(method="gptq", bits=4, calibration=[]), "empty"),
    (dict(method="awq", bits=4, calibration=None), "calibration"),
    (dict(method="awq", bits=4, calibration=torch.zeros(1, 0, dtype=torch.long)), "non-empty"),
    (dict(method="fp8", bits=4), "bits must be 8"),
    (dict(method="int2", bits=2), "method"),
])
def test_bad_inputs_raise_and_leave_the_model_untouched(model, call, match):
    snapshot = _bit_snapshot(model)
    call = {"group_size": 32, "calibration": CALIB, **call}
    with pytest.raises(ValueError, match=match):
        run_quantize_model(model, **call)
    _assert_bit_identical(model, snapshot)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_and_left_as_they_were(bad):
    model = make_model(make_config(**CFG), seed=3)
    with torch.no_grad():
        model.layers[1].ffn.w2.weight[3, 7] = bad
    snapshot = _bit_snapshot(model)
    with pytest.raises(ValueError, match="NaN/Inf"):
        run_quantize_model(model, "gptq", 4, 32, CALIB)
    _assert_bit_identical(model, snapshot)


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_int8_kv_cache_protocol_bytes_and_accuracy(model, fmt):
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        ref = run_model(model, x)
        cache = make_quantized_kv_cache(model, 2, 32, fmt)
        out = [run_model(model, x[:, :10], cache)] + [run_model(model, x[:, t:t + 1], cache) for t in range(10, 16)]
        # roll back speculative-style and redo: same protocol as the full-precision cache
        cache.truncate(12)
        redo = run_model(model, x[:, 12:], cache)
    got = torch.cat(out, 1)
    assert float((got.softmax(-1) - ref.softmax(-1)).abs().max()) < 0.02
    torch.testing.assert_close(redo, got[:, 12:], atol=1e-5, rtol=0)
    K, H, L = CFG["num_kv_heads"], CFG["d_model"] // CFG["num_heads"], CFG["num_layers"]
    assert cache.bytes_per_token == L * 2 * K * (H + 2)        # 1-byte values + one fp16 scale per head
    if fmt == "int8":   # layer 0's keys: exactly the per-vector absmax int8 encoding of the full-precision ones
        with torch.no_grad():
            plain = make_kv_cache(model, 2, 32)
            run_model(model, x[:, :10], plain)        # the same prefill the quantized cache stored
        k = plain.layers[0].k[:, :, :10]
        scale = (k.abs().amax(-1, keepdim=True) / 127).half().clamp(min=torch.finfo(torch.float16).tiny).float()
        want = torch.round((k / scale).clamp(-127, 127)) * scale
        torch.testing.assert_close(cache.layers[0].read(10)[0], want, atol=1e-6, rtol=0)
    assert cache.nbytes == 2 * 32 * cache.bytes_per_token
    assert cache.bytes_per_token * 4 < make_kv_cache(model, 2, 32).bytes_per_token * 2   # < half of fp32


def _absmax_round_trip(x, bits, group):
    """Symmetric absmax per group of `group` values along the last dim, fp16 scale, by hand."""
    qmax = 2 ** (bits - 1) - 1
    g = x.float().reshape(*x.shape[:-1], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-8).half().float()
    return ((g / scale).round().clamp(-qmax, qmax) * scale).reshape(x.shape)


@pytest.mark.parametrize("fmt,bits,group", [("int8", 8, 16), ("int4", 4, 8)])
def test_quantizing_a_prefilled_cache_stores_the_prompt_in_low_bits(model, fmt, bits, group):
    """Prefill in full precision, then quantize the filled cache: reads give the hand-quantized keys,
    decoding continues, and int4 costs (H/2 + 2 H/g) bytes per head against int8's H + 2."""
    x = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        ref = run_model(model, x)
        cache = make_kv_cache(model, 2, 24)
        prefill = run_model(model, x[:, :12], cache)
        full_k, full_v = cache.layers[1].read(12)
        run_quantize_kv_cache(cache, fmt, group_size=group)
        got_k, got_v = cache.layers[1].read(12)
        steps = [run_model(model, x[:, t:t + 1], cache) for t in range(12, 20)]
    torch.testing.assert_close(got_k, _absmax_round_trip(full_k, bits, group), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_v, _absmax_round_trip(full_v, bits, group), atol=1e-6, rtol=0)
    torch.testing.assert_close(prefill, ref[:, :12])     # the prompt itself ran in full precision
    tol = 0.02 if fmt == "int8" else 0.2
    assert float((torch.cat(steps, 1).softmax(-1) - ref[:, 12:].softmax(-1)).abs().max()) < tol
    K, H, L = CFG["num_kv_heads"], CFG["d_model"] // CFG["num_heads"], CFG["num_layers"]
    per_head = H + 2 * (H // group) if fmt == "int8" else H // 2 + 2 * (H // group)
    assert cache.bytes_per_token == L * 2 * K * per_head


def test_int4_kv_cache_refuses_a_bad_group_and_leaves_the_cache_as_it_was(model):
    cache = make_kv_cache(model, 1, 8)
    layers = list(cache.layers)
    with pytest.raises(ValueError, match="group_size must be a positive divisor of head_dim=16"):
        run_quantize_kv_cache(cache, "int4", group_size=5)
    assert cache.layers == layers


@pytest.mark.slow
def test_qat_recovers_quality_lost_by_rtn_at_low_bits():
    """Distilling the fp model into its own fake-quantized copy beats plain RTN on held-out text."""
    model = make_model(make_config(**CFG), seed=0)
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, 257, (4000,), generator=g)
    held_out = torch.randint(0, 257, (4, 40), generator=g)
    rtn = run_quantize_model(model, "rtn", 3, 16)
    qat = run_quantize_model(model, "qat", 3, 16, [train], qat_steps=120, qat_lr=1e-3, qat_seq_len=32)
    with torch.no_grad():
        ref = run_model(model, held_out).log_softmax(-1)
        kl = {name: float((ref.exp() * (ref - run_model(m, held_out).log_softmax(-1))).sum(-1).mean())
              for name, m in (("rtn", rtn), ("qat", qat))}
    # QAT removes about 30% of RTN's KL here, the exact share moving a little with the CPU's float
    # reductions (AVX2 vs AVX-512); no training, or training that ignored the quantizer, stays near 100%
    assert kl["qat"] < 0.8 * kl["rtn"], f"KL to the fp model: {kl}"
