"""The packed int4/int8 kernels of `QuantizedLinear` against the dequantize-then-matmul reference.

Reference: W_hat = dequantize(quantize(W)) from the core functions, and y = x @ W_hat^T in float64,
both computed here. Tolerances are stated relative to s = |x| @ |W_hat|^T (the sum of absolute
products, the scale of any rounding error in a dot product):
- fp32 activations: the packed kernels differ from the reference only in summation order and in where
  the scale is applied: |err| <= 1e-5 * s.
- bf16 activations (the fast setting): x, the scales and the output are each rounded to bf16
  (relative 2^-8), so |err| <= 3 * 2^-8 * s.
"""

import warnings

import pytest
import torch

import adapters

from cs336_inference.quantization import quantize_tensor

BF16_TOL = 3 * 2.0 ** -8
FP32_TOL = 1e-5
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reference(x, weight, bits, group_size, symmetric):
    granularity = "channel" if group_size is None else "group"
    w_hat = quantize_tensor(weight, bits, symmetric, granularity, group_size).dequantize()
    y = x.double() @ w_hat.double().T
    bound = x.double().abs() @ w_hat.double().abs().T
    return y, bound


def _check(y, y_ref, bound, tol):
    err = (y.double() - y_ref).abs()
    worst = float((err / bound.clamp(min=1e-30)).max())
    assert worst <= tol, f"max |err| / sum|x||w| = {worst:.3g} exceeds {tol:.3g}"


LAYOUTS = [(4, 32, False), (4, 64, False), (4, 128, False), (4, 64, True), (4, 128, True),
           (4, None, False), (4, None, True), (8, None, True), (8, None, False),
           (8, 32, True), (8, 64, False), (8, 128, True)]   # grouped int8: two int4 planes


@pytest.mark.parametrize("bits,group_size,symmetric", LAYOUTS)
def test_packed_matches_reference_fp32_activations(bits, group_size, symmetric):
    weight = torch.randn(48, 256) * torch.linspace(0.1, 3.0, 256)   # uneven column ranges
    x = torch.randn(2, 3, 256)
    layer = adapters.make_quantized_linear_from_weight(weight, bits, group_size, symmetric, kernel="packed",
                                           scale_dtype=torch.float32, compute_dtype=torch.float32)
    y_ref, bound = _reference(x, weight, bits, group_size, symmetric)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    _check(y, y_ref, bound, FP32_TOL)


@pytest.mark.parametrize("bits,group_size,symmetric", LAYOUTS)
def test_packed_matches_reference_bf16_activations(bits, group_size, symmetric):
    weight = torch.randn(64, 256)
    x = torch.randn(5, 256)
    layer = adapters.make_quantized_linear_from_weight(weight, bits, group_size, symmetric, kernel="packed",
                                           scale_dtype=torch.float32)
    reference = adapters.make_quantized_linear_from_weight(weight, bits, group_size, symmetric, kernel="reference",
                                               scale_dtype=torch.float32)
    y_ref, bound = _reference(x, weight, bits, group_size, symmetric)
    with torch.no_grad():
        y, y_plain = layer(x), reference(x)
    assert y.dtype == torch.float32                    # output in the caller's dtype
    _check(y, y_ref, bound, BF16_TOL)
    _check(y_plain, y_ref, bound, FP32_TOL)           # the reference kernel is the definition


def test_int4_kernel_uses_the_zero_point():
    """An affine grid whose zero point is far from the middle code: a wrong zero convention shows."""
    weight = torch.rand(32, 128) * 2.0 + 1.0           # all positive: zero point 0, min far from 0
    x = torch.randn(4, 128)
    layer = adapters.make_quantized_linear_from_weight(weight, 4, 32, False, kernel="packed", scale_dtype=torch.float32,
                                           compute_dtype=torch.float32)
    y_ref, bound = _reference(x, weight, 4, 32, False)
    with torch.no_grad():
        _check(layer(x), y_ref, bound, FP32_TOL)


def test_auto_falls_back_where_no_kernel_fits_and_packed_refuses(monkeypatch):
    from cs336_inference.quantization import kernels

    monkeypatch.setattr(kernels, "_announced", set())
    weight = torch.randn(40, 64)                        # 40 rows: not a multiple of 16 (CPU int4)
    with pytest.warns(kernels.SlowKernelWarning, match="out_features % 16"):
        auto = adapters.make_quantized_linear_from_weight(weight, 4, 32, False, kernel="auto",
                                                          scale_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # said once: a second such layer is quiet
        adapters.make_quantized_linear_from_weight(weight, 4, 32, False, kernel="auto")
    assert "reference" in auto.kernel_summary() and "out_features" in auto.kernel_summary()
    assert auto.packed_weight(torch.device("cpu")) is None
    x = torch.randn(3, 64)
    y_ref, bound = _reference(x, weight, 4, 32, False)
    with torch.no_grad():
        _check(auto(x), y_ref, bound, FP32_TOL)
    with pytest.raises(ValueError, match="out_features"):
        adapters.make_quantized_linear_from_weight(weight, 4, 32, False, kernel="packed")
    with pytest.raises(ValueError, match="group_size"):
        adapters.make_quantized_linear_from_weight(torch.randn(32, 64), 4, 16, False, kernel="packed")
    with pytest.raises(ValueError, match="in_features % 16"):   # int8pack crashes there (see the shape sweep)
        adapters.make_quantized_linear_from_weight(torch.randn(32, 24), 8, None, True, kernel="packed")
    with pytest.raises(ValueError, match="grouped int8"):
        adapters.make_quantized_linear_from_weight(torch.randn(32, 64), 8, 16, True, kernel="packed")
    with pytest.raises(ValueError, match="kernel"):
        adapters.make_quantized_linear_from_weight(torch.randn(32, 64), 4, 32, False, kernel="fast")


def test_packed_layout_is_rebuilt_after_load_state_dict():
    a = adapters.make_quantized_linear_from_weight(torch.randn(32, 64), 4, 32, False, kernel="packed")
    b = adapters.make_quantized_linear_from_weight(torch.randn(32, 64), 4, 32, False, kernel="packed")
    x = torch.randn(2, 64)
    with torch.no_grad():
        a(x)                                            # builds a's kernel layout
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), b(x))


def test_quantized_model_kernels_agree_and_refusal_leaves_model_unchanged():
    config = adapters.make_config(vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                                  num_layers=2, context_length=32)
    model = adapters.make_model(config)
    ids = torch.randint(0, 64, (2, 6))   # 12 rows: the packed (decode-sized) path
    q = adapters.run_quantize_model(model, "rtn", bits=4, group_size=32)
    with torch.no_grad():
        fast = adapters.run_model(q, ids)
        adapters.run_set_quantized_kernel(q, "reference")
        slow = adapters.run_model(q, ids)
    assert (fast - slow).abs().max() <= 0.05 * slow.abs().max()   # bf16 activations through 2 blocks
    assert not torch.equal(fast, slow)                               # the two kernels really differ
    q8 = adapters.run_quantize_model(model, "rtn", bits=8, group_size=16, symmetric=True)  # g16: no kernel
    with pytest.raises(ValueError, match="grouped int8"):
        adapters.run_set_quantized_kernel(q8, "packed")
    assert all(m.kernel == "auto" for m in q8.modules() if hasattr(m, "kernel"))


@cuda
@pytest.mark.parametrize("bits,group_size,symmetric", LAYOUTS)
def test_packed_matches_reference_on_cuda(bits, group_size, symmetric):
    weight = torch.randn(64, 256)
    x = torch.randn(5, 256)
    layer = adapters.make_quantized_linear_from_weight(weight, bits, group_size, symmetric, kernel="packed",
                                           scale_dtype=torch.float32).cuda()
    assert layer.packed_weight(torch.device("cuda")) is not None
    y_ref, bound = _reference(x, weight, bits, group_size, symmetric)
    with torch.no_grad():
        y = layer(x.cuda()).cpu()
    _check(y, y_ref, bound, BF16_TOL)


@cuda
def test_quantized_model_decodes_on_cuda_with_packed_kernels():
    """No code change on a GPU: a bf16 model quantized to int4 and int8 runs the CUDA packed kernels, and
    its logits stay within bf16 rounding of the dequantize-then-matmul reference kernel."""
    config = adapters.make_config(vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                                  num_layers=2, context_length=32)
    model = adapters.make_model(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 12), device="cuda")
    for bits, group, symmetric in ((4, 32, False), (8, None, True)):
        q = adapters.run_quantize_model(model, "rtn", bits=bits, group_size=group, symmetric=symmetric,
                                        quantize_lm_head=True)
        layers = [m for m in q.modules() if hasattr(m, "packed_weight")]
        assert all(m.packed_weight(torch.device("cuda")) is not None for m in layers)
        with torch.no_grad():
            fast = adapters.run_model(q, ids).float()
            adapters.run_set_quantized_kernel(q, "reference")
            slow = adapters.run_model(q, ids).float()
        assert (fast - slow).abs().max() <= 0.05 * slow.abs().max()


def test_marking_a_layout_static_without_the_compiler_sets_what_torchs_mark_static_sets(monkeypatch):
    """`kernels.mark_static` skips importing torch's compiler when nothing did yet; it must leave the very
    marks `torch._dynamo.mark_static` leaves (a compiled step reads them), for any number of dims."""
    import sys

    import torch._dynamo

    from cs336_inference.quantization import kernels

    def marks(t):
        return {k: v for k, v in t.__dict__.items() if "dynamo" in k}

    for shape in [(3, 4), (5,), (2, 3, 4), ()]:
        theirs, ours = torch.zeros(shape), torch.zeros(shape)
        torch._dynamo.mark_static(theirs)
        with monkeypatch.context() as m:
            m.delitem(sys.modules, "torch._dynamo")
            kernels.mark_static(ours)
            assert "torch._dynamo" not in sys.modules
        assert marks(ours) == marks(theirs) and (marks(ours) or shape == ())
