"""The reference solution, layers: RMSNorm and the SwiGLU feed-forward of the assignment-1 Transformer.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...model import layers as _layers
from ..registry import graded


@graded("layers")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), as assignment 1 defines it.

    x: (..., D); weight: (D,) the gain g. Returns (..., D) in x's dtype:
    y = x / sqrt(mean over D of x^2 + eps) * g, computed in float32 (eps inside the square root).
    """
    norm = _layers.RMSNorm(weight.shape[0], eps, device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


@graded("layers")
def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The SwiGLU feed-forward (Shazeer 2020), assignment 1's names and layout (y = x W^T).

    x: (..., D); w1, w3: (F, D); w2: (F -> D) of shape (D, F). Returns (..., D):
    W2 (SiLU(W1 x) * W3 x), with SiLU(z) = z * sigmoid(z) applied to the W1 (gate) branch.
    """
    ffn = _layers.SwiGLU(w1.shape[1], w1.shape[0], device=x.device, dtype=w1.dtype)
    ffn.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3})
    with torch.no_grad():
        return ffn(x)


def _block_config(weights: dict[str, torch.Tensor], prefix: str, num_heads: int, num_tokens: int, **knobs):
    """The ModelConfig of one layer whose weights are `weights` (keys under `prefix`)."""
    from ...model.config import ModelConfig

    q = weights[f"{prefix}q_proj.weight"]
    D, H = q.shape[1], q.shape[0] // num_heads
    ffn = weights.get("ffn.w1.weight")
    return ModelConfig(vocab_size=1, context_length=max(num_tokens, 1), d_model=D, num_layers=1, num_heads=num_heads,
                       num_kv_heads=weights[f"{prefix}k_proj.weight"].shape[0] // H,
                       d_ff=ffn.shape[0] if ffn is not None else 4 * D, **knobs)


def _rope_and_mask(config, num_tokens: int, device):
    from ...model.attention import attention_mask

    rope = _layers.RotaryEmbedding(config.head_dim, num_tokens, config.rope_theta, device=device)
    return rope.angles(torch.arange(num_tokens, device=device)), attention_mask(num_tokens, num_tokens, 0,
                                                                                 device=device)


@graded("layers")
def post_norm_block(x: torch.Tensor, weights: dict[str, torch.Tensor], num_heads: int, eps: float = 1e-5,
                    rope_theta: float = 10000.0) -> torch.Tensor:
    """The assignment-1 handout's post-norm ablation: one Transformer block in the original Transformer's
    order (Vaswani et al. 2017), the norm after each residual addition instead of before each sublayer:
        h = RMSNorm_1(x + Attn(x)),    out = RMSNorm_2(h + FFN(h))
    (the pre-norm block is h = x + Attn(RMSNorm_1(x)), out = h + FFN(RMSNorm_2(h))).

    x: (B, T, D) at positions 0 .. T - 1. weights: the block's assignment-1 keys, "attn.q_proj.weight" (N H, D),
    "attn.k_proj.weight" and "attn.v_proj.weight" (K H, D), "attn.output_proj.weight" (D, N H), "ln1.weight" and
    "ln2.weight" (D,), "ffn.w1.weight" and "ffn.w3.weight" (F, D), "ffn.w2.weight" (D, F); H = D / num_heads.
    Attn: causal grouped-query attention with RoPE on adjacent pairs (as `attention_with_kv_cache`, no cache);
    FFN: SwiGLU; RMSNorm with `eps` inside the square root. Returns (B, T, D).
    """
    from ...model.transformer import PostNormBlock

    T = x.shape[1]
    config = _block_config(weights, "attn.", num_heads, T, norm_position="post", norm_eps=eps, rope_theta=rope_theta)
    block = PostNormBlock(config, device=x.device, dtype=x.dtype)
    block.load_state_dict(weights)
    rope, mask = _rope_and_mask(config, T, x.device)
    with torch.no_grad():
        return block(x, rope, mask)[0]


@graded("layers")
def qk_norm_attention(x: torch.Tensor, weights: dict[str, torch.Tensor], num_heads: int, eps: float = 1e-6,
                      rope_theta: float = 10000.0) -> torch.Tensor:
    """The handout's QK-norm ablation (Dehghani et al. 2023; OLMo 2, Qwen3): causal self-attention whose
    queries and keys are RMS-normalised per head, with a learned gain, before RoPE, which bounds the
    attention logits (|q . k| / sqrt(H) <= sqrt(H) max|g_q| max|g_k|) however large the activations grow.

    x: (B, T, D) at positions 0 .. T - 1. weights: "q_proj" (N H, D), "k_proj" and "v_proj" (K H, D),
    "output_proj" (D, N H) (y = x W^T), "q_norm" and "k_norm" (H,), the gains g_q, g_k; H = D / num_heads.
    For every head and position: q <- q / sqrt(mean over H of q^2 + eps) * g_q, and k likewise with g_k
    (values are not normalised); then RoPE on adjacent pairs (x[2i], x[2i+1]) by angle p * rope_theta^(-2i/H)
    at position p; then causal grouped-query attention (query head n reads key/value head n // (N / K)),
    softmax(q k^T / sqrt(H)) v, and the output projection. Returns (B, T, D).
    """
    from ...model.gqa import GroupedQueryAttention

    T = x.shape[1]
    state = {f"{name}.weight": w for name, w in weights.items()}
    config = _block_config(state, "", num_heads, T, qk_norm="gain", qk_norm_eps=eps, rope_theta=rope_theta)
    attn = GroupedQueryAttention(config, device=x.device, dtype=x.dtype)
    attn.load_state_dict(state)
    rope, mask = _rope_and_mask(config, T, x.device)
    with torch.no_grad():
        return attn(x, rope, mask)[0]
