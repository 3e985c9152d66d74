"""`PagedKVCache`: the model's keys and values in block pools, read and written through block tables.

Per layer one pool of shape (num_blocks, block_size, K, H) for keys and one for values; token
position p of a sequence lives at block `table[p // block_size]`, offset `p % block_size`. Which
blocks a sequence holds is the block manager's business; this class only stores the tensors and
describes one engine step to the model as a `PagedStep` (the model's `ForwardStep` contract):

- the new tokens of every scheduled sequence run concatenated as one row [1, sum of T_b]
  (prefills bring their uncached prompt, decodes one token), each at its position in its own sequence;
- every layer writes its new K/V at the step's pool slots (`update`) and attends per sequence
  through the block tables (`attend`, see `paged_attention`); everything else (projections, MLP,
  norms) runs on the concatenated tokens: selective batching;
- only the last token of each sequence reaches the LM head (`select_last`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from .. import _checks
from ..model.kv_cache import ForwardStep, KVBuffers, LayerCaches, check_cache_matches_model
from .paged_attention import PagedLayout


@dataclass(eq=False)
class PagedStep(ForwardStep):
    """One engine step: B sequences' new tokens run as a single row of sum(T_b) tokens (batch 1)."""

    positions: torch.Tensor     # (sum T,) position of each new token in its own sequence
    slot_mapping: torch.Tensor  # (sum T,) pool slot of each new token's K/V
    layout: PagedLayout         # block tables, query rows and masks, shared by every layer
    layers: list                # the layer pools (one object per cross-layer group)
    logit_rows: torch.Tensor | None = None   # speculative verification: the rows to keep instead (R,)

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (1, sum T, D) -> (1, B, D): the last new token of every sequence (its logits are sampled);
        with `logit_rows`, (1, R, D): those rows (a decode's last token and all its drafts)."""
        return x[:, self.layout.last_rows if self.logit_rows is None else self.logit_rows]

    def commit(self) -> None:
        """Nothing to stage: `update` wrote only the slots of this step's new tokens, which no sequence
        reads until the scheduler counts them as computed (`num_computed_tokens`)."""


class PagedLayerCache(KVBuffers):
    """One layer's key and value pools, (num_blocks, block_size, K, H) each."""

    HEADS = 2

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device=None,
                 dtype: torch.dtype = torch.float32):
        self.allocate((num_blocks, block_size, num_kv_heads, head_dim), device, dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k, v (1, K, sum T, H) at their slots; return the pools (read by `attend`)."""
        _, _, K, H = self.k.shape
        self.k.view(-1, K, H)[step.slot_mapping] = rearrange(k[0], "K T H -> T K H")
        self.v.view(-1, K, H)[step.slot_mapping] = rearrange(v[0], "K T H -> T K H")
        return self.k, self.v

    def attend(self, q: torch.Tensor, kv, step: PagedStep, scale: float | None = None,
               kernel: str = "reference") -> torch.Tensor:
        """q (1, N, sum T, H) -> (1, N, sum T, H): attention per sequence through its block table."""
        out = step.layout.attend(rearrange(q[0], "N T H -> T N H"), *kv, scale, kernel)
        return rearrange(out, "T N H -> N T H")[None]


class PagedKVCache(LayerCaches):
    """Block pools for every layer of `model` (one object per cross-layer group, like `model.new_cache`)."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype | None = None):
        config = model.config
        if config.mixer != "attention":
            raise ValueError(f"PagedKVCache pages keys and values; mixer={config.mixer!r} layers keep a fixed-size "
                             "state per sequence instead (nothing to page): serve this model with generate()")
        if config.attention_type != "gqa" or any(config.layer_window(i) is not None for i in range(config.num_layers)):
            raise ValueError("PagedKVCache supports global GQA/MHA/MQA layers (attention_type='gqa', no "
                             f"sliding_window), got attention_type={config.attention_type!r}, "
                             f"sliding_window={config.sliding_window!r}")
        check_cache_matches_model(dtype, model.dtype)
        self.context_length = config.context_length
        self.num_blocks = _checks.positive_int("num_blocks", num_blocks)
        self.block_size = _checks.positive_int("block_size", block_size)
        self.layers = []
        for i in range(config.num_layers):
            source = config.kv_source_layer(i)
            self.layers.append(self.layers[source] if source != i else PagedLayerCache(
                num_blocks, block_size, _kv_heads(model, i), config.head_dim, device=model.device,
                dtype=dtype or model.dtype))
        self.device = self.layers[0].device

    @staticmethod
    def bytes_per_token_of(model, dtype: torch.dtype | None = None) -> int:
        """K/V bytes of one token over all layers that own a cache (what a block's slot costs)."""
        c = model.config
        heads = sum(_kv_heads(model, i) for i in range(c.num_layers) if c.kv_source_layer(i) == i)
        element = (dtype or model.dtype).itemsize
        return 2 * heads * c.head_dim * element

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block src's keys/values into block dst for every (src, dst), in every layer
        (copy-on-write of a shared block; a fork in the contiguous layout copies slot by slot)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.unique_layers():
            layer.k[dst] = layer.k[src]
            layer.v[dst] = layer.v[src]

    def step(self, tables: list[list[int]], context_lens: list[int], query_lens: list[int]) -> PagedStep:
        """The model's `ForwardStep` for one engine step (`model(token_ids, step=...)`): sequence b's last
        query_lens[b] of its context_lens[b] tokens are new, its blocks are tables[b]. Everything is
        built from these host lists, so running the step reads nothing back from the device."""
        longest = max(context_lens, default=0)
        if longest > self.context_length:   # host lists: a free check that keeps every position in RoPE's table
            raise ValueError(f"a sequence of {longest} tokens exceeds the model's context_length "
                             f"{self.context_length}: the engine must finish it (max_tokens) before that")
        bs = self.block_size
        positions, slots = [], []
        for table, S, T in zip(tables, context_lens, query_lens):
            for p in range(S - T, S):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        device = self.device
        return PagedStep(positions=torch.tensor(positions, device=device),
                         slot_mapping=torch.tensor(slots, device=device),
                         layout=PagedLayout.build(tables, context_lens, query_lens, bs, device), layers=self.layers)


def _kv_heads(model, i: int) -> int:
    """Layer i's key/value heads: the layer's own count (a tensor-parallel shard holds K/p), else the config's."""
    return getattr(getattr(model.layers[i], "attn", None), "num_kv_heads", model.config.num_kv_heads)


__all__ = ["PagedKVCache", "PagedLayerCache", "PagedStep"]
