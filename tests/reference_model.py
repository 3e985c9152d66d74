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


def _eps(cfg, norm: str) -> float:
    own = getattr(cfg, f"{norm}_eps", None)
    return cfg.norm_eps if own is None else own


def ref_forward(state: dict, cfg, token_ids: torch.Tensor) -> torch.Tensor:
    """Full causal forward of one batch (B, T) -> logits (B, T, V), no cache.

    Follows the handout's ablations when cfg asks for them: norm_position 'post' (x = norm(x + f(x))),
    norm 'none' (no block norms; ln_final per final_norm), positional 'none' (no RoPE), ffn 'silu'
    (w2 silu(w1 x), no w3), qk_norm 'gain' / 'no_gain' (RMSNorm over each head of q and k, before RoPE)."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.d_model // cfg.num_heads
    post = getattr(cfg, "norm_position", "pre") == "post"
    norms = getattr(cfg, "norm", "rmsnorm") == "rmsnorm"
    final = getattr(cfg, "final_norm", None)
    final = norms if final is None else final
    rope = getattr(cfg, "positional", "rope") == "rope"
    qk_norm = getattr(cfg, "qk_norm", "none")
    swiglu = getattr(cfg, "ffn", "swiglu") == "swiglu"
    B, T = token_ids.shape
    positions = torch.arange(T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))

    def norm(x, key, eps_name):
        return ref_rmsnorm(x, state[key], _eps(cfg, eps_name)) if norms else x

    def head_norm(x, key):       # one head (T, H)
        if qk_norm == "none":
            return x
        gain = state[key] if qk_norm == "gain" else torch.ones(H)
        return ref_rmsnorm(x, gain, _eps(cfg, "qk_norm"))

    def position(x):
        return ref_rope(x, positions, cfg.rope_theta) if rope else x

    x = state["token_embeddings.weight"][token_ids]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = x if post else norm(x, p + "ln1.weight", "ln1")
        q = h @ state[p + "attn.q_proj.weight"].T
        k = h @ state[p + "attn.k_proj.weight"].T
        v = h @ state[p + "attn.v_proj.weight"].T
        out = torch.zeros(B, T, N * H)
        for b in range(B):
            for n in range(N):
                kv = n // (N // K)  # query head n reads key/value head n // G
                qn = position(head_norm(q[b, :, n * H:(n + 1) * H], p + "attn.q_norm.weight"))
                kn = position(head_norm(k[b, :, kv * H:(kv + 1) * H], p + "attn.k_norm.weight"))
                out[b, :, n * H:(n + 1) * H] = ref_attention(qn, kn, v[b, :, kv * H:(kv + 1) * H], causal)
        x = x + out @ state[p + "attn.output_proj.weight"].T
        if post:
            x = norm(x, p + "ln1.weight", "ln1")
        h = x if post else norm(x, p + "ln2.weight", "ln2")
        a = h @ state[p + "ffn.w1.weight"].T
        g = h @ state[p + "ffn.w3.weight"].T if swiglu else 1.0   # the SiLU FFN has no gate
        x = x + (a * torch.sigmoid(a) * g) @ state[p + "ffn.w2.weight"].T
        if post:
            x = norm(x, p + "ln2.weight", "ln2")
    if final:
        x = ref_rmsnorm(x, state["ln_final.weight"], _eps(cfg, "ln_final"))
    return x @ state["lm_head.weight"].T
