"""KV caches: keep every past token's keys and values so a decode step only computes the new token.

Without a cache, generating T tokens re-runs the whole prefix each step (O(T^2) tokens through the
model, O(T^3) attention FLOPs); with one, each step processes one token and reads the cache.

The model and its cache meet in a `ForwardStep`: one forward's positions, its layer caches, which
rows feed the LM head, and `commit()`. Implementations: `CacheStep`, begun by the model's own
`KVCache` (B sequences, T new tokens each, appended at `length`), `serving.PagedStep` (a ragged
engine step through block tables), `generation.compiled.StaticDecodeStep` (fixed shapes, for CUDA
graphs) and `model.transformer.FullStep` (no cache: nothing written). Per layer the attention writes
and attends through a `LayerCache`: `ContiguousKVCache` (MHA/GQA/MQA, here), `RollingKVCache`
(sliding-window layers), `LatentKVCache` (MLA), `QuantizedKVCache` (`quantization.kv`),
`serving.PagedLayerCache`. Layers
that share keys/values (cross-layer attention) share one layer cache object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _checks
from .attention import attention_mask, grouped_attention


class ForwardStep:
    """What one forward of `TransformerLM` needs from its cache (the whole contract):

    - `positions`: the RoPE positions of the new tokens, (T,) or (B, T);
    - `layers`: one `LayerCache` per model layer (the same object for layers that share one);
    - `select_last(x)`: x (B, T, D) -> the rows whose logits predict each sequence's next token;
    - `commit()`: called once, after every layer ran; makes the forward's writes count.
    A forward that raises before `commit` must leave the cache as it was.
    """

    positions: torch.Tensor
    layers: list

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError


def rope_positions(start: int, num_new: int, pad: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Positions start .. start + T - 1: (T,), or (B, T) counted from each sequence's first real token."""
    positions = torch.arange(start, start + num_new, device=device)                # (T,)
    if pad is not None:
        positions = (positions[None, :] - pad.to(device)[:, None]).clamp(min=0)    # (B, T)
    return positions


@dataclass(eq=False)
class CacheStep(ForwardStep):
    """One forward of `num_new` tokens per sequence appended at position `start` (the cache's length).

    pad (B,) counts left-padding slots per sequence of a ragged batch (None: no padding); it is an
    argument of every forward, never stored on a cache. `KVCache.begin` fills the rest: the RoPE
    positions, `mask` (causal over positions 0 .. end - 1, padding hidden; None when every key is
    visible) for the layers that attend over everything they cached, the layer caches, and the cache
    that `commit` advances. Layer caches that write only at commit (the rolling ring) put themselves
    on `staged` in `update`. A bare `CacheStep(start, num_new)` drives a layer cache's update/commit.
    """

    start: int
    num_new: int
    pad: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    layers: list = ()
    cache: KVCache | None = None
    staged: list = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, 1, D): the last position of every sequence."""
        return x[:, -1:]

    def commit(self) -> None:
        """Write what the layers staged, then advance the cache by num_new (a step is committed once)."""
        if self.cache.length != self.start:
            raise RuntimeError(f"commit of a step that starts at {self.start}, but the cache holds "
                               f"{self.cache.length} tokens (a step is committed once, by the forward that began it)")
        for layer in self.staged:
            layer.commit(self)
        self.cache.length = self.start + self.num_new


def check_cache_dtype(dtype) -> None:
    """A cache stores keys and values (or a state): dtype must be a floating-point torch.dtype, or None."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None for the model's "
                        f"dtype, got {dtype!r} (an integer cache would silently round every key and value)")


def check_cache_matches_model(dtype, model_dtype: torch.dtype) -> None:
    """A cache's dtype must be the model's: keys and values are written in the activation dtype, and a
    cache of another dtype fails inside torch at the first forward (or rounds every key silently)."""
    check_cache_dtype(dtype)
    if dtype is not None and dtype != model_dtype:
        raise ValueError(f"dtype={dtype} differs from the model's dtype {model_dtype}: a cache holds the model's "
                         f"keys and values as computed; pass dtype=None (or {model_dtype}), or cast the model first "
                         f"(model.to({dtype}))")


def check_pad(pad, batch_size: int, total_len: int) -> torch.Tensor | None:
    """A validated pad (B,) as int64, or None when it is None or all zero (reads its values: an edge check)."""
    check_pad_shape(pad, batch_size)
    if pad is None:
        return None
    if int(pad.min()) < 0 or int(pad.max()) >= total_len:
        raise ValueError(f"pad values must be in [0, {total_len}) so every sequence keeps a real token, "
                         f"got {pad.tolist()}")
    return None if int(pad.max()) == 0 else pad.long()


def check_pad_shape(pad, batch_size: int) -> None:
    """pad must be None or an integer tensor (B,) (no value is read: safe in a decode step)."""
    if pad is None:
        return
    if not isinstance(pad, torch.Tensor) or pad.dtype.is_floating_point or pad.dtype == torch.bool:
        raise TypeError(f"pad must be an integer tensor of shape (B,) counting left-padding slots, got {pad!r}")
    if pad.shape != (batch_size,):
        raise ValueError(f"pad must have shape ({batch_size},), got {tuple(pad.shape)}")


class LayerCache:
    """One layer's cached keys and values. For one forward (`step`: a `CacheStep` or another
    `ForwardStep` implementation the cache is built for):

    - `update(k, v, step)`: store this forward's new keys (B, K, T, Hk) and values (B, K, T, Hv) and
      return what the new queries attend over (`attend` reads it; CLA followers receive it too). It
      must not destroy anything a later forward needs before `step.commit()` (write only positions
      >= step.start, or stage the write and join `step.staged`);
    - `attend(q, kv, step, scale=None, kernel="reference")`: q (B, N, T, Hk) over that kv -> (B, N, T, Hv);
    - `commit(step)`: write what `update` staged (only for caches on `step.staged`);
    - `check_truncate(n)` raises if rolling back to n tokens is impossible; `truncate(n)` does it;
    - `spec` (K, key dim, window, ...) must equal the model layer's `cache_spec()`;
    - `nbytes` (allocated tensor bytes), `bytes_per_token` (what one more token of one sequence adds).
    """

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], step: CacheStep,
               scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
        """Grouped attention over kv = (keys (B, K, S', Hk), values (B, K, S', Hv)) under step.mask."""
        return grouped_attention(q, *kv, step.mask, scale, kernel=kernel)

    def mask(self, step: CacheStep) -> torch.Tensor | None:
        """The mask (B|1, 1, T, S') over the keys `update` returns for `step`; None if all are visible."""
        return attention_mask(step.num_new, step.end, step.start, step.pad, device=self.device)

    def commit(self, step: CacheStep) -> None:
        """Nothing staged: `update` wrote in place."""

    def check_truncate(self, n: int) -> None:
        """Every written position stays intact until overwritten, so any rollback is fine."""

    def truncate(self, n: int) -> None:
        """Nothing to free: positions >= n are simply overwritten by the next update."""

    @property
    def spec(self) -> tuple:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError


def unique_layers(layers) -> list:
    """Each distinct layer cache once, in order (layers that share one object count once). Identity is
    `is`, not id(): a compiled decode step must not pin one cache object."""
    unique = []
    for layer in layers:
        if not any(layer is u for u in unique):
            unique.append(layer)
    return unique


def _with_new(buffer: torch.Tensor, new: torch.Tensor, step: CacheStep) -> torch.Tensor:
    """Positions [0, start) from the buffer (constants) followed by the new ones as computed (with grad)."""
    return torch.cat([buffer[:, :, :step.start], new], dim=2)


def _check_kv(name: str, x: torch.Tensor, batch: int, heads: int, dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != dim:
        raise ValueError(f"{name} must have shape (B={batch}, K={heads}, T, H={dim}), got {tuple(x.shape)}")


def check_kv_write(k: torch.Tensor, v: torch.Tensor, step: CacheStep, buffer: torch.Tensor, max_seq_len: int) -> int:
    """Validate a write of k, v (B, K, T, H) at step.start into a (B, K, S_max, H) buffer; return its end."""
    B, K, _, H = buffer.shape
    _check_kv("k", k, B, K, H)
    _check_kv("v", v, B, K, H)
    if k.shape[2] != step.num_new or v.shape[2] != step.num_new:
        raise ValueError(f"k and v must hold the step's {step.num_new} new positions, "
                         f"got {k.shape[2]} and {v.shape[2]}")
    if step.start < 0 or step.end > max_seq_len:
        raise ValueError(f"cache overflow: writing positions [{step.start}, {step.end}) into a cache of "
                         f"max_seq_len {max_seq_len}")
    return step.end


class KVBuffers(LayerCache):
    """A layer cache whose keys and values are two preallocated tensors `k`, `v` of one shape, with
    the key/value heads on axis `HEADS` and the head dim last: the storage accounting they share."""

    HEADS = 1            # (B, K, slots, H); the paged pools are (blocks, block_size, K, H)
    window: int | None = None
    k: torch.Tensor
    v: torch.Tensor

    def allocate(self, shape: tuple[int, ...], device=None, dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def spec(self) -> tuple:
        return (self.k.shape[self.HEADS], self.k.shape[-1], self.window)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position of one sequence occupies in this layer: 2 (K, V) * K * H * element size."""
        return 2 * self.k.shape[self.HEADS] * self.k.shape[-1] * self.k.element_size()


class ContiguousKVCache(KVBuffers):
    """One layer's keys and values in preallocated buffers of shape (B, K, S_max, H).

    Preallocating the maximum length makes append an in-place copy (no torch.cat per step) and
    keeps the readable prefix a view; the price is memory reserved up front (paging fixes that).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              max_seq_len=max_seq_len)
        self.allocate((batch_size, num_kv_heads, max_seq_len, head_dim), device, dtype)
        self.max_seq_len = max_seq_len

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, K, T, H) at positions [start, start + T); return all keys/values (B, K, end, H)."""
        start, end = step.start, step.start + step.num_new
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[2:] != (step.num_new, self.k.shape[3]) \
                or end > self.max_seq_len:
            check_kv_write(k, v, step, self.k, self.max_seq_len)   # raises, naming what is wrong
        self.k[:, :, start:end] = k.detach()   # the cache stores values, never an autograd graph
        self.v[:, :, start:end] = v.detach()
        if k.requires_grad or v.requires_grad:  # grad enabled: gradients reach this step's k, v only
            return _with_new(self.k, k, step), _with_new(self.v, v, step)
        return self.k[:, :, :end], self.v[:, :, :end]

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions, as views (B, K, length, H)."""
        return self.k[:, :, :length], self.v[:, :, :length]


class LayerCaches:
    """What a model-wide cache reports about its `layers` (one layer cache per model layer; layers that
    share one object count once): `KVCache` here, `serving.PagedKVCache` for the engine."""

    layers: list

    def unique_layers(self) -> list:
        """Each distinct layer cache once (layers that share a cache count once)."""
        return unique_layers(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage actually allocated (shared caches counted once)."""
        return sum(layer.nbytes for layer in self.unique_layers())

    @property
    def bytes_per_token(self) -> int:
        """Bytes that one more token of one sequence adds, summed over the model's layers."""
        return sum(layer.bytes_per_token for layer in self.unique_layers())


class KVCache(LayerCaches):
    """The model's cache: one layer cache per layer (the same object for layers that share, as in
    cross-layer attention) and `length`, the number of tokens cached per sequence: the next forward
    appends at `length`. Nothing else is stored (padding is an argument of each forward)."""

    def __init__(self, layers: list, max_seq_len: int, batch_size: int):
        if not layers:
            raise ValueError("layers must be a non-empty list of layer caches")
        self.layers = list(layers)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.length = 0
        self.device = self.layers[0].device

    def __len__(self) -> int:
        return self.length

    def begin(self, num_new: int, pad: torch.Tensor | None = None, start_pos: int | None = None,
              batch_size: int | None = None) -> CacheStep:
        """Describe a forward of `num_new` tokens per sequence appended at `length`; refuse (before anything
        is written) an overflow, another batch size, or a `start_pos` that is not `length`. The pad's values
        are checked on the first forward (the prefill); later steps check only its shape (no host sync)."""
        start = self.length
        if start_pos is not None and start_pos != start:
            raise ValueError(f"start_pos ({start_pos}) must equal the number of cached tokens ({start}): "
                             f"a cache appends at its own length (omit start_pos), or call "
                             f"cache.truncate({start_pos}) first to roll back")
        if start + num_new > self.max_seq_len:
            raise ValueError(f"cache overflow: {start} cached + {num_new} new tokens exceeds "
                             f"max_seq_len {self.max_seq_len}")
        if batch_size is not None and batch_size != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} sequences but token_ids has batch {batch_size}")
        if start == 0:
            pad = check_pad(pad, self.batch_size, num_new)
        elif pad is not None:
            check_pad_shape(pad, self.batch_size)
        return CacheStep(start, num_new, pad, rope_positions(start, num_new, pad, self.device),
                         attention_mask(num_new, start + num_new, start, pad, device=self.device), self.layers, self)

    def commit(self, step: CacheStep) -> None:
        """Every layer ran `step`: make it permanent and advance the length (`step.commit()`)."""
        step.commit()

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (speculative decoding discards rejected drafts this way)."""
        _checks.integer("n", n, 0, self.length, allowed=f"an int in [0, {self.length}] (the cached length)")
        layers = self.unique_layers()
        for layer in layers:  # every layer agrees before any changes (rolling buffers may refuse)
            layer.check_truncate(n)
        for layer in layers:
            layer.truncate(n)
        self.length = n
