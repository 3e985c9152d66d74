import math

import pytest
import torch
from adapters import run_library_rmsnorm, run_library_swiglu, run_rope, run_scaled_dot_product_attention
from reference_model import ref_rope


def test_rope_matches_adjacent_pair_reference():
    x = torch.randn(2, 3, 11, 16)
    positions = torch.arange(5, 16)
    got = run_rope(x, positions, theta=10000.0)
    want = ref_rope(x, positions, 10000.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_is_not_rotate_half():
    # Position 1 rotates the pair (x0, x1) by angle 1 rad (k = 0 frequency is 1).
    x = torch.zeros(1, 4)
    x[0, 0] = 1.0
    got = run_rope(x[None], torch.tensor([1]))[0, 0]
    torch.testing.assert_close(got[:2], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    assert got[2:].abs().max() == 0


def test_rope_preserves_relative_position_dot_products():
    q, k = torch.randn(1, 8), torch.randn(1, 8)
    d1 = run_rope(q, torch.tensor([3])) @ run_rope(k, torch.tensor([1])).T
    d2 = run_rope(q, torch.tensor([10])) @ run_rope(k, torch.tensor([8])).T
    torch.testing.assert_close(d1, d2, atol=1e-5, rtol=1e-5)


def test_rmsnorm_formula():
    x, w = torch.randn(3, 5, 8), torch.randn(8)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(run_library_rmsnorm(w, x), want)


def test_swiglu_formula():
    D, F = 6, 10
    w1, w2, w3, x = torch.randn(F, D), torch.randn(D, F), torch.randn(F, D), torch.randn(2, 3, D)
    a, g = x @ w1.T, x @ w3.T
    want = (a * torch.sigmoid(a) * g) @ w2.T
    torch.testing.assert_close(run_library_swiglu(w1, w2, w3, x), want, atol=1e-5, rtol=1e-5)


def test_sdpa_matches_explicit_softmax_loop():
    q, k, v = torch.randn(2, 4, 7), torch.randn(2, 9, 7), torch.randn(2, 9, 3)
    mask = torch.rand(2, 4, 9) > 0.3
    mask[..., 0] = True
    got = run_scaled_dot_product_attention(q, k, v, mask)
    want = torch.zeros(2, 4, 3)
    for b in range(2):
        for t in range(4):
            w = [math.exp(float(q[b, t] @ k[b, s]) / math.sqrt(7)) if mask[b, t, s] else 0.0 for s in range(9)]
            total = sum(w)
            want[b, t] = sum(wi / total * v[b, s] for s, wi in enumerate(w))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sdpa_rejects_bad_mask_and_shapes():
    q, k, v = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, 5)
    with pytest.raises(TypeError, match="mask"):
        run_scaled_dot_product_attention(q, k, v, torch.ones(2, 4))
    with pytest.raises(ValueError, match="last dim"):
        run_scaled_dot_product_attention(q, torch.randn(4, 2), v)


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 65])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_linear_few_row_path_equals_plain_matmul(rows, threads):
    from cs336_inference.workshop.cpu_tuning import CPULinear

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lin = CPULinear(24, 16, bias=False)
        x = torch.randn(rows, 1, 24)
        with torch.no_grad():
            got = lin(x)
        want = torch.einsum("mti,oi->mto", x, lin.weight.detach())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert lin(x).requires_grad  # the training path is untouched
    finally:
        torch.set_num_threads(old)
