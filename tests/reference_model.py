"""An independent, deliberately naive reference of the CS336 assignment-1 Transformer.

Written from the math, not from the library: per-head loops, RoPE through complex numbers,
K/V heads repeated explicitly for GQA, a full causal mask. Used to check the library's model.
"""

from __future__ import annotations

import math

import torch


def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (..., T, H); rotate pair (x[2k], x[2k+1]) as the complex number x[2k] + i x[2k+1]."""
    H = x.shape[-1]
    freqs = torch.tensor([theta ** (-2 * k / H) for k in range(H // 2)], dtype=torch.float64)
    angle = positions.double()[:, None] * freqs[None, :]                     # (T, H/2)
    rot = torch.polar(torch.ones_like(angle), angle)                           # e^{i angle}
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], H // 2, 2).contiguous())
    return torch.view_as_real(z * rot).reshape(x.shape).to(x.dtype)


def ref_rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_attention(q, k, v, mask):
    """q, k, v (T, H) for one head; mask (T, S) bool."""
    scores = q @ k.T / math.sqrt(q.shape[-1])
    scores = torch.where(mask, scores, torch.tensor(float("-inf")))
    return torch.softmax(scores, -1) @ v


def ref_forward(state: dict, cfg, token_ids: torch.Tensor) -> torch.Tensor:
    """Full causal forward of one batch (B, T) -> logits (B, T, V), no cache."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.d_model // cfg.num_heads
    B, T = token_ids.shape
    positions = torch.arange(T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = state["token_embeddings.weight"][token_ids]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = ref_rmsnorm(x, state[p + "ln1.weight"], cfg.norm_eps)
        q = h @ state[p + "attn.q_proj.weight"].T
        k = h @ state[p + "attn.k_proj.weight"].T
        v = h @ state[p + "attn.v_proj.weight"].T
        out = torch.zeros(B, T, N * H)
        for b in range(B):
            for n in range(N):
                kv = n // (N // K)  # query head n reads key/value head n // G
                qn = ref_rope(q[b, :, n * H:(n + 1) * H], positions, cfg.rope_theta)
                kn = ref_rope(k[b, :, kv * H:(kv + 1) * H], positions, cfg.rope_theta)
                out[b, :, n * H:(n + 1) * H] = ref_attention(qn, kn, v[b, :, kv * H:(kv + 1) * H], causal)
        x = x + out @ state[p + "attn.output_proj.weight"].T
        h = ref_rmsnorm(x, state[p + "ln2.weight"], cfg.norm_eps)
        a = h @ state[p + "ffn.w1.weight"].T
        g = h @ state[p + "ffn.w3.weight"].T
        x = x + (a * torch.sigmoid(a) * g) @ state[p + "ffn.w2.weight"].T
    x = ref_rmsnorm(x, state["ln_final.weight"], cfg.norm_eps)
    return x @ state["lm_head.weight"].T
