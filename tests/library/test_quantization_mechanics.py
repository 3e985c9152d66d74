"""Quantization mechanics of the library not graded here: granularity trade-offs, bad arguments, dense
bit packing, fp8 (quantize/dequantize, scales, int4 packing and LLM.int8() are graded in
tests/graded/test_quantization_kernels.py). References are written here."""

import math

import pytest
import torch
from adapters import get_fp8_range, run_fp8_round_trip, run_pack_bits, run_unpack_bits

from cs336_inference.quantization import pack_int4, quantize, quantize_tensor


def rtn(x, bits=8, symmetric=True, granularity="tensor", group_size=None):
    """(codes, scale, zero_point, x_hat) from the library's quantize_tensor."""
    qt = quantize_tensor(x, bits, symmetric, granularity, group_size)
    return qt.q, qt.scale, qt.zero_point, qt.dequantize(x.dtype)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_per_group_never_worse_than_per_tensor_on_rows_of_different_scale(bits, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=g) * torch.logspace(-2, 1, 32)[:, None]   # rows differ 1000x
    mse = {}
    for gran, size in (("tensor", None), ("channel", None), ("group", 32)):
        mse[gran] = float((rtn(w, bits, False, gran, size)[3] - w).pow(2).mean())
    assert mse["group"] <= mse["channel"] <= mse["tensor"], f"MSE by granularity: {mse}"


def test_bad_quantization_arguments_raise():
    x = torch.randn(4, 30)
    with pytest.raises(ValueError, match="bits"):
        rtn(x, bits=5)
    with pytest.raises(ValueError, match="group_size"):
        rtn(x, 4, False, "group", 8)          # 8 does not divide 30
    with pytest.raises(ValueError, match="NaN/Inf"):
        rtn(torch.tensor([[1.0, float("nan")]]), 8)
    with pytest.raises(ValueError, match="granularity"):
        rtn(x, 8, True, "row")
    for bad in (float("nan"), float("inf"), -float("inf")):   # a code for NaN would be -2^31 (int32 cast)
        with pytest.raises(ValueError, match="NaN/Inf"):
            quantize(torch.tensor([0.5, bad]), scale=0.1, zero_point=0, bits=8)


def test_model_records_only_the_options_a_method_uses():
    from adapters import make_config, make_model, run_quantize_model

    model = make_model(make_config(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_layers=1, context_length=16))
    fp8 = run_quantize_model(model, "fp8", 8, 128)                 # the default group size: not a request
    assert fp8.quantization["group_size"] is None and fp8.quantization["symmetric"] is True
    assert "group_size=128" in fp8.quantization["ignored"]
    with pytest.warns(UserWarning, match="group_size=32 is not used"):
        run_quantize_model(model, "llm_int8", 8, 32)
    rtn8 = run_quantize_model(model, "rtn", 8, None, torch.randint(0, 64, (1, 8)), symmetric=True)
    assert rtn8.quantization["ignored"] == ["calibration"] and rtn8.quantization["symmetric"] is True


def test_pack_int4_rejects_out_of_range_and_odd_lengths():
    with pytest.raises(ValueError, match="values must lie"):
        pack_int4(torch.tensor([0, 8]), signed=True)
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.tensor([1, 2, 3]))


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


