"""Graded: grouped-query attention, one attention layer with a KV cache (prefill, then decode), MLA's
absorbed decode and the sliding-window mask. References are written here from the equations: a loop over
heads with an explicit softmax (reference_model.ref_attention), RoPE through complex numbers
(reference_model.ref_rope), MLA's keys and values up-projected per head, masks by two nested loops."""

import math

import pytest
import torch
from adapters import (run_attention_with_kv_cache, run_grouped_query_attention, run_mla_absorbed_attention,
                      run_mla_attention, run_sliding_window_mask)
from reference_model import ref_attention, ref_rope


def ref_gqa(q, k, v, mask):
    """q (B, N, T, H), k/v (B, K, S, H), mask (B|1, 1, T, S) or None: head n reads K/V head n // (N / K)."""
    B, N, T, _ = q.shape
    K, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, N, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        m = torch.ones(T, S, dtype=torch.bool) if mask is None else mask[min(b, mask.shape[0] - 1), 0]
        for n in range(N):
            j = n // (N // K)
            out[b, n] = ref_attention(q[b, n].double(), k[b, j].double(), v[b, j].double(), m)
    return out


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (6, 3), (4, 1)], ids=["mha", "gqa2", "gqa3", "mqa"])
def test_grouped_query_attention_matches_a_loop_over_heads(N, K):
    B, T, S, H = 2, 5, 9, 8
    q, k, v = torch.randn(B, N, T, H), torch.randn(B, K, S, H), torch.randn(B, K, S, H)
    torch.testing.assert_close(run_grouped_query_attention(q, k, v).double(), ref_gqa(q, k, v, None),
                               atol=1e-5, rtol=1e-5)
    causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]          # (T, S): the last T queries
    torch.testing.assert_close(run_grouped_query_attention(q, k, v, causal).double(),
                               ref_gqa(q, k, v, causal[None, None]), atol=1e-5, rtol=1e-5)
    per_sequence = torch.rand(B, 1, T, S) > 0.4
    per_sequence[..., 0] = True                                                     # every row sees something
    torch.testing.assert_close(run_grouped_query_attention(q, k, v, per_sequence).double(),
                               ref_gqa(q, k, v, per_sequence), atol=1e-5, rtol=1e-5)


# --- one attention layer with a KV cache -----------------------------------------------------------------


def ref_attention_layer(x, w, num_heads, theta):
    """The full causal layer over all positions at once: x (B, T, D) -> (out (B, T, D), keys, values)."""
    B, T, D = x.shape
    N = num_heads
    H = w["q_proj"].shape[0] // N
    K = w["k_proj"].shape[0] // H
    pos = torch.arange(T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    q, k, v = x @ w["q_proj"].T, x @ w["k_proj"].T, x @ w["v_proj"].T
    out = torch.zeros(B, T, N * H)
    keys, values = torch.zeros(B, K, T, H), torch.zeros(B, K, T, H)
    for b in range(B):
        for j in range(K):
            keys[b, j] = ref_rope(k[b, :, j * H:(j + 1) * H], pos, theta)
            values[b, j] = v[b, :, j * H:(j + 1) * H]
        for n in range(N):
            j = n // (N // K)
            qn = ref_rope(q[b, :, n * H:(n + 1) * H], pos, theta)
            out[b, :, n * H:(n + 1) * H] = ref_attention(qn, keys[b, j], values[b, j], causal)
    return out @ w["output_proj"].T, keys, values


def _layer_weights(D, N, K, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D), "output_proj": (D, N * H)}
    return {name: torch.randn(*shape, generator=g) / shape[1] ** 0.5 for name, shape in shapes.items()}


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_prefill_then_decode_with_a_kv_cache_equals_the_full_layer(N, K):
    B, D, H, theta = 2, 32, 8, 10000.0
    w = _layer_weights(D, N, K, H)
    x = torch.randn(B, 14, D)
    want, want_k, want_v = ref_attention_layer(x, w, N, theta)
    k_cache, v_cache = torch.zeros(B, K, 0, H), torch.zeros(B, K, 0, H)
    outs = []
    for start, end in [(0, 6), (6, 7), (7, 8), (8, 11), (11, 12), (12, 14)]:   # prefill, decodes, a 3-token chunk
        out, k_new, v_new = run_attention_with_kv_cache(x[:, start:end], w, k_cache, v_cache, N, theta)
        assert out.shape == (B, end - start, D) and k_new.shape == (B, K, end, H)
        torch.testing.assert_close(k_new[:, :, :start], k_cache, atol=0, rtol=0)   # appended, never rewritten
        k_cache, v_cache = k_new, v_new
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k_cache, want_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v_cache, want_v, atol=1e-5, rtol=1e-4)


def test_decode_at_a_late_position_rotates_by_that_position():
    """One token decoded after 40 cached ones: its query and key are rotated by 40, not by 0."""
    B, D, N, K, H, theta = 1, 16, 2, 1, 8, 500.0
    w = _layer_weights(D, N, K, H, seed=1)
    x = torch.randn(B, 41, D)
    want, want_k, _ = ref_attention_layer(x, w, N, theta)
    _, k_cache, v_cache = run_attention_with_kv_cache(x[:, :40], w, torch.zeros(B, K, 0, H), torch.zeros(B, K, 0, H),
                                                      N, theta)
    out, k_new, _ = run_attention_with_kv_cache(x[:, 40:], w, k_cache, v_cache, N, theta)
    torch.testing.assert_close(out, want[:, 40:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k_new[:, :, 40], want_k[:, :, 40], atol=1e-5, rtol=1e-4)


# --- MLA: absorbed decode ---------------------------------------------------------------------------------


def ref_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask):
    """Naive MLA: up-project every cached latent to head n's key [W_UK,n c, k_rope] and value W_UV,n c."""
    B, N, T, H = q_nope.shape
    R, S = q_rope.shape[-1], latent.shape[1]
    m = torch.ones(T, S, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(B, N, T, H, dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            k_n = torch.cat([latent[b].double() @ w_uk[n * H:(n + 1) * H].double().T, k_rope[b].double()], -1)
            v_n = latent[b].double() @ w_uv[n * H:(n + 1) * H].double().T
            q_n = torch.cat([q_nope[b, n], q_rope[b, n]], -1).double()
            scores = q_n @ k_n.T / math.sqrt(H + R)
            out[b, n] = torch.softmax(scores.masked_fill(~m, -math.inf), -1) @ v_n
    return out


@pytest.mark.parametrize("T, S, masked", [(1, 9, False), (3, 9, True), (4, 4, True)])
def test_mla_absorbed_attention_equals_the_naive_up_projection(T, S, masked):
    B, N, H, R, C = 2, 4, 8, 4, 12
    g = torch.Generator().manual_seed(T + S)
    q_nope, q_rope = torch.randn(B, N, T, H, generator=g), torch.randn(B, N, T, R, generator=g)
    latent, k_rope = torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
    w_uk, w_uv = torch.randn(N * H, C, generator=g) / C**0.5, torch.randn(N * H, C, generator=g) / C**0.5
    mask = (torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]) if masked else None
    got = run_mla_absorbed_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask)
    torch.testing.assert_close(got.double(), ref_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask),
                               atol=1e-5, rtol=1e-4)


def ref_mla_layer(x, w, N, theta):
    """The MLA layer from its equations: per position latent c and rotated shared key; per head keys
    [W_UK,n c, k_R], values W_UV,n c, queries [q_content, RoPE(q_rot)]; causal softmax over sqrt(H + R)."""
    B, T, D = x.shape
    R, H = w["k_rope_proj"].shape[0], w["k_up_proj"].shape[0] // N
    pos, causal = torch.arange(T), torch.tril(torch.ones(T, T, dtype=torch.bool))
    out = torch.zeros(B, T, N * H, dtype=torch.float64)
    W = {k: v.double() for k, v in w.items()}
    for b in range(B):
        xb = x[b].double()
        c = xb @ W["kv_down_proj"].T                                   # (T, C)
        k_rot = ref_rope(xb @ W["k_rope_proj"].T, pos, theta)          # (T, R)
        q = xb @ W["q_proj"].T                                         # (T, N (H + R))
        for n in range(N):
            qn = q[:, n * (H + R):(n + 1) * (H + R)]
            qn = torch.cat([qn[:, :H], ref_rope(qn[:, H:], pos, theta)], -1)
            kn = torch.cat([c @ W["k_up_proj"][n * H:(n + 1) * H].T, k_rot], -1)
            vn = c @ W["v_up_proj"][n * H:(n + 1) * H].T
            scores = (qn @ kn.T / math.sqrt(H + R)).masked_fill(~causal, -math.inf)
            out[b, :, n * H:(n + 1) * H] = torch.softmax(scores, -1) @ vn
    return out @ W["output_proj"].T


def test_mla_layer_rotates_queries_and_the_shared_key_and_attends_causally():
    B, T, N, H, R, C, theta = 2, 9, 4, 8, 4, 12, 100.0
    D = N * H
    g = torch.Generator().manual_seed(7)
    shapes = {"q_proj": (N * (H + R), D), "kv_down_proj": (C, D), "k_rope_proj": (R, D), "k_up_proj": (N * H, C),
              "v_up_proj": (N * H, C), "output_proj": (D, N * H)}
    w = {k: torch.randn(*s, generator=g) / s[1] ** 0.5 for k, s in shapes.items()}
    x = torch.randn(B, T, D, generator=g)
    got = run_mla_attention(x, w, N, theta)
    assert got.shape == (B, T, D)
    torch.testing.assert_close(got.double(), ref_mla_layer(x, w, N, theta), atol=1e-5, rtol=1e-4)


# --- sliding window ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_new, start, window", [(6, 0, 3), (1, 10, 4), (3, 7, 4), (5, 2, 1), (4, 0, 10)])
def test_sliding_window_mask_matches_the_definition(num_new, start, window):
    got = run_sliding_window_mask(num_new, start, window)
    want = torch.zeros(num_new, start + num_new, dtype=torch.bool)
    for t in range(num_new):
        i = start + t
        for j in range(start + num_new):
            want[t, j] = j <= i and i - j < window
    assert got.dtype == torch.bool and torch.equal(got, want), f"got\n{got.int()}\nwant\n{want.int()}"


def test_sliding_window_attention_through_gqa_sees_only_the_window():
    """The mask in use: with a window of 3, changing a key 3 positions back changes nothing."""
    B, N, K, T, H, W = 1, 2, 1, 8, 4, 3
    q, k, v = torch.randn(B, N, T, H), torch.randn(B, K, T, H), torch.randn(B, K, T, H)
    mask = run_sliding_window_mask(T, 0, W)
    out = run_grouped_query_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_gqa(q, k, v, mask[None, None]), atol=1e-5, rtol=1e-5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4], v2[:, :, 4] = 10.0, -10.0
    changed = run_grouped_query_attention(q, k2, v2, mask)
    unchanged = [t for t in range(T) if not 0 <= t - 4 < W]
    torch.testing.assert_close(changed[:, :, unchanged], out[:, :, unchanged])
