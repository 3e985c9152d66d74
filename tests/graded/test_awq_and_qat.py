"""Graded: AWQ's per-channel scale search (awq_search_scales) and QAT's straight-through fake quantization
(ste_fake_quantize). References are written here: the grid search as a plain loop, affine round-to-nearest
by a loop over groups in float32 (as the method computes it), gradients compared with the identity."""

import pytest
import torch
from adapters import run_awq_scales, run_fake_quantize_ste


def rtn32(w, bits, group):
    """Affine min/max round to nearest in float32, group by group (per row if group is None)."""
    w, qmax = w.float(), 2**bits - 1
    out = torch.empty_like(w)
    g = group or w.shape[1]
    for start in range(0, w.shape[1], g):
        chunk = w[:, start:start + g]
        lo, hi = chunk.amin(1, keepdim=True).clamp(max=0), chunk.amax(1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (-torch.round(lo / scale)).clamp(0, qmax)
        out[:, start:start + g] = (torch.clamp(torch.round(chunk / scale) + zero, 0, qmax) - zero) * scale
    return out


def ref_awq(w, x, bits, group, grid):
    a = x.float().abs().mean(0).clamp(min=1e-8)
    y = x.float() @ w.float().T
    best = None
    for k in range(grid):
        s = a ** (k / grid)
        s = s / torch.sqrt(s.max() * s.min())
        w_hat = rtn32(w.float() * s, bits, group) / s
        err = float(((x.float() @ w_hat.T - y) ** 2).mean())
        if best is None or err < best[0]:
            best = (err, s)
    return best[1]


def _salient_inputs(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, torch.randperm(d, generator=g)[:3]] *= 25.0            # a few salient channels, as in the paper
    return x


@pytest.mark.parametrize("bits, group_size", [(4, None), (3, 16)])
def test_awq_scales_equal_the_grid_search(bits, group_size):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(24, 32, generator=g) / 32**0.5
    x = _salient_inputs(128, 32, seed=bits)
    got = run_awq_scales(w, x, bits, group_size, 10)
    want = ref_awq(w, x, bits, group_size, 10)
    assert got.shape == (32,)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
    y = x @ w.T
    plain = float(((x @ rtn32(w, bits, group_size).float().T - y) ** 2).mean())
    scaled = float(((x @ (rtn32(w * got, bits, group_size).float() / got).T - y) ** 2).mean())
    assert scaled <= plain + 1e-12, "the search includes alpha = 0 (plain rounding), so it can only do better"


@pytest.mark.parametrize("bits, group_size", [(4, None), (3, 8), (2, 16)])
def test_fake_quantization_rounds_forward_and_passes_gradients_straight_through(bits, group_size):
    g = torch.Generator().manual_seed(10 + bits)
    w = (torch.randn(6, 32, generator=g) * 0.3).requires_grad_()
    out = run_fake_quantize_ste(w, bits, group_size)
    torch.testing.assert_close(out.detach().double(), rtn32(w.detach(), bits, group_size).double(),
                               atol=1e-6, rtol=0)
    upstream = torch.randn(6, 32, generator=g)
    (out * upstream).sum().backward()
    assert w.grad is not None, "no gradient reached w: the straight-through estimator keeps w in the graph"
    torch.testing.assert_close(w.grad, upstream, atol=0, rtol=0, msg="the STE's gradient is the identity")
