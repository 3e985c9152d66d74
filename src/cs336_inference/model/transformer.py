"""`TransformerLM`: the CS336 assignment-1 language model, plus a KV cache and attention variants.

Layout (so a student's assignment-1 checkpoint loads unchanged): token embedding, L pre-norm
blocks x + attn(ln1(x)), x + ffn(ln2(x)), final RMSNorm, untied lm_head, no biases
(`config.tie_embeddings` makes lm_head share the embedding table, as SmolLM2 does).
One `forward(token_ids, cache=None)` serves all three uses: full forward (no cache), prefill (a
cache, T = prompt length) and decode (a cache, T = 1); with a cache the tokens go at `cache.length`.
The attention variant of each layer (GQA/MHA/MQA, MLA, sliding window, hybrids, cross-layer KV
sharing) comes from `ModelConfig`; `build_attention` picks it, `new_cache` asks each layer for its
cache (CLA followers get their group's). Every `forward` runs one path through a `ForwardStep`, what the
call does: the cache's step (`KVCache.begin`), an engine's step, or a `FullStep` (no cache is a step too).
It takes the RoPE positions from the step and each layer's mask from the step (`FullStep`) or from its
layer cache (the rolling cache knows its window); every layer returns the keys/values it attended over,
which the model hands to the rest of its CLA group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import _checks
from .attention import attention_mask, check_attention_kernel
from .gqa import GroupedQueryAttention
from .linear_attention import LinearAttention
from .mla import MultiHeadLatentAttention
from .ssd import StateSpaceLayer
from .window import SlidingWindowAttention
from .config import ModelConfig
from .describe import describe
from .kv_cache import ForwardStep, KVCache, check_cache_matches_model, check_pad, rope_positions
from .layers import RMSNorm, RotaryEmbedding
from .state_cache import valid_positions
from .variants import build_ffn, build_norm

__all__ = ["FullStep", "ModelConfig", "PostNormBlock", "TransformerBlock", "TransformerLM"]


def build_attention(config: ModelConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    """The token mixer of layer `layer_idx`: the configured attention variant, or a fixed-state layer."""
    fixed_state = {"linear": LinearAttention, "ssd": StateSpaceLayer}.get(config.layer_mixer(layer_idx))
    if fixed_state is not None:
        return fixed_state(config, layer_idx, device=device, dtype=dtype)
    if config.attention_type == "mla":
        return MultiHeadLatentAttention(config, layer_idx, device=device, dtype=dtype)
    if config.layer_window(layer_idx) is not None:
        return SlidingWindowAttention(config, layer_idx, device=device, dtype=dtype)
    return GroupedQueryAttention(config, layer_idx, device=device, dtype=dtype)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.ln1 = build_norm(config, "ln1", device=device, dtype=dtype)    # RMSNorm, or Identity (norm="none")
        self.attn = build_attention(config, layer_idx, device=device, dtype=dtype)
        self.ln2 = build_norm(config, "ln2", device=device, dtype=dtype)
        self.ffn = build_ffn(config, device=device, dtype=dtype)             # SwiGLU, or SiLU (ffn="silu")

    def forward(self, x: torch.Tensor, rope, mask=None, cache=None, step=None, shared_kv=None):
        """x (B, T, D) -> (x (B, T, D), the keys/values attention used); see `GroupedQueryAttention.forward`."""
        attn_out, kv = self.attn(self.ln1(x), rope, mask, cache, step, shared_kv)
        x = x + attn_out
        return x + self.ffn(self.ln2(x)), kv


class PostNormBlock(TransformerBlock):
    """The handout's post-norm ablation (the original Transformer's order): the same modules and keys,
    x = ln1(x + attn(x)), then x = ln2(x + ffn(x))."""

    def forward(self, x: torch.Tensor, rope, mask=None, cache=None, step=None, shared_kv=None):
        attn_out, kv = self.attn(x, rope, mask, cache, step, shared_kv)
        x = self.ln1(x + attn_out)
        return self.ln2(x + self.ffn(x)), kv


BLOCKS = {"pre": TransformerBlock, "post": PostNormBlock}   # by config.norm_position

# The in-place initializers the modules' constructors run (nn.init's, and the Tensor methods they call)
_INIT_OPS = frozenset({n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")}
                      | {"normal_", "uniform_", "fill_", "zero_"})


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Inside: an initializer (`_INIT_OPS`) called on a meta tensor returns it untouched. A meta tensor has
    no values to set, yet torch traces some initializers there through its reference implementations,
    which import its compiler (`normal_`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            target = args[0] if args else kwargs.get("tensor")   # nn.init's functions pass it by name
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def uninitialized() -> _SkipMetaInit:
    """A context (this thread only) in which modules built on the meta device skip their random init:
    for a loader that builds `TransformerLM(config, device="meta")` and replaces every parameter and
    buffer (`quantization.gguf_exact`). Modules built on any other device initialize as usual."""
    return _SkipMetaInit()


@dataclass(eq=False)
class FullStep(ForwardStep):
    """A forward without a cache (no cache is a step too): T tokens per sequence at positions start ..
    start + T - 1, each layer masked on its own (`masks`), nothing cached, so nothing to commit."""

    positions: torch.Tensor   # (T,), or (B, T) counted from each sequence's first real token
    masks: tuple              # per layer: its causal (window) mask, or for a fixed-state layer which tokens are real
    layers: tuple             # per layer None: no layer cache

    @classmethod
    def begin(cls, model: TransformerLM, batch_size: int, num_new: int, start_pos: int | None = None,
              pad: torch.Tensor | None = None) -> FullStep:
        """The step of `model` over num_new tokens per sequence from start_pos (default 0); pad (B,) as in
        `TransformerLM.forward` (its values are checked: a full forward is an edge). One mask per kind."""
        start, device = start_pos or 0, model.device
        pad = check_pad(pad, batch_size, start + num_new)
        made, masks = {}, []   # kind -> mask: "valid" (fixed-state layers), or a window (None = global)
        for fixed, window in zip(model.fixed_state, model.windows):
            kind = "valid" if fixed else window
            if kind not in made:
                sinks = model.config.attention_sinks if window is not None else 0
                made[kind] = (valid_positions(start, num_new, pad, device) if fixed else
                              attention_mask(num_new, num_new, start, pad, window=window, device=device,
                                             first_key=start, sinks=sinks))
            masks.append(made[kind])
        return cls(rope_positions(start, num_new, pad, device), tuple(masks), (None,) * len(masks))

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, 1, D): the last position of every sequence."""
        return x[:, -1:]

    def commit(self) -> None:
        """Nothing was written."""


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        _checks.instance("config", config, ModelConfig, "a ModelConfig")
        self.config = config
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            BLOCKS[config.norm_position](config, i, device=device, dtype=dtype) for i in range(config.num_layers))
        self.ln_final = build_norm(config, "ln_final", device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, device=device, dtype=dtype)
        self.tie_weights()
        self.rope = RotaryEmbedding(self.rope_dim, config.context_length, config.rope_theta, device=device)
        # per layer, from the config once: the layer whose keys/values it uses (CLA) and its window
        self.kv_sources = tuple(config.kv_source_layer(i) for i in range(config.num_layers))
        self.windows = tuple(config.layer_window(i) for i in range(config.num_layers))
        self.fixed_state = tuple(config.layer_mixer(i) != "attention" for i in range(config.num_layers))
        self.no_masks = (None,) * config.num_layers   # a step with a cache: each layer cache picks its own mask
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
        return self.rope.cos.device   # a buffer every model has, even with lm_head quantized and no norms

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (quantized layers store codes, so ask a norm, or else the embedding)."""
        for module in (self.ln_final, *(m for b in self.layers for m in (b.ln1, b.ln2)), self.token_embeddings):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                return weight.dtype
        return torch.float32

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
        """A kernel registered in `attention.ATTENTION`: "reference" (the hand-written attention), "sdpa"
        (torch's fused kernel), or one the performance workshop registered ("cpu": sdpa, and our kernel for
        a decode step on a CPU with AVX512-BF16) for every grouped-query / sliding-window layer (MLA keeps
        its own kernels)."""
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
        _checks.boolean("exclude_embeddings", exclude_embeddings)
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
        check_cache_matches_model(dtype, self.dtype)
        layers = []
        for i, block in enumerate(self.layers):
            source = self.kv_sources[i]
            if source == i:
                layers.append(block.attn.new_cache(batch_size, max_seq_len, device=self.device,
                                                   dtype=dtype or self.dtype, max_rollback=max_rollback))
            else:  # CLA: the same object as the group's first layer (its bytes count once)
                layers.append(layers[source])
        return KVCache(layers, max_seq_len, batch_size)

    def forward(self, token_ids: torch.Tensor, cache: KVCache | None = None, start_pos: int | None = None,
                pad: torch.Tensor | None = None, last_only: bool = False,
                step: ForwardStep | None = None, return_hidden: bool = False):
        """token_ids (B, T) or (T,) -> logits (B, T, V) (or (T, V); with last_only (B, 1, V), or what
        step.select_last keeps).

        cache: None for a full forward; a `KVCache` to prefill (T = prompt length) or decode (T = 1):
        the tokens take positions cache.length .. cache.length + T - 1 and the cache advances by T only
        if the whole forward succeeds. start_pos: the first position without a cache (default 0); with
        one it may only repeat cache.length (a checked assertion). pad (B,): left-padding slots per
        sequence of a ragged batch, given on every call (prefill and each decode step alike).
        step: instead of a cache, a `ForwardStep` its owner already built (a paged engine step).
        Every call runs one path: `begin` checks the inputs at the edges and picks the step (what this
        call does: positions, masks, cache writes), the layers run it, and `commit` makes its writes count.
        return_hidden: also return the last block's output before the final norm, (B, T, D) at every
        position (before last_only selects), as (logits, hidden): the features Medusa and EAGLE drafts read.
        """
        ids, step = self.begin(token_ids, cache, start_pos, pad, step)   # ids (B, T)
        rope = self.rope.angles(step.positions)
        masks = step.masks if isinstance(step, FullStep) else self.no_masks   # with a cache, its layers pick theirs
        x = self.token_embeddings(ids)  # (B, T, D)
        kv = None   # the keys/values of the current CLA group's first layer
        for i, block in enumerate(self.layers):
            x, kv = block(x, rope, masks[i], step.layers[i], step, kv if self.kv_sources[i] != i else None)
        hidden = x  # (B, T, D): the features a Medusa / EAGLE draft reads
        if last_only:
            x = step.select_last(x)  # the rows whose logits predict the next token
        logits = self.lm_head(self.ln_final(x))  # (B, T, V)
        step.commit()  # only now: an exception above leaves the cache as it was
        if token_ids.dim() == 1:
            logits, hidden = logits[0], hidden[0]
        return (logits, hidden) if return_hidden else logits

    def begin(self, token_ids, cache: KVCache | None = None, start_pos: int | None = None,
              pad: torch.Tensor | None = None, step: ForwardStep | None = None) -> tuple[torch.Tensor, ForwardStep]:
        """The ids as (B, T) and the `ForwardStep` a forward runs: `step` as its owner built it, the cache's
        `KVCache.begin` (append at cache.length), or `FullStep.begin` (no cache: nothing written).
        The inputs are checked at the edges: a full forward and a cache's first forward check the ids
        (their values too) and the cache; a decode step checks nothing that reads a tensor's values."""
        if step is not None and any((cache is not None, start_pos is not None, pad is not None)):
            raise ValueError("a forward takes either a step (which brings its own positions) or a cache with "
                             "start_pos/pad, not both")
        edge = step is None and (not isinstance(cache, KVCache) or cache.length == 0)   # no cache, or an empty one
        if edge or not isinstance(token_ids, torch.Tensor):
            token_ids = self.check_inputs(token_ids, cache, start_pos, pad)
        ids = token_ids[None] if token_ids.dim() == 1 else token_ids
        if step is not None:
            return ids, step
        if cache is not None:
            return ids, cache.begin(ids.shape[1], pad, start_pos, batch_size=ids.shape[0])
        return ids, FullStep.begin(self, *ids.shape, start_pos, pad)

    def check_inputs(self, token_ids, cache=None, start_pos=None, pad=None) -> torch.Tensor:
        """The edge checks of a forward (a full one, or a cache's first): token ids (B, T) or (T,), integer,
        in [0, vocab_size), on the model's device; the cache built for this model and batch; the length."""
        token_ids = _checks.token_ids("token_ids", token_ids, self.config.vocab_size).to(self.device)
        B, T = token_ids.shape if token_ids.dim() == 2 else (1, token_ids.shape[0])
        if cache is None:
            start = 0 if start_pos is None else _checks.non_negative_int("start_pos", start_pos)
            if start + T > self.config.context_length:
                raise ValueError(f"sequence too long: start position {start} + {T} tokens exceeds "
                                 f"context_length {self.config.context_length}")
        else:
            self.check_cache(cache, B)
        if pad is not None and self.config.attention_sinks:
            raise ValueError("attention_sinks cannot be combined with left padding (the sinks would be padding "
                             "slots, not the first real tokens); run such sequences unpadded")
        return token_ids

    def check_cache(self, cache, batch_size: int) -> None:
        """Refuse a cache built for another model (layer count, sharing, heads, dims, windows) or batch."""
        _checks.instance("cache", cache, KVCache, "a KVCache (from model.new_cache)")
        fix = "build the cache with this model's new_cache(...)"
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers but this model has {len(self.layers)}; {fix}")
        owners = []
        for i, (layer, block) in enumerate(zip(cache.layers, self.layers)):
            source = self.kv_sources[i]
            if source != i:
                if layer is not cache.layers[source]:
                    raise ValueError(f"layer {i} shares layer {source}'s keys/values (kv_share_group="
                                     f"{self.config.kv_share_group}) but the cache gives it its own; {fix}")
                continue
            if any(layer is owner for owner in owners):
                raise ValueError(f"cache layer {i} is shared with an earlier layer, but this model's layer {i} "
                                 f"computes its own keys/values; {fix}")
            owners.append(layer)
            expected = block.attn.cache_spec()
            if layer.spec != expected:
                raise ValueError(f"cache layer {i} holds (K heads, key dim, window[, sinks]) = {layer.spec} but "
                                 f"this model's layer {i} needs {expected}; {fix}")
        if cache.batch_size != batch_size:
            raise ValueError(f"cache holds {cache.batch_size} sequences but token_ids has batch {batch_size}")
        if cache.max_seq_len > self.config.context_length:   # its own overflow check then keeps RoPE in range
            raise ValueError(f"cache holds up to max_seq_len={cache.max_seq_len} tokens, more than this model's "
                             f"context_length {self.config.context_length} (positions it has no RoPE angle for); {fix}")
