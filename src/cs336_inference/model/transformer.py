"""`TransformerLM`: the CS336 assignment-1 language model, plus a KV cache and attention variants.

Layout (so a student's assignment-1 checkpoint loads unchanged): token embedding, L pre-norm
blocks x + attn(ln1(x)), x + ffn(ln2(x)), final RMSNorm, untied lm_head, no biases
(`config.tie_embeddings` makes lm_head share the embedding table, as SmolLM2 does).
One `forward(token_ids, cache=None, start_pos=0)` serves all three uses:
full forward (no cache), prefill (cache, T = prompt length) and decode (cache, T = 1).
The attention variant of each layer (GQA/MHA/MQA, MLA, sliding window, hybrids, cross-layer KV
sharing) comes from `ModelConfig`; `build_attention` picks it, `new_cache` asks each layer for its
cache (CLA followers get their group's), and `forward` builds a band mask for local layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .attention import attention_mask
from .gqa import GroupedQueryAttention
from .mla import MultiHeadLatentAttention
from .window import SlidingWindowAttention
from .config import ModelConfig
from .kv_cache import KVCache
from .layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU

__all__ = ["ModelConfig", "TransformerBlock", "TransformerLM"]


def build_attention(config: ModelConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    """The attention module of layer `layer_idx` for the configured variant."""
    if config.attention_type == "mla":
        return MultiHeadLatentAttention(config, layer_idx, device=device, dtype=dtype)
    if config.layer_window(layer_idx) is not None:
        return SlidingWindowAttention(config, layer_idx, device=device, dtype=dtype)
    return GroupedQueryAttention(config, layer_idx, device=device, dtype=dtype)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.attn = build_attention(config, layer_idx, device=device, dtype=dtype)
        self.ln2 = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(config.d_model, config.d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, rope, cache=None, start_pos: int = 0, mask=None,
                shared: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope, cache, start_pos, mask, shared=shared)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            TransformerBlock(config, i, device=device, dtype=dtype) for i in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        self.tie_weights()
        self.rope = RotaryEmbedding(self.rope_dim, config.context_length, config.rope_theta, device=device)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """With config.tie_embeddings, make lm_head use the very Parameter of token_embeddings (one
        V x D table, not a copy). Call again after anything that replaces either parameter."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight

    @property
    def rope_dim(self) -> int:
        return self.config.rope_head_dim if self.config.attention_type == "mla" else self.config.head_dim

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Assignment-1 init: truncated normal, std sqrt(2 / (d_in + d_out)) for linears, 1 for embeddings."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = math.sqrt(2.0 / (module.in_features + module.out_features))
                nn.init.trunc_normal_(module.weight, 0.0, std, -3 * std, 3 * std, generator=generator)
            elif isinstance(module, nn.Embedding):
                nn.init.trunc_normal_(module.weight, 0.0, 1.0, -3.0, 3.0, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied table counts once; excluding it then drops lm_head too)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if exclude_embeddings else n

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                  pad: torch.Tensor | None = None) -> KVCache:
        """An empty cache for `batch_size` sequences of up to `max_seq_len` (default: context_length) tokens."""
        max_seq_len = self.config.context_length if max_seq_len is None else max_seq_len
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 0 < max_seq_len <= self.config.context_length:
            raise ValueError(f"max_seq_len must be an int in [1, context_length={self.config.context_length}], "
                             f"got {max_seq_len!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        layers = []
        for i, block in enumerate(self.layers):
            source = self.config.kv_source_layer(i)
            if source == i:
                layers.append(block.attn.new_cache(batch_size, max_seq_len, device=self.device,
                                                   dtype=dtype or self.dtype))
            else:  # CLA: the same object as the group's first layer (its bytes count once)
                layers.append(layers[source])
        return KVCache(layers, max_seq_len, batch_size, pad=_check_pad(pad, batch_size, max_seq_len))

    def forward(self, token_ids: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                pad: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """token_ids (B, T) or (T,) -> logits (B, T, V) (or (T, V); (B, 1, V) with last_only).

        cache: None for a full forward; a `KVCache` to prefill (T = prompt length) or decode (T = 1)
        at positions start_pos .. start_pos + T - 1. pad (B,): left-padding slots per sequence
        (taken from the cache when it has them).
        """
        squeeze = isinstance(token_ids, torch.Tensor) and token_ids.dim() == 1
        token_ids = self._check_tokens(token_ids, start_pos)
        B, T = token_ids.shape
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache (from model.new_cache), got {type(cache).__name__}")
            if cache.batch_size != B:
                raise ValueError(f"cache holds {cache.batch_size} sequences but token_ids has batch {B}")
            cache.check_room(T, start_pos)
            pad = cache.pad if pad is None else pad
        pad = _check_pad(pad, B, start_pos + T)
        if pad is not None and self.config.attention_sinks:
            raise ValueError("attention_sinks cannot be combined with left padding (the sinks would be padding "
                             "slots, not the first real tokens); run such sequences unpadded")

        positions = torch.arange(start_pos, start_pos + T, device=self.device)      # (T,)
        if pad is not None:
            positions = (positions[None, :] - pad.to(self.device)[:, None]).clamp(min=0)  # (B, T)
        rope = self.rope.angles(positions)
        masks = {}  # one mask per distinct window (None = global) among the layers
        shared = {}  # CLA: keys/values of each group's first layer, for the rest of its group

        x = self.token_embeddings(token_ids)  # (B, T, D)
        for i, block in enumerate(self.layers):
            window = self.config.layer_window(i)  # from the config, so a stand-in block (pruning) works too
            if window not in masks:
                masks[window] = self._mask(T, start_pos, pad, window, cached=cache is not None)
            x = block(x, rope, cache.layers[i] if cache is not None else None, start_pos, masks[window],
                      shared=shared)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.ln_final(x))  # (B, T, V)
        if cache is not None:
            cache.advance(T)
        return logits[0] if squeeze else logits

    def _mask(self, T: int, start_pos: int, pad, window: int | None, cached: bool):
        """The mask over the keys a layer attends to: with a cache, global layers see positions
        0 .. start_pos + T - 1 and local ones those their rolling buffer returns (its sinks, then
        from start_pos - window + 1); without a cache, just the T new positions."""
        sinks = self.config.attention_sinks if window is not None else 0
        if not cached:
            first, sink_keys = start_pos, 0
        else:
            first = 0 if window is None else max(0, start_pos - window + 1)  # = RollingKVCache.first_key
            sink_keys = min(sinks, first)                                    # = RollingKVCache.sink_keys
        return attention_mask(T, sink_keys + start_pos + T - first, start_pos, pad, window=window,
                              device=self.device, first_key=first, sinks=sinks, sink_keys=sink_keys)

    def _check_tokens(self, token_ids, start_pos) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor):
            raise TypeError(f"token_ids must be a torch.Tensor of integer ids, got {type(token_ids).__name__}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
        if token_ids.dim() == 1:
            token_ids = token_ids[None]
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must have shape (B, T) or (T,), got {tuple(token_ids.shape)}")
        B, T = token_ids.shape
        if B == 0 or T == 0:
            raise ValueError(f"token_ids must be non-empty, got shape {tuple(token_ids.shape)}")
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
        if start_pos + T > self.config.context_length:
            raise ValueError(f"sequence too long: start_pos {start_pos} + {T} tokens exceeds "
                             f"context_length {self.config.context_length}")
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}), got values in [{lo}, {hi}]")
        return token_ids.to(self.device)


def _check_pad(pad, batch_size: int, total_len: int) -> torch.Tensor | None:
    if pad is None:
        return None
    if not isinstance(pad, torch.Tensor) or pad.dtype.is_floating_point or pad.dtype == torch.bool:
        raise TypeError("pad must be an integer tensor of shape (B,) counting left-padding slots")
    if pad.shape != (batch_size,):
        raise ValueError(f"pad must have shape ({batch_size},), got {tuple(pad.shape)}")
    if int(pad.min()) < 0 or int(pad.max()) >= total_len:
        raise ValueError(f"pad values must be in [0, {total_len}) so every sequence keeps a real token, "
                         f"got {pad.tolist()}")
    return None if int(pad.max()) == 0 else pad.long()
