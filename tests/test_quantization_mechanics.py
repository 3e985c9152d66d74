"""Quantization mechanics: one number, round trips, granularity, packing, fp8, LLM.int8().

References are written here: naive per-group loops for scales, byte layouts by hand, float64 matmuls.
"""

import math

import pytest
import torch
from adapters import (get_fp8_range, run_dequantize, run_fp8_round_trip, run_llm_int8_matmul, run_pack_bits,
                      run_pack_int4, run_quantize, run_quantize_tensor, run_unpack_bits, run_unpack_int4)


def test_lecture_worked_example():
    q = run_quantize(torch.tensor(5.2342), scale=0.1, zero_point=4, bits=8)
    assert int(q) == 56, f"round(5.2342 / 0.1) + 4 should be 56, got {int(q)}"
    x_hat = run_dequantize(q, 0.1, 4)
    assert float(x_hat) == pytest.approx(5.2, abs=1e-6), f"(56 - 4) * 0.1 should be 5.2, got {float(x_hat)}"


def _naive_scales(x, bits, symmetric, group):
    """Per-group scale and zero point by loops over rows and groups (the test's own reference)."""
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


@pytest.mark.parametrize("bits,symmetric,granularity,group_size", CASES)
def test_rtn_round_trip_error_at_most_half_a_step(bits, symmetric, granularity, group_size):
    x = torch.randn(6, 48) * torch.linspace(0.1, 3.0, 6)[:, None] + (0.0 if symmetric else 0.7)
    q, scale, zero, x_hat = run_quantize_tensor(x, bits, symmetric, granularity, group_size)
    ref_group = None if granularity == "tensor" else (48 if granularity == "channel" else group_size)
    ref_scale, ref_zero = _naive_scales(x, bits, symmetric, ref_group)
    torch.testing.assert_close(scale.double().reshape(-1), ref_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(zero.double().reshape(-1), ref_zero, rtol=0, atol=0)
    per_elem = ref_scale.repeat_interleave(x.numel() // ref_scale.numel()).reshape(x.shape)
    err = (x.double() - x_hat.double()).abs()
    worst = float((err - per_elem / 2).max())
    assert worst <= 1e-6, f"|x - x_hat| exceeds scale/2 by {worst:.3g} somewhere"
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    assert int(q.min()) >= lo and int(q.max()) <= hi, f"codes outside [{lo}, {hi}]"


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_zero_is_represented_exactly(bits, symmetric):
    x = torch.rand(4, 32) + 0.5          # all positive: affine must widen its range to reach 0
    x[:, ::5] = 0.0
    _, scale, zero, x_hat = run_quantize_tensor(x, bits, symmetric, "group", 8)
    assert torch.all(x_hat[:, ::5] == 0), "exact zeros did not come back as exact zeros"
    q0 = run_quantize(torch.zeros(4, 32), scale, zero, bits, symmetric)
    assert torch.equal(q0.double(), zero.repeat_interleave(8, dim=1).double()), "0 must map to the zero point"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_per_group_never_worse_than_per_tensor_on_rows_of_different_scale(bits, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=g) * torch.logspace(-2, 1, 32)[:, None]   # rows differ 1000x
    mse = {}
    for gran, size in (("tensor", None), ("channel", None), ("group", 32)):
        mse[gran] = float((run_quantize_tensor(w, bits, False, gran, size)[3] - w).pow(2).mean())
    assert mse["group"] <= mse["channel"] <= mse["tensor"], f"MSE by granularity: {mse}"


def test_bad_quantization_arguments_raise():
    x = torch.randn(4, 30)
    with pytest.raises(ValueError, match="bits"):
        run_quantize_tensor(x, bits=5)
    with pytest.raises(ValueError, match="group_size"):
        run_quantize_tensor(x, 4, False, "group", 8)          # 8 does not divide 30
    with pytest.raises(ValueError, match="NaN/Inf"):
        run_quantize_tensor(torch.tensor([[1.0, float("nan")]]), 8)
    with pytest.raises(ValueError, match="granularity"):
        run_quantize_tensor(x, 8, True, "row")


@pytest.mark.parametrize("signed", [True, False])
def test_pack_int4_is_lossless_and_half_the_bytes(signed):
    lo, hi = (-8, 7) if signed else (0, 15)
    q = torch.randint(lo, hi + 1, (5, 3, 34), dtype=torch.int8)
    packed = run_pack_int4(q, signed)
    assert packed.dtype == torch.uint8
    assert packed.nbytes * 2 == q.nbytes, f"packed {packed.nbytes} B vs int8 {q.nbytes} B"
    assert torch.equal(run_unpack_int4(packed, signed).to(torch.int64), q.to(torch.int64))
    # byte layout, by hand: element 2i in the low nibble, 2i+1 in the high nibble
    a, b = int(q[0, 0, 0]) & 0xF, int(q[0, 0, 1]) & 0xF
    assert int(packed[0, 0, 0]) == a | (b << 4)


def test_pack_int4_rejects_out_of_range_and_odd_lengths():
    with pytest.raises(ValueError, match="values must lie"):
        run_pack_int4(torch.tensor([0, 8]), signed=True)
    with pytest.raises(ValueError, match="even"):
        run_pack_int4(torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("bits", [2, 3])
def test_dense_bit_packing_is_lossless_and_tight(bits):
    q = torch.randint(0, 2**bits, (1001,))
    packed = run_pack_bits(q, bits)
    assert packed.numel() == math.ceil(1001 / 8) * bits      # 8 codes -> `bits` bytes
    assert torch.equal(run_unpack_bits(packed, bits, 1001).long(), q)


def test_fp8_ranges_come_from_finfo():
    assert get_fp8_range("e4m3") == (-448.0, 448.0)
    assert get_fp8_range("e5m2") == (-57344.0, 57344.0)
    assert get_fp8_range("e4m3fnuz")[1] == 240.0              # the lecture's "+-240" variant
    with pytest.raises(ValueError, match="fp8 format"):
        get_fp8_range("e3m4")


@pytest.mark.parametrize("fmt,mantissa_bits", [("e4m3", 3), ("e5m2", 2)])
def test_fp8_round_trip_relative_error(fmt, mantissa_bits):
    # magnitudes within ~2 decades of the max stay in the normal range: relative error <= 2^-(m+1)
    x = torch.sign(torch.randn(4096)) * torch.logspace(-2, 0, 4096)
    x_hat = run_fp8_round_trip(x, fmt)
    rel = ((x_hat - x).abs() / x.abs()).max()
    assert rel <= 2.0 ** -(mantissa_bits + 1) + 1e-6, f"max relative error {float(rel):.4f}"
    assert float(x_hat.abs().max()) == pytest.approx(1.0, rel=1e-6)   # absmax lands on the format max


def test_llm_int8_matches_float64_reference_of_the_int8_product():
    torch.manual_seed(0)
    x, w = torch.randn(10, 64), torch.randn(24, 64)
    got = run_llm_int8_matmul(x, w, threshold=None)
    xs = x.double().abs().amax(1, keepdim=True) / 127
    ws = w.double().abs().amax(1, keepdim=True) / 127
    want = (torch.round(x.double() / xs) @ torch.round(w.double() / ws).t()) * xs * ws.t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_llm_int8_outlier_decomposition_rescues_planted_outliers():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g) / 16
    x[:, [3, 77, 200]] *= 50.0                                 # outlier feature dims, as in the paper
    y = x.double() @ w.double().t()
    rel = lambda y_hat: float((y_hat.double() - y).norm() / y.norm())  # noqa: E731
    plain, decomposed = rel(run_llm_int8_matmul(x, w, None)), rel(run_llm_int8_matmul(x, w, 6.0))
    assert decomposed < plain / 5, f"LLM.int8() error {decomposed:.4f} vs plain int8 {plain:.4f}"
    # the outlier columns alone, in high precision, against the float64 reference of that part
    only = torch.zeros_like(x)
    only[:, [3, 77, 200]] = x[:, [3, 77, 200]]
    torch.testing.assert_close(run_llm_int8_matmul(only, w, 6.0).double(),
                               only.double() @ w.double().t(), rtol=1e-4, atol=1e-4)


def test_llm_int8_when_every_column_is_an_outlier():
    x, w = torch.randn(5, 16) * 20 + 10, torch.randn(7, 16)
    got = run_llm_int8_matmul(x, w, 6.0)          # no int8 part at all: a plain high-precision matmul
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-3)
