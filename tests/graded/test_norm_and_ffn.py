"""Graded: the Transformer's blocks (rmsnorm, swiglu). References are written here from the definitions,
element by element in float64."""

import math

import pytest
import torch
from adapters import run_rmsnorm, run_swiglu


def ref_rmsnorm(x, w, eps):
    """Row by row: x_i / sqrt(mean_j x_j^2 + eps) * w_i."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r, row in enumerate(rows.tolist()):
        rms = math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out[r] = torch.tensor([v / rms * float(g) for v, g in zip(row, w.double())])
    return out.reshape(x.shape)


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_rmsnorm_matches_the_definition(eps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]   # tiny rows: eps matters
    w = torch.rand(16, generator=g) + 0.5
    got = run_rmsnorm(x, w, eps)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), ref_rmsnorm(x, w, eps), atol=1e-5, rtol=1e-5)


def test_rmsnorm_keeps_the_input_dtype_and_computes_in_float32():
    x = (torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 100).to(torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    got = run_rmsnorm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    want = ref_rmsnorm(x.float(), w.float(), 1e-5)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)   # bf16 output rounding only


def ref_swiglu(x, w1, w2, w3):
    """One position at a time: h_f = silu(w1_f . x) * (w3_f . x); y_d = sum_f w2[d, f] h_f."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], w2.shape[0], dtype=torch.float64)
    for r in range(rows.shape[0]):
        a = w1.double() @ rows[r]
        b = w3.double() @ rows[r]
        h = a / (1 + torch.exp(-a)) * b
        out[r] = w2.double() @ h
    return out.reshape(*x.shape[:-1], w2.shape[0])


def test_swiglu_gates_the_w3_branch_with_silu_of_w1():
    g = torch.Generator().manual_seed(2)
    D, F = 12, 20
    x = torch.randn(2, 7, D, generator=g)
    w1, w3 = torch.randn(F, D, generator=g) / D**0.5, torch.randn(F, D, generator=g) / D**0.5 + 0.3
    w2 = torch.randn(D, F, generator=g) / F**0.5
    got = run_swiglu(x, w1, w2, w3)
    assert got.shape == (2, 7, D)
    torch.testing.assert_close(got.double(), ref_swiglu(x, w1, w2, w3), atol=1e-5, rtol=1e-5)
    swapped = ref_swiglu(x, w3, w2, w1)          # the gate on the wrong branch is measurably different
    assert float((swapped - ref_swiglu(x, w1, w2, w3)).abs().max()) > 1e-2
