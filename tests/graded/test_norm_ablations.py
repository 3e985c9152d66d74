"""Graded: the assignment-1 handout's ablations, a post-norm block and QK-norm attention. References are
written here from the equations in float64: per-head loops with an explicit softmax
(reference_model.ref_attention), RoPE through complex numbers (reference_model.ref_rope), RMSNorm as
x / sqrt(mean x^2 + eps) * g. Inputs are chosen so that the ablation's details change the output: gains far
from 1 and different per dimension (RoPE does not commute with them), rows small enough that eps matters."""

import pytest
import torch
from adapters import run_post_norm_block, run_qk_norm_attention
from reference_model import ref_attention, ref_rmsnorm, ref_rope


def ref_causal_attention(x, wq, wk, wv, wo, num_heads, theta, q_gain=None, k_gain=None, eps=None):
    """x (B, T, D) -> (B, T, D): per head, optional RMSNorm of q and k with its gain, RoPE, causal softmax."""
    x = x.double()
    B, T, _ = x.shape
    H = wq.shape[0] // num_heads
    K = wk.shape[0] // H
    q, k, v = x @ wq.double().T, x @ wk.double().T, x @ wv.double().T
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    positions = torch.arange(T)
    out = torch.zeros(B, T, num_heads * H, dtype=torch.float64)
    for b in range(B):
        for n in range(num_heads):
            j = n // (num_heads // K)
            qn, kn = q[b, :, n * H:(n + 1) * H], k[b, :, j * H:(j + 1) * H]
            if q_gain is not None:
                qn, kn = ref_rmsnorm(qn, q_gain.double(), eps), ref_rmsnorm(kn, k_gain.double(), eps)
            qn, kn = ref_rope(qn, positions, theta), ref_rope(kn, positions, theta)
            out[b, :, n * H:(n + 1) * H] = ref_attention(qn, kn, v[b, :, j * H:(j + 1) * H], causal)
    return out @ wo.double().T


def ref_swiglu(h, w1, w2, w3):
    a = h @ w1.double().T
    return (a * torch.sigmoid(a) * (h @ w3.double().T)) @ w2.double().T


def _block_weights(seed, D=16, N=4, K=2, F=24):
    g = torch.Generator().manual_seed(seed)
    H = D // N
    r = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5   # noqa: E731
    return {"attn.q_proj.weight": r(N * H, D), "attn.k_proj.weight": r(K * H, D), "attn.v_proj.weight": r(K * H, D),
            "attn.output_proj.weight": r(D, N * H), "ln1.weight": 0.5 + torch.rand(D, generator=g) * 1.5,
            "ln2.weight": 0.5 + torch.rand(D, generator=g) * 1.5, "ffn.w1.weight": r(F, D), "ffn.w3.weight": r(F, D),
            "ffn.w2.weight": r(D, F)}


def ref_block(x, w, num_heads, eps, theta, post):
    """One block, pre-norm or post-norm, from the equations."""
    x = x.double()

    def attn(h):
        return ref_causal_attention(h, w["attn.q_proj.weight"], w["attn.k_proj.weight"], w["attn.v_proj.weight"],
                                    w["attn.output_proj.weight"], num_heads, theta)

    def ffn(h):
        return ref_swiglu(h, w["ffn.w1.weight"], w["ffn.w2.weight"], w["ffn.w3.weight"])

    def ln(h, key):
        return ref_rmsnorm(h, w[key].double(), eps)

    if post:
        h = ln(x + attn(x), "ln1.weight")
        return ln(h + ffn(h), "ln2.weight")
    h = x + attn(ln(x, "ln1.weight"))
    return h + ffn(ln(h, "ln2.weight"))


@pytest.mark.parametrize("eps", [1e-5, 0.3])
def test_post_norm_block_normalises_after_each_residual(eps):
    w = _block_weights(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 16, generator=g) * torch.tensor([0.05, 2.0])[:, None, None]   # a row scale where eps matters
    got = run_post_norm_block(x, w, 4, eps, 500.0)
    assert got.shape == x.shape
    want = ref_block(x, w, 4, eps, 500.0, post=True)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    pre = ref_block(x, w, 4, eps, 500.0, post=False)     # the pre-norm order is measurably different
    assert float((pre - want).abs().max()) > 0.1


def test_post_norm_output_rows_have_the_last_norms_scale():
    """Post-norm ends in RMSNorm_2: with a gain of 1, every output row has mean square 1 / (1 + eps / ms)."""
    w = _block_weights(2)
    w["ln2.weight"] = torch.ones(16)
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(3)) * 3
    got = run_post_norm_block(x, w, 4, 1e-5, 10000.0).double()
    torch.testing.assert_close(got.pow(2).mean(-1), torch.ones(1, 5, dtype=torch.float64), atol=1e-3, rtol=0)


def _qk_weights(seed, D=16, N=4, K=2):
    g = torch.Generator().manual_seed(seed)
    H = D // N
    r = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5   # noqa: E731
    # gains far from 1 and different per dimension: normalising after RoPE, or dropping a gain, changes logits
    return {"q_proj": r(N * H, D), "k_proj": r(K * H, D), "v_proj": r(K * H, D), "output_proj": r(D, N * H),
            "q_norm": torch.tensor([3.0, 0.2, 1.5, 0.6]), "k_norm": torch.tensor([0.4, 2.5, 0.9, 1.8])}


def _ref_qk(x, w, num_heads, eps, theta):
    return ref_causal_attention(x, w["q_proj"], w["k_proj"], w["v_proj"], w["output_proj"], num_heads, theta,
                                w["q_norm"], w["k_norm"], eps)


@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_qk_norm_normalises_each_head_of_q_and_k_before_rope(eps):
    """Rows of q and k with mean square ~1e-2: eps = 1e-6 and 0.05 give clearly different outputs, so the
    eps must be the argument and sit inside the square root."""
    w = _qk_weights(0)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1)) * 0.1
    got = run_qk_norm_attention(x, w, 4, eps, 100.0)
    assert got.shape == x.shape
    want = _ref_qk(x, w, 4, eps, 100.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    other = _ref_qk(x, w, 4, 0.05 if eps == 1e-6 else 1e-6, 100.0)
    assert float((other - want).abs().max()) > 1e-3 * float(want.abs().max())   # eps is visible at this scale


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    """Scaling the query and key projections by 1000 leaves the output (nearly) unchanged: the logits are
    bounded. Without QK-norm the same scaling would make every softmax one-hot."""
    w = _qk_weights(4)
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(5))
    loud = dict(w, q_proj=w["q_proj"] * 1000, k_proj=w["k_proj"] * 1000)
    torch.testing.assert_close(run_qk_norm_attention(x, loud, 4, 1e-6, 10000.0).double(),
                               _ref_qk(x, w, 4, 1e-6, 10000.0), atol=1e-4, rtol=1e-4)
