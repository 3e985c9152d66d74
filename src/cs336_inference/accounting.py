"""Accounting: how many bytes the KV cache of a configuration holds.

(The full FLOP/byte/intensity accounting of the lecture grows here.)
Conventions: "bytes per token" is what one cached position of one sequence occupies, summed over
all layers' caches (layers that share a cache count once). Sliding-window layers hold at most
`sliding_window` positions, so the *total* at context S is `kv_cache_bytes`.
"""

from __future__ import annotations

from .config import ModelConfig


def _is_local(config: ModelConfig, layer: int) -> bool:
    """Layer uses the sliding window (hybrids keep every `global_every`-th layer global)."""
    if config.sliding_window is None:
        return False
    return config.global_every is None or (layer + 1) % config.global_every != 0


def _layer_elements_per_token(config: ModelConfig) -> int:
    """Cached elements per token per (cache-owning) layer."""
    if config.attention_type == "mla":
        return config.kv_lora_rank + config.rope_head_dim   # latent c + decoupled RoPE key
    return 2 * config.num_kv_heads * config.head_dim       # K and V for each KV head


def _cache_owning_layers(config: ModelConfig) -> list[int]:
    """Layers that own a cache: with CLA, the first layer of each group of `kv_share_group`."""
    return list(range(0, config.num_layers, config.kv_share_group))


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes one cached position of one sequence occupies, over all layers (default bf16)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if isinstance(bytes_per_element, bool) or not isinstance(bytes_per_element, (int, float)) or bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be positive, got {bytes_per_element!r}")
    return _layer_elements_per_token(config) * len(_cache_owning_layers(config)) * bytes_per_element


def kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: int = 2) -> int:
    """Total cache bytes for `batch_size` sequences of `seq_len` tokens (windows cap local layers)."""
    kv_cache_bytes_per_token(config, bytes_per_element)  # validates
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_layer = _layer_elements_per_token(config) * bytes_per_element
    total = 0
    for layer in _cache_owning_layers(config):
        held = min(seq_len, config.sliding_window) if _is_local(config, layer) else seq_len
        total += per_layer * held
    return batch_size * total
