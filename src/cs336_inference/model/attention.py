"""Attention kernels shared by every variant: scaled dot-product attention, the causal / window /
padding mask, and grouped attention (N query heads over K key/value heads without copying K/V).

The attention modules live next door, one variant per file: `gqa` (MHA/GQA/MQA and cross-layer
sharing), `mla` (multi-head latent attention), `window` (sliding-window attention). Which kernel
`grouped_attention` runs is a name in the `ATTENTION` registry (`set_attention_kernel` chooses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernel_registry import KernelRegistry

# Attention kernels by name, each called as kernel(q, k, v, mask, scale=scale) on grouped shapes
# (`grouped_attention`). The core's two: "reference", the hand-written softmax(q k^T) v below (the
# definition), and "sdpa", torch's fused F.scaled_dot_product_attention (one kernel, no (T, S) score tensor
# in Python), checked against it. The performance workshop adds "cpu" (`workshop.register_kernels()`).
ATTENTION = KernelRegistry("attention kernel", workshop=("cpu",))


def check_attention_kernel(kernel) -> str:
    """`kernel` if it is a registered attention kernel that runs here, else a ValueError naming them."""
    return ATTENTION.check(kernel)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v, scale = 1/sqrt(H) unless given (MLA's absorbed path needs its own).

    q (..., T, H), k (..., S, H), v (..., S, Hv); mask (bool, True = may attend) broadcastable to
    (..., T, S). Softmax runs in fp32 so bf16 inputs do not lose the normalisation.
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of positions, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T, S)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return probs @ v


ATTENTION.register("reference", scaled_dot_product_attention)
ATTENTION.register("sdpa", F.scaled_dot_product_attention)


def attention_mask(num_new: int, num_keys: int, start_pos: int, pad: torch.Tensor | None = None,
                   window: int | None = None, device=None, first_key: int = 0, sinks: int = 0,
                   sink_keys: int = 0) -> torch.Tensor | None:
    """Bool mask (B or 1, 1, T, S) for T new queries at positions start_pos.. over S keys: `sink_keys`
    keys at positions 0 .. sink_keys - 1, then keys at positions first_key, first_key + 1, ... (first_key
    > 0 when a rolling buffer dropped older ones; sink_keys > 0 when it kept the first few apart).

    causal: key j <= query i; window: i - j < window, or j < sinks (attention sinks, Xiao et al. 2024:
    the first positions stay visible to every query); left padding: keys j < pad[b] are hidden from
    real queries (padding queries see everything causal, so their rows stay finite).
    Returns None when every key is visible (a plain decode step): the fast path.
    """
    if (num_new == 1 and pad is None and sink_keys == 0 and (window is None or num_keys <= window)
            and first_key + num_keys == start_pos + 1):
        return None
    i = torch.arange(start_pos, start_pos + num_new, device=device)[:, None]   # (T, 1)
    j = torch.cat([torch.arange(sink_keys, device=device),
                   torch.arange(first_key, first_key + num_keys - sink_keys, device=device)])[None, :]  # (1, S)
    mask = j <= i
    if window is not None:
        mask = mask & ((i - j < window) | (j < sinks))
    mask = mask[None, None]                                                    # (1, 1, T, S)
    if pad is not None:
        pad = pad.to(device)[:, None, None, None]                              # (B, 1, 1, 1)
        mask = mask & ((j >= pad) | (i < pad))
    return mask


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
    """q (B, N, T, H) over k (B, K, S, H), v (B, K, S, Hv) with N = K * G, without copying K/V G times.

    kernel: a name in `ATTENTION`: "reference" (`scaled_dot_product_attention` above), "sdpa" (torch's
    fused kernel), or one the workshop registered."""
    B, N, T, H = q.shape
    G = N // k.shape[1]
    q = q.reshape(B, N // G, G * T, H)                                     # (B, K, G*T, H): a group's rows
    if mask is not None:  # (B|1, 1, T, S) -> (B|1, 1, G*T, S): every query of a group sees its row's keys
        m = mask.expand(-1, -1, T, -1)
        mask = m.unsqueeze(2).expand(-1, -1, G, -1, -1).reshape(m.shape[0], 1, G * T, m.shape[-1])
    attend = ATTENTION.kernels.get(kernel)
    if attend is None:   # a misspelt kernel must not silently run the reference one
        check_attention_kernel(kernel)
    out = attend(q, k, v, mask, scale=scale)
    return out.reshape(B, N, T, out.shape[-1])                              # (B, N, T, Hv)


def require_shared_kv(shared_kv, layer_idx: int, kv_source: int):
    """The keys/values a CLA follower attends over (its group owner's), with a clear error if missing."""
    if shared_kv is None:
        raise RuntimeError(f"layer {layer_idx} shares keys/values with layer {kv_source} (cross-layer "
                           f"attention); pass that layer's returned keys/values as shared_kv (TransformerLM "
                           f"does this)")
    return shared_kv


__all__ = ["ATTENTION", "attention_mask", "check_attention_kernel", "grouped_attention", "require_shared_kv",
           "scaled_dot_product_attention"]
