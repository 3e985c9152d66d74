"""KV caches: keep every past token's keys and values so a decode step only computes the new token.

Without a cache, generating T tokens re-runs the whole prefix each step (O(T^2) tokens through the
model, O(T^3) attention FLOPs); with one, each step processes one token and reads the cache.

Two levels:
- `KVCache` is the model's cache. It owns the position: `length` tokens are cached per sequence and
  the next forward appends at `length`. `begin(T, pad)` describes one forward as a `CacheStep`,
  `commit(step)` makes it permanent, `truncate(n)` rolls back.
- a *layer cache* (`LayerCache`) holds one layer's tensors: `ContiguousKVCache` (MHA/GQA/MQA, here),
  `RollingKVCache` (sliding-window layers, `rolling_kv_cache`), `LatentKVCache` (MLA, `latent_kv_cache`)
  and `QuantizedKVCache` (`quantization.kv`). Layers that share keys/values (cross-layer attention)
  share one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _checks
from .attention import attention_mask, grouped_attention


@dataclass(frozen=True)
class CacheStep:
    """One forward of `num_new` tokens per sequence appended at position `start` (= the cache's length).

    pad (B,) counts left-padding slots per sequence of a ragged batch (None: no padding); it is an
    argument of every forward, never stored on a cache. Built by `KVCache.begin` (or by the model for
    a forward without a cache) and read by every layer, so all layers agree on where they write.
    """

    start: int
    num_new: int
    pad: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_new

    def positions(self, device=None) -> torch.Tensor:
        """RoPE positions of the new tokens: (T,), or (B, T) counted from each sequence's first real token."""
        positions = torch.arange(self.start, self.end, device=device)                   # (T,)
        if self.pad is not None:
            positions = (positions[None, :] - self.pad.to(device)[:, None]).clamp(min=0)  # (B, T)
        return positions

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, 1, D): the hidden state whose logits predict each sequence's next token."""
        return x[:, -1:]

    @classmethod
    def new(cls, start: int, num_new: int, batch_size: int, pad: torch.Tensor | None = None) -> "CacheStep":
        """A validated step; an all-zero pad becomes None (the fast unpadded path)."""
        return cls(start, num_new, _check_pad(pad, batch_size, start + num_new))


def _check_pad(pad, batch_size: int, total_len: int) -> torch.Tensor | None:
    if pad is None:
        return None
    if not isinstance(pad, torch.Tensor) or pad.dtype.is_floating_point or pad.dtype == torch.bool:
        raise TypeError(f"pad must be an integer tensor of shape (B,) counting left-padding slots, got {pad!r}")
    if pad.shape != (batch_size,):
        raise ValueError(f"pad must have shape ({batch_size},), got {tuple(pad.shape)}")
    if int(pad.min()) < 0 or int(pad.max()) >= total_len:
        raise ValueError(f"pad values must be in [0, {total_len}) so every sequence keeps a real token, "
                         f"got {pad.tolist()}")
    return None if int(pad.max()) == 0 else pad.long()


class LayerCache:
    """The interface every layer cache implements (contiguous, rolling, latent, quantized, and a paged
    cache later). The model drives it; for one forward of T new tokens per sequence:

    1. the model's cache describes the step once (`KVCache.begin` -> `CacheStep`: first new position,
       T, padding); the model takes the RoPE positions from it (`step.positions()`);
    2. per layer, the model asks `mask(step)` for the mask over exactly the keys `update` returns, and
       the attention calls `update(k, v, step)` with the new k (B, K, T, Hk) and v (B, K, T, Hv). It
       returns every key and value the new queries may attend to, (B, K, S', Hk) and (B, K, S', Hv),
       oldest first. MLA passes its latent as a single key head (K = 1, Hk = C + R) and the latent's
       first C dims (a view) as v. `update` must not destroy anything a later forward needs: write only
       at positions >= step.start, or stage the write (the rolling ring does), so that an exception
       mid-forward leaves the cache as it was;
    3. the attention attends through `attend(q, kv, mask, step)` (default: `grouped_attention` over
       the keys/values `update` returned; CLA followers pass their group owner's);
    4. once every layer has run, `KVCache.commit(step)` calls `commit(step)` on each layer (the ring
       writes its slots now) and advances the length.

    `check_truncate(n)` raises if rolling back to n tokens is impossible (before anything changes);
    `truncate(n)` does it (speculative decoding discards rejected drafts this way). `nbytes` counts
    the allocated tensor bytes, `bytes_per_token` what one more token of one sequence adds.

    Speculative decoding verifies several draft tokens in one forward (T = gamma + 1), then truncates.
    A paged cache fits the same contract without another model forward: its `begin` returns a step
    subclass that carries block tables, whose `positions()` gives each token's position in its own
    sequence for a ragged batch run as one concatenated row (B = 1), whose `end` is the longest
    sequence (checked against the context length) and whose `select_last` picks each sequence's last
    token for `last_only`; its layers' `update` writes through the block tables, and either `mask`
    keeps each token inside its own sequence (block-diagonal, causal) or `attend` runs attention per
    sequence over the blocks. `spec` must match the model layer's `cache_spec()` (the model refuses a
    cache built for another shape).
    """

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def mask(self, step: CacheStep) -> torch.Tensor | None:
        """Causal mask (B|1, 1, T, end) over positions 0 .. step.end - 1, padding hidden; None if all visible."""
        return attention_mask(step.num_new, step.end, step.start, step.pad, device=self.device)

    def attend(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
               step: CacheStep, scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
        """q (B, N, T, Hk) over kv = (keys (B, K, S', Hk), values (B, K, S', Hv)) -> (B, N, T, Hv).
        kernel: "reference" (hand-written attention) or "sdpa" (torch's fused kernel)."""
        return grouped_attention(q, *kv, mask, scale, kernel=kernel)

    def commit(self, step: CacheStep) -> None:
        """Make the step's write permanent (caches that write in place in `update` have nothing to do)."""

    def check_truncate(self, n: int) -> None:
        """Every written position stays intact until overwritten, so any rollback is fine."""

    def truncate(self, n: int) -> None:
        """Nothing to free: positions >= n are simply overwritten by the next update."""

    @property
    def spec(self) -> tuple:
        """(key/value heads K, key dim, window or None): what the model checks the cache was built for."""
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


class _KVBuffers(LayerCache):
    """Storage accounting shared by caches that keep K and V buffers of shape (B, K, slots, H)."""

    k: torch.Tensor
    v: torch.Tensor
    window: int | None = None

    @property
    def spec(self) -> tuple:
        return (self.k.shape[1], self.k.shape[3], self.window)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position of one sequence occupies in this layer: 2 (K, V) * K * H * element size."""
        _, K, _, H = self.k.shape
        return 2 * K * H * self.k.element_size()


class ContiguousKVCache(_KVBuffers):
    """One layer's keys and values in preallocated buffers of shape (B, K, S_max, H).

    Preallocating the maximum length makes append an in-place copy (no torch.cat per step) and
    keeps the readable prefix a view; the price is memory reserved up front (paging fixes that).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        _checks.positive_ints(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              max_seq_len=max_seq_len)
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, K, T, H) at positions [start, start + T); return all keys/values (B, K, end, H)."""
        end = check_kv_write(k, v, step, self.k, self.max_seq_len)
        self.k[:, :, step.start:end] = k.detach()   # the cache stores values, never an autograd graph
        self.v[:, :, step.start:end] = v.detach()
        if k.requires_grad or v.requires_grad:       # grad enabled: gradients reach this step's k, v only
            return _with_new(self.k, k, step), _with_new(self.v, v, step)
        return self.read(end)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions, as views (B, K, length, H)."""
        return self.k[:, :, :length], self.v[:, :, :length]


class KVCache:
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

    def __len__(self) -> int:
        return self.length

    def unique_layers(self) -> list:
        """Each distinct layer cache once (layers that share a cache count once)."""
        unique = []
        for layer in self.layers:   # `is`, not id(): a compiled decode step must not pin one cache object
            if not any(layer is u for u in unique):
                unique.append(layer)
        return unique

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage actually allocated (shared caches counted once)."""
        return sum(layer.nbytes for layer in self.unique_layers())

    @property
    def bytes_per_token(self) -> int:
        """Bytes that one more token of one sequence adds, summed over the model's layers."""
        return sum(layer.bytes_per_token for layer in self.unique_layers())

    def begin(self, num_new: int, pad: torch.Tensor | None = None, start_pos: int | None = None) -> CacheStep:
        """Describe a forward of `num_new` tokens per sequence appended at `length`; refuse (before anything
        is written) an overflow or a `start_pos` that is not `length`."""
        if start_pos is not None and start_pos != self.length:
            raise ValueError(f"start_pos ({start_pos}) must equal the number of cached tokens ({self.length}): "
                             f"a cache appends at its own length (omit start_pos), or call "
                             f"cache.truncate({start_pos}) first to roll back")
        if self.length + num_new > self.max_seq_len:
            raise ValueError(f"cache overflow: {self.length} cached + {num_new} new tokens exceeds "
                             f"max_seq_len {self.max_seq_len}")
        return CacheStep.new(self.length, num_new, self.batch_size, pad)

    def commit(self, step: CacheStep) -> None:
        """Every layer ran `step`: make it permanent and advance the length."""
        if step.start != self.length:
            raise RuntimeError(f"commit of a step that starts at {step.start}, but the cache holds {self.length} "
                               f"tokens (a step is committed once, by the forward that began it)")
        for layer in self.unique_layers():
            layer.commit(step)
        self.length = step.end

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (speculative decoding discards rejected drafts this way)."""
        _checks.integer("n", n, 0, self.length, allowed=f"an int in [0, {self.length}] (the cached length)")
        layers = self.unique_layers()
        for layer in layers:  # every layer agrees before any changes (rolling buffers may refuse)
            layer.check_truncate(n)
        for layer in layers:
            layer.truncate(n)
        self.length = n
