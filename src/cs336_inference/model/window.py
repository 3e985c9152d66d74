"""Sliding-window (local) attention: each query sees only the last `window` positions, itself included.

Longformer (Beltagy et al. 2020) and Mistral 7B (Jiang et al. 2023): the cache no longer grows with
the context, it is a ring buffer of `window` positions (`RollingKVCache`); information from further
back can still arrive indirectly, one window per layer, so the receptive field grows linearly with
depth. Hybrids (Gemma 2/3, Character.AI) keep some layers global (`ModelConfig.global_every`).
Attention sinks (StreamingLLM, Xiao et al. 2024; `ModelConfig.attention_sinks`): trained models park
much attention on the first tokens, so a window that drops them breaks; keeping those few positions
beside the ring repairs it at the cost of a few more cached positions.

The module is grouped-query attention with a different cache. The rolling cache alone knows the
window's geometry: which positions `update` returns and the band mask over them (`mask(step)`); the
model asks it. Without a cache the model builds the causal band from the layer's window.
"""

from __future__ import annotations

from .gqa import GroupedQueryAttention
from .config import ModelConfig
from .rolling_kv_cache import RollingKVCache


class SlidingWindowAttention(GroupedQueryAttention):
    """GQA whose layer cache is a rolling buffer of min(window, max_seq_len) positions."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        window = config.layer_window(layer_idx)
        if window is None:
            raise ValueError(f"layer {layer_idx} is global in this config (sliding_window="
                             f"{config.sliding_window}, global_every={config.global_every}); "
                             f"use GroupedQueryAttention for it")
        super().__init__(config, layer_idx, device=device, dtype=dtype)
        self.window = window
        self.sinks = config.attention_sinks

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None,
                  max_rollback: int = 1) -> RollingKVCache:
        """A ring of window + max_rollback - 1 slots: `truncate` can always remove max_rollback positions."""
        return RollingKVCache(batch_size, self.num_kv_heads, self.head_dim, self.window, max_seq_len,
                              device=device, dtype=dtype or self.q_proj.weight.dtype,
                              spare=max(0, max_rollback - 1), sinks=self.sinks)

    def cache_spec(self) -> tuple:
        """(K, H, window, sinks): the `LayerCache.spec` this layer's rolling cache must have."""
        return (self.num_kv_heads, self.head_dim, self.window, self.sinks)

    def extra_repr(self) -> str:
        return f"window={self.window}" + (f", sinks={self.sinks}" if self.sinks else "")
