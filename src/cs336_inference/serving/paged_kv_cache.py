"""`PagedKVCache`: the model's keys and values in block pools, read and written through block tables.

Per layer one pool of shape (num_blocks, block_size, K, H) for keys and one for values; token
position p of a sequence lives at block `table[p // block_size]`, offset `p % block_size`. Which
blocks a sequence holds is the `BlockManager`'s business; this class only stores the tensors and
plugs into the model's cache protocol, so the model's own `forward` runs a ragged batch:

- the engine describes one step with `begin_batch(...)`: the new tokens of every scheduled sequence
  concatenated into one row [1, sum of T_b] (prefills bring their uncached prompt, decodes one token),
  each token's position in its own sequence and the pool slot its K/V go to;
- the model takes RoPE positions from the step, every layer writes its new K/V through the slot
  mapping (`update`) and attends per sequence through the block tables (`attend`, see `paged_attention`),
  everything else (projections, MLP, norms) runs on the concatenated tokens: selective batching;
- only the last token of each sequence reaches the LM head (`select_last`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..model.kv_cache import CacheStep, KVCache, LayerCache
from .. import _checks
from .paged_attention import PagedLayout


@dataclass(frozen=True, kw_only=True)
class PagedStep(CacheStep):
    """One engine step: B sequences' new tokens run as a single row of sum(T_b) tokens."""

    token_positions: torch.Tensor   # (sum T,) position of each new token in its own sequence
    slot_mapping: torch.Tensor      # (sum T,) pool slot of each new token's K/V
    layout: PagedLayout             # block tables, query rows and mask, shared by every layer
    max_len: int                    # the longest sequence after this step

    def positions(self, device=None) -> torch.Tensor:
        return self.token_positions.to(device)

    @property
    def end(self) -> int:
        """One past the furthest position any sequence reaches (checked against the context length)."""
        return self.max_len

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (1, sum T, D) -> (1, B, D): the last new token of every sequence (its logits are sampled)."""
        return x[:, torch.cumsum(self.layout.query_lens, 0).to(x.device) - 1]


class PagedLayerCache(LayerCache):
    """One layer's key and value pools, (num_blocks, block_size, K, H) each."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device=None,
                 dtype: torch.dtype = torch.float32):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k, v (1, K, sum T, H) at their slots; return the pools (read by `attend`)."""
        if not isinstance(step, PagedStep):
            raise TypeError("a paged layer cache runs inside a step from PagedKVCache.begin_batch")
        slots = step.slot_mapping.to(self.k.device)
        _, _, K, H = self.k.shape
        self.k.view(-1, K, H)[slots] = rearrange(k[0], "K T H -> T K H")
        self.v.view(-1, K, H)[slots] = rearrange(v[0], "K T H -> T K H")
        return self.k, self.v

    def mask(self, step: PagedStep) -> None:
        return None  # `attend` keeps each token inside its own sequence and causal

    def attend(self, q: torch.Tensor, kv, mask, step: PagedStep, scale: float | None = None,
               kernel: str = "reference") -> torch.Tensor:
        """q (1, N, sum T, H) -> (1, N, sum T, H): attention per sequence through its block table."""
        out = step.layout.attend(rearrange(q[0], "N T H -> T N H"), *kv, scale, kernel)
        return rearrange(out, "T N H -> N T H")[None]

    @property
    def spec(self) -> tuple:
        """(K, H, window): what the model checks against its layer's `cache_spec()` (global layers only)."""
        _, _, K, H = self.k.shape
        return (K, H, None)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        _, _, K, H = self.k.shape
        return 2 * K * H * self.k.element_size()


class PagedKVCache:
    """Block pools for every layer of `model` (one object per cross-layer group, like `model.new_cache`)."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype | None = None):
        config = model.config
        if config.attention_type != "gqa" or any(config.layer_window(i) is not None for i in range(config.num_layers)):
            raise ValueError("PagedKVCache supports global GQA/MHA/MQA layers (attention_type='gqa', no "
                             f"sliding_window), got attention_type={config.attention_type!r}, "
                             f"sliding_window={config.sliding_window!r}")
        self.num_blocks = _checks.positive_int("num_blocks", num_blocks)
        self.block_size = _checks.positive_int("block_size", block_size)
        self.layers = []
        for i in range(config.num_layers):
            source = config.kv_source_layer(i)
            self.layers.append(self.layers[source] if source != i else PagedLayerCache(
                num_blocks, block_size, config.num_kv_heads, config.head_dim, device=model.device,
                dtype=dtype or model.dtype))

    @staticmethod
    def bytes_per_token_of(model, dtype: torch.dtype | None = None) -> int:
        """K/V bytes of one token over all layers that own a cache (what a block's slot costs)."""
        c = model.config
        owners = sum(c.kv_source_layer(i) == i for i in range(c.num_layers))
        element = (dtype or model.dtype).itemsize
        return owners * 2 * c.num_kv_heads * c.head_dim * element

    def unique_layers(self) -> list[PagedLayerCache]:
        return list({id(layer): layer for layer in self.layers}.values())

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.unique_layers())

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.unique_layers())

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block src's keys/values into block dst for every (src, dst), in every layer
        (copy-on-write of a shared block; a fork in the contiguous layout copies slot by slot)."""
        if not copies:
            return
        device = self.layers[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for layer in self.unique_layers():
            layer.k[dst] = layer.k[src]
            layer.v[dst] = layer.v[src]

    def batch(self, tables: list[list[int]], context_lens: list[int], query_lens: list[int]) -> "PagedBatch":
        """The cache to pass to the model for one step: sequence b's last query_lens[b] of its
        context_lens[b] tokens are new, its blocks are tables[b]."""
        device = self.layers[0].device
        bs = self.block_size
        positions, slots = [], []
        for table, S, T in zip(tables, context_lens, query_lens):
            for p in range(S - T, S):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        step = PagedStep(start=0, num_new=len(positions), token_positions=torch.tensor(positions, device=device),
                         slot_mapping=torch.tensor(slots, device=device),
                         layout=PagedLayout.build(tables, context_lens, query_lens, bs, device),
                         max_len=max(context_lens))
        return PagedBatch(self.layers, step)


class PagedBatch(KVCache):
    """The model's cache for one engine step: the shared pools plus that step's tables and positions.
    The model sees one sequence of sum(T_b) tokens (batch 1); the step keeps the sequences apart."""

    def __init__(self, layers: list[PagedLayerCache], step: PagedStep):
        super().__init__(layers, max_seq_len=step.end, batch_size=1)
        self.step = step

    def begin(self, num_new: int, pad: torch.Tensor | None = None, start_pos: int | None = None) -> PagedStep:
        if num_new != self.step.num_new or pad is not None or start_pos not in (None, 0):
            raise ValueError(f"this PagedBatch runs exactly its {self.step.num_new} scheduled tokens as one row "
                             f"(no pad, no start_pos), got num_new={num_new}")
        return self.step

    def commit(self, step: CacheStep) -> None:
        """Nothing to advance: each sequence's length lives in its block table."""

    def truncate(self, n: int) -> None:
        raise NotImplementedError("a paged cache rolls back through the block manager, not truncate")


__all__ = ["PagedBatch", "PagedKVCache", "PagedLayerCache", "PagedStep"]
