"""The reference solution, attention: grouped-query attention, one attention layer with a KV cache,
MLA's absorbed decode, the sliding-window mask and the rolling buffer.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import sys

import torch
from einops import rearrange

from ...model import attention as _attention
from ...model import kv_cache as _kv_cache
from ...model import layers as _layers
from ...model import mla as _mla
from ...model import rolling_kv_cache as _rolling
from ...model.config import ModelConfig
from ...model.kv_cache import CacheStep
from ..registry import graded


@graded("attention")
def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention: N query heads share K key/value heads (G = N / K consecutive query heads
    per key/value head: query head n reads key/value head n // G). MHA is K = N, MQA is K = 1.

    q: (B, N, T, H); k: (B, K, S, H); v: (B, K, S, H); mask: bool, True = may attend, (T, S) or
    (B, 1, T, S) (the same for every head), or None (everything visible). Returns (B, N, T, H):
    softmax(q k^T / sqrt(H), masked) v per head.
    """
    if mask is not None and mask.dim() == 2:
        mask = mask[None, None]                              # (1, 1, T, S)
    return _attention.grouped_attention(q, k, v, mask)


@graded("attention")
def attention_with_kv_cache(x: torch.Tensor, weights: dict[str, torch.Tensor], k_cache: torch.Tensor,
                            v_cache: torch.Tensor, num_heads: int,
                            rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal self-attention layer run on T new tokens that follow S cached ones (prefill: S = 0;
    decode: T = 1), with RoPE and grouped-query attention.

    x: (B, T, D), the new tokens' inputs, at positions S .. S + T - 1.
    weights: "q_proj" (N H, D), "k_proj" (K H, D), "v_proj" (K H, D), "output_proj" (D, N H) (the CS336
    assignment-1 layout: y = x W^T); K = k_proj rows / H with H = q_proj rows / num_heads.
    k_cache, v_cache: (B, K, S, H), the keys (already rotated) and values of the S earlier positions.
    RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of q and k by angle p * rope_theta^(-2i/H) at position p.
    Query t attends to every cached position and to new positions <= its own.
    Returns (out (B, T, D), k_cache' (B, K, S + T, H), v_cache' (B, K, S + T, H)): the output projection
    of the attention, and the caches with the new (rotated) keys and values appended.
    """
    B, T, D = x.shape
    S = k_cache.shape[2]
    H = weights["q_proj"].shape[0] // num_heads
    K = weights["k_proj"].shape[0] // H
    q = rearrange(x @ weights["q_proj"].T, "B T (N H) -> B N T H", N=num_heads)
    k = rearrange(x @ weights["k_proj"].T, "B T (K H) -> B K T H", K=K)
    v = rearrange(x @ weights["v_proj"].T, "B T (K H) -> B K T H", K=K)
    cos, sin = _layers.rope_angles(H, S + T, rope_theta, device=x.device)
    q = _layers.apply_rope(q, cos[S:], sin[S:])          # positions S .. S + T - 1
    k = _layers.apply_rope(k, cos[S:], sin[S:])
    keys = torch.cat([k_cache, k], dim=2)                 # (B, K, S + T, H)
    values = torch.cat([v_cache, v], dim=2)
    mask = _attention.attention_mask(T, S + T, S, device=x.device)
    out = _attention.grouped_attention(q, keys, values, mask)
    return rearrange(out, "B N T H -> B T (N H)") @ weights["output_proj"].T, keys, values


@graded("attention")
def mla_absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                           w_uk: torch.Tensor, w_uv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2) over the cached latents, absorbed form.

    q_nope: (B, N, T, H) content queries; q_rope: (B, N, T, R) rotated queries; latent: (B, S, C) cached
    latents c; k_rope: (B, S, R) cached rotated key shared by all heads; w_uk, w_uv: (N H, C), the
    up-projections (head n's key is W_UK[nH:(n+1)H] c, its value W_UV[nH:(n+1)H] c); mask: (T, S) bool
    (True = may attend) or None.
    Returns (B, N, T, H): for each head n, softmax((q_nope_n . k_n + q_rope_n . k_rope) / sqrt(H + R)) v_n,
    computed without materialising per-head keys or values: fold W_UK into the query
    (q_nope_n . W_UK,n c = (W_UK,n^T q_nope_n) . c), attend over c directly, apply W_UV,n after.
    """
    cached = torch.cat([latent, k_rope], dim=-1)[:, None]      # (B, 1, S, C + R): one shared key head
    if mask is not None:
        mask = mask.reshape(1, 1, *mask.shape[-2:])
    return _mla.absorbed_attention(q_nope, q_rope, cached, w_uk, w_uv, mask)


@graded("attention")
def mla_attention(x: torch.Tensor, weights: dict[str, torch.Tensor], num_heads: int,
                  rope_theta: float = 10000.0) -> torch.Tensor:
    """One causal multi-head latent attention layer (DeepSeek-V2, eqs. 9-14) over a whole sequence.

    x: (B, T, D) at positions 0 .. T - 1. weights (y = x W^T, as assignment 1): "q_proj" (N (H + R), D),
    each head's H content dims then its R rotated dims; "kv_down_proj" (C, D) the latent c = W_DKV x;
    "k_rope_proj" (R, D) the key part every head shares, k_R = RoPE(W_KR x); "k_up_proj" (N H, C) and
    "v_up_proj" (N H, C): head n's key content W_UK,n c and value W_UV,n c (rows n H .. (n + 1) H);
    "output_proj" (D, N H). N = num_heads, H = k_up_proj rows / N, R = k_rope_proj rows, C = latent dims.
    RoPE rotates adjacent pairs (x[2i], x[2i+1]) of each head's R query dims and of k_R by angle
    p * rope_theta^(-2i/R) at position p. Head n: q_n = [q_content, RoPE(q_rot)], k_n = [W_UK,n c, k_R],
    softmax(q_n k_n^T / sqrt(H + R)) causal, times v_n. Returns (B, T, D): output_proj of the heads'
    outputs concatenated.
    """
    B, T, D = x.shape
    R, C = weights["k_rope_proj"].shape[0], weights["kv_down_proj"].shape[0]
    config = ModelConfig(vocab_size=2, context_length=T, d_model=D, num_layers=1, num_heads=num_heads,
                         num_kv_heads=num_heads, d_ff=2, rope_theta=rope_theta, attention_type="mla",
                         kv_lora_rank=C, rope_head_dim=R)
    layer = _mla.MultiHeadLatentAttention(config).to(device=x.device, dtype=x.dtype)
    layer.load_state_dict({f"{name}.weight": w for name, w in weights.items()})
    cos, sin = _layers.rope_angles(R, T, rope_theta, device=x.device)
    mask = _attention.attention_mask(T, T, 0, device=x.device)
    with torch.no_grad():
        out, _ = layer(x, (cos, sin), mask)
    return out


@graded("attention")
class ContiguousKVCache:
    """One attention layer's keys and values, preallocated for max_seq_len positions (gpt-fast's cache; the
    library's layer cache of the same name, which the model-wide `KVCache` drives for every layer).

    Buffers of shape (B, K, max_seq_len, H) in float32 (or `dtype`); attribute `length` (int): positions
    written so far. `nbytes`: the bytes of both buffers as allocated (keys and values); `bytes_per_token`:
    what one position of one sequence occupies (keys and values of K heads of H dims).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32):
        """An empty cache."""
        self._layer = _kv_cache.ContiguousKVCache(batch_size, num_kv_heads, head_dim, max_seq_len, dtype=dtype)
        self._cache = _kv_cache.KVCache([self._layer], max_seq_len, batch_size)

    @property
    def length(self) -> int:
        return self._cache.length

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self._cache.bytes_per_token

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, K, T, H) at positions length .. length + T - 1 and return the keys and values of
        positions 0 .. length + T - 1 (B, K, length + T, H), oldest first; then length += T. If that would
        pass max_seq_len, raise ValueError and change nothing."""
        step = self._cache.begin(k.shape[2])
        keys, values = self._layer.update(k, v, step)
        self._cache.commit(step)
        return keys.clone(), values.clone()

    def truncate(self, n: int) -> None:
        """Roll back to the first n positions (0 <= n <= length, else ValueError and nothing changes): the
        next append writes at position n (speculative decoding discards rejected drafts this way)."""
        self._cache.truncate(n)


@graded("attention")
def sliding_window_mask(num_new: int, start: int, window: int) -> torch.Tensor:
    """The mask of sliding-window attention (Mistral 7B) for T = num_new queries at positions
    start .. start + T - 1 over the keys at positions 0 .. start + T - 1.

    Returns (T, start + T) bool: query i may attend to key j iff j <= i and i - j < window
    (each query sees itself and the window - 1 positions before it).
    """
    mask = _attention.attention_mask(num_new, start + num_new, start, window=window)
    if mask is None:   # the library's fast path: every key visible
        return torch.ones(num_new, start + num_new, dtype=torch.bool)
    return mask[0, 0]


@graded("attention")
class RollingKVCache:
    """A sliding-window layer's keys and values in a ring of `capacity` slots (Mistral 7B).

    Position p lives in slot p % capacity, so memory stays flat however long the sequence grows. A query at
    position i attends to positions i - window + 1 .. i. capacity >= window; the capacity - window spare
    slots let `truncate` roll back (speculative decoding rejects drafts) even after the ring has wrapped.
    Attributes (or properties): `length` (int), the number of positions appended so far (after rollbacks);
    `nbytes` (int), the bytes of the ring's keys and values as allocated: 2 B K capacity H times 4 (float32),
    however long the sequence grows.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, capacity: int):
        """An empty buffer for keys/values of shape (B, K, ., H); window >= 1, capacity >= window."""
        if capacity < window:
            raise ValueError(f"capacity must be >= window ({window}), got {capacity}")
        self._ring = _rolling.RollingKVCache(batch_size, num_kv_heads, head_dim, window, sys.maxsize,
                                             spare=capacity - window)
        self.window, self.capacity, self.length = window, capacity, 0

    @property
    def nbytes(self) -> int:
        return self._ring.nbytes

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, K, T, H) at positions length .. length + T - 1 (slot p % capacity; when T exceeds
        capacity only the last `capacity` positions remain). Then length += T."""
        step = CacheStep(self.length, k.shape[2])
        self._ring.update(k, v, step)
        self._ring.commit(step)
        self.length = step.end

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, K, W', H) of positions max(0, length - window + 1) .. length - 1, oldest
        first: what a query at position `length` attends to besides itself (W' = min(window - 1, length))."""
        first = max(0, self.length - self.window + 1)
        k, v = self._ring.read(self.length)                  # positions oldest .. length - 1
        skip = first - (self.length - k.shape[2])
        return k[:, :, skip:], v[:, :, skip:]

    def truncate(self, n: int) -> None:
        """Roll back to the first n positions (0 <= n <= length). Raise ValueError and change nothing if a
        position that `context()` would then return was overwritten in the ring (by any append since it
        was written, including appends that were rolled back)."""
        if not isinstance(n, int) or not 0 <= n <= self.length:
            raise ValueError(f"n must be an int in [0, {self.length}], got {n!r}")
        self._ring.truncate(n)
        self.length = n
