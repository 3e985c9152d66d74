"""`TransformerLM`: the CS336 assignment-1 language model, plus a KV cache and attention variants.

Layout (so a student's assignment-1 checkpoint loads unchanged): token embedding, L pre-norm
blocks x + attn(ln1(x)), x + ffn(ln2(x)), final RMSNorm, untied lm_head, no biases
(`config.tie_embeddings` makes lm_head share the embedding table, as SmolLM2 does).
One `forward(token_ids, cache=None)` serves all three uses: full forward (no cache), prefill (a
cache, T = prompt length) and decode (a cache, T = 1); with a cache the tokens go at `cache.length`.
The attention variant of each layer (GQA/MHA/MQA, MLA, sliding window, hybrids, cross-layer KV
sharing) comes from `ModelConfig`; `build_attention` picks it, `new_cache` asks each layer for its
cache (CLA followers get their group's). `forward` takes the RoPE positions from the cache's step and
each layer's mask from its layer cache (the rolling cache knows its window); every layer returns the
keys/values it attended over, which the model hands to the rest of its CLA group.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import _checks
from .attention import attention_mask, check_attention_kernel
from .gqa import GroupedQueryAttention
from .mla import MultiHeadLatentAttention
from .window import SlidingWindowAttention
from .config import ModelConfig
from .describe import describe
from .kv_cache import CacheStep, KVCache
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

    def forward(self, x: torch.Tensor, rope, mask=None, cache=None, step=None, shared_kv=None):
        """x (B, T, D) -> (x (B, T, D), the keys/values attention used); see `GroupedQueryAttention.forward`."""
        attn_out, kv = self.attn(self.ln1(x), rope, mask, cache, step, shared_kv)
        x = x + attn_out
        return x + self.ffn(self.ln2(x)), kv


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        _checks.instance("config", config, ModelConfig, "a ModelConfig")
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
        return self.ln_final.weight.device   # a norm weight: present even when lm_head is quantized

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (quantized layers store codes, so ask a norm)."""
        return self.ln_final.weight.dtype

    def fuse_projections(self) -> "TransformerLM":
        """Decode option: q/k/v and SwiGLU's w1/w3 each as one matmul (fewer calls per step). The
        state dict keeps the CS336 keys, so saving and loading are unchanged. Fuse before quantizing."""
        for block in self.layers:
            for part in (block.attn, block.ffn):
                if hasattr(part, "fuse_projections"):
                    part.fuse_projections()
        return self

    def unfuse_projections(self) -> "TransformerLM":
        for block in self.layers:
            for part in (block.attn, block.ffn):
                if hasattr(part, "unfuse_projections"):
                    part.unfuse_projections()
        return self

    def set_attention_kernel(self, kernel: str) -> "TransformerLM":
        """"reference" (the hand-written attention) or "sdpa" (torch's fused kernel) for every
        grouped-query / sliding-window layer (MLA keeps its own kernels)."""
        check_attention_kernel(kernel)
        for block in self.layers:
            if hasattr(block.attn, "attention_kernel"):
                block.attn.attention_kernel = kernel
        return self

    def describe(self) -> str:
        """What runs each matmul: dense in its dtype, or a quantized layer's kernel (`model.describe`)."""
        return describe(self)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied table counts once; excluding it then drops lm_head too)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if exclude_embeddings else n

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                  max_rollback: int = 1) -> KVCache:
        """An empty cache for `batch_size` sequences of up to `max_seq_len` (default: context_length) tokens.

        max_rollback: how many positions `cache.truncate` must always be able to remove after a forward
        (speculative decoding: gamma + 1); only sliding-window rings need extra slots for it.
        """
        max_seq_len = self.config.context_length if max_seq_len is None else max_seq_len
        _checks.integer("max_seq_len", max_seq_len, 1, self.config.context_length,
                        allowed=f"an int in [1, context_length={self.config.context_length}]")
        _checks.positive_int("batch_size", batch_size)
        _checks.positive_int("max_rollback", max_rollback)
        layers = []
        for i, block in enumerate(self.layers):
            source = self.config.kv_source_layer(i)
            if source == i:
                layers.append(block.attn.new_cache(batch_size, max_seq_len, device=self.device,
                                                   dtype=dtype or self.dtype, max_rollback=max_rollback))
            else:  # CLA: the same object as the group's first layer (its bytes count once)
                layers.append(layers[source])
        return KVCache(layers, max_seq_len, batch_size)

    def forward(self, token_ids: torch.Tensor, cache: KVCache | None = None, start_pos: int | None = None,
                pad: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """token_ids (B, T) or (T,) -> logits (B, T, V) (or (T, V); (B, 1, V) with last_only).

        cache: None for a full forward; a `KVCache` to prefill (T = prompt length) or decode (T = 1):
        the tokens take positions cache.length .. cache.length + T - 1 and the cache advances by T only
        if the whole forward succeeds. start_pos: the first position without a cache (default 0); with
        one it may only repeat cache.length (a checked assertion). pad (B,): left-padding slots per
        sequence of a ragged batch, given on every call (prefill and each decode step alike).
        """
        squeeze = isinstance(token_ids, torch.Tensor) and token_ids.dim() == 1
        token_ids = self._check_tokens(token_ids)
        B, T = token_ids.shape
        if cache is None:
            start = 0 if start_pos is None else _checks.non_negative_int("start_pos", start_pos)
            step = CacheStep.new(start, T, B, pad)
        else:
            if not torch.compiler.is_compiling():   # identity checks would pin the graph to one cache
                self._check_cache(cache, B)           # object; `compile_decode` runs them eagerly first
            step = cache.begin(T, pad, start_pos)
        if step.end > self.config.context_length:
            raise ValueError(f"sequence too long: start position {step.start} + {T} tokens exceeds "
                             f"context_length {self.config.context_length}")
        if step.pad is not None and self.config.attention_sinks:
            raise ValueError("attention_sinks cannot be combined with left padding (the sinks would be padding "
                             "slots, not the first real tokens); run such sequences unpadded")
        rope = self.rope.angles(step.positions(self.device))
        masks = {}  # without a cache: one causal mask per distinct window (None = global)

        x = self.token_embeddings(token_ids)  # (B, T, D)
        kv = None   # the keys/values of the current CLA group's first layer
        for i, block in enumerate(self.layers):
            if cache is None:
                window = self.config.layer_window(i)  # from the config, so a stand-in block (pruning) works too
                if window not in masks:
                    sinks = self.config.attention_sinks if window is not None else 0
                    masks[window] = attention_mask(T, T, step.start, step.pad, window=window, device=self.device,
                                                   first_key=step.start, sinks=sinks)
                layer_cache, mask = None, masks[window]
            else:
                layer_cache = cache.layers[i]
                mask = layer_cache.mask(step)
            follower = self.config.kv_source_layer(i) != i
            x, kv = block(x, rope, mask, layer_cache, step, kv if follower else None)
        if last_only:
            x = step.select_last(x)  # (B, 1, D): the position whose logits predict the next token
        logits = self.lm_head(self.ln_final(x))  # (B, T, V)
        if cache is not None:
            cache.commit(step)  # only now: an exception above leaves the cache as it was
        return logits[0] if squeeze else logits

    def _check_cache(self, cache, batch_size: int) -> None:
        """Refuse a cache built for another model (layer count, sharing, heads, dims, windows) or batch."""
        _checks.instance("cache", cache, KVCache, "a KVCache (from model.new_cache)")
        fix = "build the cache with this model's new_cache(...)"
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers but this model has {len(self.layers)}; {fix}")
        owners = set()
        for i, (layer, block) in enumerate(zip(cache.layers, self.layers)):
            source = self.config.kv_source_layer(i)
            if source != i:
                if layer is not cache.layers[source]:
                    raise ValueError(f"layer {i} shares layer {source}'s keys/values (kv_share_group="
                                     f"{self.config.kv_share_group}) but the cache gives it its own; {fix}")
                continue
            if id(layer) in owners:
                raise ValueError(f"cache layer {i} is shared with an earlier layer, but this model's layer {i} "
                                 f"computes its own keys/values; {fix}")
            owners.add(id(layer))
            expected = block.attn.cache_spec()
            if layer.spec != expected:
                raise ValueError(f"cache layer {i} holds (K heads, key dim, window[, sinks]) = {layer.spec} but "
                                 f"this model's layer {i} needs {expected}; {fix}")
        if cache.batch_size != batch_size:
            raise ValueError(f"cache holds {cache.batch_size} sequences but token_ids has batch {batch_size}")

    def _check_tokens(self, token_ids) -> torch.Tensor:
        """(B, T) or (T,) integer ids in [0, vocab_size) -> (B, T) int64 on the model's device."""
        if torch.compiler.is_compiling():   # reading values back is a graph break: compiled callers
            return (token_ids[None] if token_ids.dim() == 1 else token_ids).to(self.device)  # check first
        token_ids = _checks.token_ids("token_ids", token_ids, self.config.vocab_size)
        return (token_ids[None] if token_ids.dim() == 1 else token_ids).to(self.device)
