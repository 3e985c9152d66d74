"""Graded: quantize/dequantize, round-to-nearest scales per tensor/channel/group, int4 packing, the int8
KV-cache encoding, LLM.int8() and GPTQ. References are written here: loops over groups for scales,
byte layouts by hand, float32 codes then float64 products for LLM.int8(), and GPTQ as the plain
optimal-brain-quantization loop (one column at a time, re-inverting the remaining Hessian)."""

import pytest
import torch
from adapters import (run_dequantize, run_gptq_quantize, run_llm_int8_matmul, run_pack_int4, run_quantize,
                      run_quantize_kv_int8, run_quantize_tensor, run_unpack_int4)
from reference_quantization import naive_affine_rtn


def test_lecture_worked_example():
    q = run_quantize(torch.tensor(5.2342), 0.1, 4, 8, False)
    assert int(q) == 56, f"round(5.2342 / 0.1) + 4 should be 56, got {int(q)}"
    x_hat = run_dequantize(q, 0.1, 4)
    assert float(x_hat) == pytest.approx(5.2, abs=1e-6), f"(56 - 4) * 0.1 should be 5.2, got {float(x_hat)}"


def test_dequantize_by_hand():
    q = torch.tensor([[0, 3, 15, 7], [1, 2, 9, 4]], dtype=torch.int32)
    scale, zero = torch.tensor([[0.5, 0.25], [2.0, 0.125]]), torch.tensor([[7.0, 0.0], [1.0, 8.0]])
    got = run_dequantize(q, scale, zero)
    want = [[(0 - 7) * 0.5, (3 - 7) * 0.5, 15 * 0.25, 7 * 0.25], [0.0, 2.0, (9 - 8) * 0.125, (4 - 8) * 0.125]]
    assert got.dtype == torch.float32 and got.tolist() == want
    assert float(run_dequantize(torch.tensor(-3), 0.1, 0)) == pytest.approx(-0.3)


@pytest.mark.parametrize("bits, symmetric, zero, lo, hi", [(8, True, 0, -128, 127), (4, True, 0, -8, 7),
                                                          (8, False, 100, 0, 255), (4, False, 10, 0, 15)])
def test_quantize_clamps_codes_to_the_integer_range(bits, symmetric, zero, lo, hi):
    x = torch.tensor([-1000.0, -3.0, -0.04, 0.0, 0.06, 0.5, 2.0, 1000.0])
    got = run_quantize(x, 0.1, zero, bits, symmetric)
    want = [min(hi, max(lo, round(v / 0.1) + zero)) for v in x.tolist()]
    assert got.tolist() == want, f"codes {got.tolist()}, want {want} (range [{lo}, {hi}])"
    assert not got.dtype.is_floating_point


def test_quantize_and_dequantize_with_one_scale_per_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g) * 2
    scale = torch.rand(3, 2, generator=g) * 0.1 + 0.02
    zero = torch.randint(0, 16, (3, 2), generator=g).float()
    q = run_quantize(x, scale, zero, 4, False)
    x_hat = run_dequantize(q, scale, zero)
    for r in range(3):
        for c in range(8):
            s, z = float(scale[r, c // 4]), float(zero[r, c // 4])
            want_q = min(15, max(0, round(float(x[r, c]) / s) + z))
            assert int(q[r, c]) == want_q, f"code [{r}, {c}]"
            assert float(x_hat[r, c]) == pytest.approx((want_q - z) * s, rel=1e-6, abs=1e-7)


def _naive_scales(x, bits, symmetric, group):
    """Per-group scale and zero point by loops over rows and groups (group None: one for the tensor)."""
    rows = x.reshape(-1, x.shape[-1]) if group is not None else x.reshape(1, -1)
    g = group if group is not None else rows.shape[1]
    scales, zeros = [], []
    for r in range(rows.shape[0]):
        for start in range(0, rows.shape[1], g):
            chunk = rows[r, start:start + g].double()
            if symmetric:
                s, z = float(chunk.abs().max()) / (2 ** (bits - 1) - 1), 0.0
            else:
                lo, hi = min(float(chunk.min()), 0.0), max(float(chunk.max()), 0.0)
                s = (hi - lo) / (2**bits - 1)
                z = round(-lo / s) if s > 0 else 0.0
            scales.append(s if s > 0 else 1.0)
            zeros.append(z)
    return torch.tensor(scales, dtype=torch.float64), torch.tensor(zeros, dtype=torch.float64)


CASES = [(bits, sym, gran, g) for bits in (8, 4, 3) for sym in (True, False)
         for gran, g in (("tensor", None), ("channel", None), ("group", 16))]


@pytest.mark.parametrize("bits, symmetric, granularity, group_size", CASES)
def test_round_to_nearest_scales_and_round_trip(bits, symmetric, granularity, group_size):
    x = torch.randn(6, 48) * torch.linspace(0.1, 3.0, 6)[:, None] + (0.0 if symmetric else 0.7)
    q, scale, zero = run_quantize_tensor(x, bits, symmetric, granularity, group_size)
    ref_group = None if granularity == "tensor" else (48 if granularity == "channel" else group_size)
    ref_scale, ref_zero = _naive_scales(x, bits, symmetric, ref_group)
    torch.testing.assert_close(scale.double().reshape(-1), ref_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(zero.double().reshape(-1), ref_zero, rtol=0, atol=0)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    assert int(q.min()) >= lo and int(q.max()) <= hi, f"codes outside [{lo}, {hi}]"
    x_hat = run_dequantize(q, scale, zero)
    per_elem = ref_scale.repeat_interleave(x.numel() // ref_scale.numel()).reshape(x.shape)
    worst = float(((x.double() - x_hat.double()).abs() - per_elem / 2).max())
    assert worst <= 1e-6, f"|x - x_hat| exceeds scale/2 by {worst:.3g} somewhere"


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity, group_size", [("tensor", None), ("channel", None), ("group", 4)])
def test_an_all_zero_group_gets_scale_one_and_round_trips(symmetric, granularity, group_size):
    x = torch.zeros(3, 8)
    if granularity != "tensor":
        x[0, 4:] = torch.tensor([0.5, -1.0, 2.0, 0.25])      # rows 1-2 (and group 0 of row 0) stay all zero
    q, scale, zero = run_quantize_tensor(x, 4, symmetric, granularity, group_size)
    ref_scale, ref_zero = _naive_scales(x, 4, symmetric, None if granularity == "tensor" else
                                        (8 if granularity == "channel" else group_size))
    torch.testing.assert_close(scale.double().reshape(-1), ref_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(zero.double().reshape(-1), ref_zero, rtol=0, atol=0)
    x_hat = run_dequantize(q, scale, zero)
    assert torch.isfinite(x_hat).all() and torch.equal(x_hat[1:], torch.zeros(2, 8)), "zeros must come back as zeros"


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_affine_quantization_represents_zero_exactly(bits):
    x = torch.rand(4, 32) + 0.5          # all positive: the range must widen to reach 0
    x[:, ::5] = 0.0
    q, scale, zero = run_quantize_tensor(x, bits, False, "group", 8)
    assert torch.all(run_dequantize(q, scale, zero)[:, ::5] == 0), "exact zeros did not come back as exact zeros"


def test_unpack_int4_by_hand():
    packed = torch.tensor([[0x21, 0xF8, 0x7F]], dtype=torch.uint8)      # (low, high) nibbles: (1, 2) (8, 15) (15, 7)
    assert run_unpack_int4(packed, signed=False).tolist() == [[1, 2, 8, 15, 15, 7]]
    assert run_unpack_int4(packed, signed=True).tolist() == [[1, 2, -8, -1, -1, 7]]


@pytest.mark.parametrize("signed", [True, False])
def test_pack_int4_layout_and_round_trip(signed):
    lo, hi = (-8, 7) if signed else (0, 15)
    q = torch.randint(lo, hi + 1, (5, 3, 34), dtype=torch.int8)
    packed = run_pack_int4(q, signed)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 17)
    for i in range(17):   # byte layout, by hand: element 2i in the low nibble, 2i + 1 in the high nibble
        a, b = int(q[1, 2, 2 * i]) & 0xF, int(q[1, 2, 2 * i + 1]) & 0xF
        assert int(packed[1, 2, i]) == a | (b << 4), f"byte {i}"
    assert torch.equal(run_unpack_int4(packed, signed).long(), q.long())


def test_int8_kv_encoding_uses_the_absmax_of_each_vector():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g)
    x[0, 1, 2, 3] = -9.0                   # a vector whose largest magnitude is negative
    x[1, 0, 4] = -x[1, 0, 4].abs()         # an all-negative vector
    x[1, 2, 0] = 0.0                       # an all-zero vector
    codes, scale = run_quantize_kv_int8(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scale.shape == (2, 3, 5, 1)
    want_scale = (x.abs().amax(-1, keepdim=True) / 127).half().clamp(min=torch.finfo(torch.float16).tiny)
    assert torch.equal(scale.half(), want_scale), "scale must be absmax / 127 per (b, k, s) vector, in fp16"
    want = torch.round((x / want_scale.float()).clamp(-127, 127)).to(torch.int8)
    assert torch.equal(codes, want)
    err = (codes.float() * scale.float() - x).abs()
    assert float((err - want_scale.float() / 2).max()) <= 1e-6, "decoded values must be within half a step"


# --- LLM.int8() -----------------------------------------------------------------------------------------


def ref_llm_int8(x, w, threshold):
    """float32 codes and scales (as the method defines them), float64 products."""
    outliers = (x.abs() > threshold).any(0) if threshold is not None else torch.zeros(x.shape[1], dtype=torch.bool)
    regular = ~outliers

    def absmax(m):
        scale = (m.float().abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-12)
        return torch.round(m.float() / scale).clamp(-127, 127).double(), scale.double()

    wq, ws = absmax(w)
    y = x[:, outliers].double() @ w[:, outliers].double().T
    if regular.any():
        xq, xs = absmax(x[:, regular])
        y = y + (xq @ wq[:, regular].T) * xs * ws.T
    return y


def test_llm_int8_without_outliers_is_vector_wise_int8():
    x, w = torch.randn(10, 64), torch.randn(24, 64)
    got = run_llm_int8_matmul(x, w, None)
    torch.testing.assert_close(got.double(), ref_llm_int8(x, w, None), rtol=1e-5, atol=1e-5)


def test_llm_int8_outlier_columns_run_in_full_precision():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g) / 16
    x[:, [3, 77, 200]] *= 50.0                                 # outlier feature dims, as in the paper
    got = run_llm_int8_matmul(x, w, 6.0)
    torch.testing.assert_close(got.double(), ref_llm_int8(x, w, 6.0), rtol=1e-5, atol=1e-4)
    y = x.double() @ w.double().t()
    plain = float((run_llm_int8_matmul(x, w, None).double() - y).norm() / y.norm())
    assert float((got.double() - y).norm() / y.norm()) < plain / 5, "decomposition should rescue the outliers"


def test_llm_int8_a_value_exactly_at_the_threshold_is_not_an_outlier():
    x = torch.full((4, 32), 0.02)
    x[:, 1::2] = -0.03
    x[2, 5] = 6.0           # exactly at the threshold: stays in int8 (outliers are > threshold)
    x[1, 9] = -6.5          # above it: column 9 is an outlier
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    got = run_llm_int8_matmul(x, w, 6.0)
    want = ref_llm_int8(x, w, 6.0)
    wrong = ref_llm_int8(x, w, 5.999)   # what counting column 5 as an outlier gives: measurably different
    assert float((want - wrong).abs().max()) > 1e-2
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_llm_int8_when_every_column_is_an_outlier():
    x, w = torch.randn(5, 16) * 20 + 10, torch.randn(7, 16)
    torch.testing.assert_close(run_llm_int8_matmul(x, w, 6.0).double(), x.double() @ w.double().t(),
                               rtol=1e-4, atol=1e-3)


# --- GPTQ ------------------------------------------------------------------------------------------------


def ref_gptq(w, x, bits, group):
    """Optimal brain quantization, column by column, re-inverting the remaining Hessian each step."""
    W = w.double().clone()
    O, I = W.shape
    H = 2 * x.double().T @ x.double() / x.shape[0]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += 0.01 * torch.diag(H).mean() * torch.eye(I, dtype=torch.float64)
    g, qmax = group or I, 2**bits - 1
    Q = torch.zeros_like(W)
    for j in range(I):
        if j % g == 0:   # affine min/max scales (float32) from the error-updated weights of this group
            chunk = W[:, j:j + g].float()
            lo, hi = chunk.amin(1).clamp(max=0.0), chunk.amax(1).clamp(min=0.0)
            scale = (hi - lo) / qmax
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = (-torch.round(lo / scale)).clamp(0, qmax)
            scale, zero = scale.double(), zero.double()
        q = (torch.clamp(torch.round(W[:, j] / scale) + zero, 0, qmax) - zero) * scale
        Q[:, j] = q
        Hinv = torch.linalg.inv(H[j:, j:])
        W[:, j + 1:] -= ((W[:, j] - q) / Hinv[0, 0])[:, None] * Hinv[0, 1:][None, :]
    return Q


def _correlated_inputs(n, d, seed):
    """Calibration activations with correlated, unequal channels (as real hidden states are)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d)
    return (torch.randn(n, d, generator=g) * torch.logspace(-1, 0.5, d)) @ mix


@pytest.mark.parametrize("bits, group_size", [(4, None), (3, 16), (4, 8)])
def test_gptq_equals_the_column_by_column_reference(bits, group_size):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(12, 32, generator=g) / 32**0.5
    x = _correlated_inputs(256, 32, seed=bits)
    x[:, 7] = 0.0                                          # an input that never fires
    got = run_gptq_quantize(w, x, bits, group_size)
    torch.testing.assert_close(got.double(), ref_gptq(w, x, bits, group_size), atol=2e-5, rtol=0)



def test_gptq_groups_that_cross_a_block_of_128_columns():
    """Implementations update the weights lazily, 128 columns at a time (the paper's blocks); a group that
    straddles column 128 must still take its scale from the fully error-updated weights."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(6, 192, generator=g) / 192**0.5
    x = _correlated_inputs(300, 192, seed=21)
    got = run_gptq_quantize(w, x, 4, 48)                  # groups [96, 144) and [144, 192): across 128
    torch.testing.assert_close(got.double(), ref_gptq(w, x, 4, 48), atol=2e-5, rtol=0)


@pytest.mark.parametrize("bits, group_size", [(4, None), (3, 32)])
def test_gptq_beats_round_to_nearest_on_the_layer_output(bits, group_size):
    g = torch.Generator().manual_seed(10 + bits)
    w = torch.randn(96, 128, generator=g) / 128**0.5
    x = _correlated_inputs(1024, 128, seed=bits)
    w_hat = run_gptq_quantize(w, x, bits, group_size)

    def error(m):
        return float((x.double() @ (w.double() - m.double()).T).norm())
    assert error(w_hat) < 0.9 * error(naive_affine_rtn(w, bits, group_size))
