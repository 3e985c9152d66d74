"""PagedAttention in plain PyTorch: attention whose keys/values are read through block tables.

Each sequence's K/V sit in fixed-size blocks scattered over a shared pool (vLLM, Kwon et al. 2023).
Here the blocks a batch needs are gathered into a padded (B, K, S_max, H) copy and attended with the
model's grouped attention, masked per sequence; a fused GPU kernel reads the blocks in place instead
(no gather), which is the point of the real thing, but the arithmetic is the same.

Ragged batches: sequence b brings T_b new queries (T_b = prompt length for a prefill, 1 for a decode
step) and has S_b keys in total (cached + new). The queries come concatenated, [sum of T_b, N, H]:
attention is the one operation that must be done per sequence, everything else in the model runs on
the concatenated tokens (Orca's selective batching).

`PagedLayout` is everything about a batch that does not depend on the layer (which blocks, which
query goes where, the mask); the engine builds it once per step and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..model.attention import grouped_attention


def padded_block_tables(block_tables, device=None) -> torch.Tensor:
    """list of per-sequence block id lists -> (B, max blocks) long tensor, padded with block 0."""
    if isinstance(block_tables, torch.Tensor):
        return block_tables.to(device=device, dtype=torch.long)
    width = max(len(t) for t in block_tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)


@dataclass(frozen=True)
class _PaddedGroup:
    """Sequences attended together, padded to the group's longest query run and key run."""

    tables: torch.Tensor        # (b, n): the blocks holding positions 0 .. S_max - 1 of each sequence
    seq: torch.Tensor           # (sum T,) which sequence of the group each query belongs to
    row: torch.Tensor           # (sum T,) its index among that sequence's new tokens
    mask: torch.Tensor          # (b, 1, T_max, S_max) True = may attend

    @classmethod
    def build(cls, tables: torch.Tensor, context_lens: list[int], query_lens: list[int], block_size: int,
              device) -> "_PaddedGroup":
        """From host data (the lengths as lists of ints): building reads nothing back from the device."""
        S_max, T_max = max(context_lens), max(query_lens)
        context_lens, query_lens = torch.tensor(context_lens), torch.tensor(query_lens)
        b = context_lens.shape[0]
        # query t of sequence i is row (i, t) of the padded (b, T_max) layout
        seq = torch.repeat_interleave(torch.arange(b), query_lens)                   # (sum T,)
        row = torch.arange(seq.shape[0]) - (torch.cumsum(query_lens, 0) - query_lens)[seq]
        # key j is visible to query t of sequence i iff j <= its position S_i - T_i + t (causal) and
        # j < S_i (a real key); padding rows (t >= T_i) see all real keys and are dropped later
        positions = (context_lens - query_lens)[:, None] + torch.arange(T_max)       # (b, T_max)
        j = torch.arange(S_max)
        mask = (j[None, None, :] <= positions[:, :, None]) & (j[None, None, :] < context_lens[:, None, None])
        return cls(tables[:, :-(-S_max // block_size)].to(device), seq.to(device), row.to(device),
                   mask[:, None].to(device))

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale, kernel: str) -> torch.Tensor:
        b, _, T_max, S_max = self.mask.shape
        k, v = _gather(k_pool, self.tables, S_max), _gather(v_pool, self.tables, S_max)  # (b, K, S_max, H)
        if T_max == 1:  # decodes: one query per sequence, nothing to scatter
            out = grouped_attention(rearrange(q, "b N H -> b N 1 H"), k, v, self.mask, scale, kernel=kernel)
            return rearrange(out, "b N 1 H -> b N H")
        q_pad = q.new_zeros(b, T_max, *q.shape[1:])
        q_pad[self.seq, self.row] = q
        out = grouped_attention(rearrange(q_pad, "b T N H -> b N T H"), k, v, self.mask, scale, kernel=kernel)
        return rearrange(out, "b N T H -> b T N H")[self.seq, self.row]


@dataclass(frozen=True)
class PagedLayout:
    """Where the queries and keys of a ragged batch of B sequences live.

    Decodes (one query) and prefills (many) are attended in separate groups, as vLLM does: padding
    one decode's single query to a 100-token prompt would multiply its attention work by 100.
    """

    query_lens: torch.Tensor    # (B,) T_b, on the CPU
    groups: list                # (query rows of the group or None for all, _PaddedGroup)
    block_size: int
    num_queries: int

    @classmethod
    def build(cls, block_tables, context_lens, query_lens, block_size: int, device=None) -> "PagedLayout":
        """block_tables: (B, n) tensor or B lists of block ids; context_lens (B,) S_b; query_lens (B,) T_b
        (lists of ints or tensors; the work is done on host lists, so nothing waits for a device)."""
        context_lens = [int(n) for n in (context_lens.tolist() if isinstance(context_lens, torch.Tensor)
                                         else context_lens)]
        B = len(context_lens)
        query_lens = ([1] * B if query_lens is None else
                      [int(n) for n in (query_lens.tolist() if isinstance(query_lens, torch.Tensor) else query_lens)])
        _check_lengths(block_tables, context_lens, query_lens, block_size)
        tables = padded_block_tables(block_tables)                                  # (B, n), CPU
        members = [[i for i in range(B) if query_lens[i] == 1], [i for i in range(B) if query_lens[i] > 1]]
        members = [m for m in members if m]
        starts = [sum(query_lens[:i]) for i in range(B)]                           # first query row of each
        groups = []
        for m in members:
            group = _PaddedGroup.build(tables[m], [context_lens[i] for i in m], [query_lens[i] for i in m],
                                       block_size, device)
            rows = None if len(members) == 1 else torch.tensor(
                [r for i in m for r in range(starts[i], starts[i] + query_lens[i])], device=device)
            groups.append((rows, group))
        return cls(torch.tensor(query_lens), groups, block_size, sum(query_lens))

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
        """q (sum T, N, H) over pools (num_blocks, block_size, K, H) -> (sum T, N, H); kernel as in
        `grouped_attention` ("reference" or torch's fused "sdpa")."""
        _check_shapes(q, k_pool, v_pool, self)
        if len(self.groups) == 1:
            return self.groups[0][1].attend(q, k_pool, v_pool, scale, kernel)
        out = torch.empty_like(q)
        for rows, group in self.groups:
            out[rows] = group.attend(q[rows], k_pool, v_pool, scale, kernel)
        return out


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables, context_lens,
                    query_lens=None, scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
    """Causal attention of new queries over K/V stored in blocks.

    q (sum T_b, N, H): the new tokens' queries, sequence after sequence (positions S_b - T_b .. S_b - 1);
    k_pool, v_pool (num_blocks, block_size, K, H): the layer's pool;
    block_tables: (B, max blocks) tensor or list of block-id lists, logical block i of sequence b
      -> physical block block_tables[b][i];
    context_lens (B,): S_b, keys of sequence b (the new tokens' keys already written);
    query_lens (B,): T_b (default: all 1, a decode step);
    kernel: "reference" (hand-written softmax attention) or "sdpa" (torch's fused kernel).
    Returns (sum T_b, N, H).
    """
    if not isinstance(k_pool, torch.Tensor) or k_pool.dim() != 4:
        raise ValueError(f"k_pool must be (num_blocks, block_size, K, H), got {getattr(k_pool, 'shape', k_pool)}")
    layout = PagedLayout.build(block_tables, context_lens, query_lens, k_pool.shape[1], q.device)
    return layout.attend(q, k_pool, v_pool, scale, kernel)


def _gather(pool: torch.Tensor, tables: torch.Tensor, S_max: int) -> torch.Tensor:
    """pool (num_blocks, s, K, H), tables (B, n) -> (B, K, S_max, H): the blocks in table order."""
    blocks = torch.index_select(pool, 0, tables.reshape(-1))  # (B n, s, K, H); faster than pool[tables]
    return rearrange(blocks, "(B n) s K H -> B K (n s) H", B=tables.shape[0])[:, :, :S_max]


def _check_lengths(block_tables, context_lens: list[int], query_lens: list[int], block_size) -> None:
    B = len(context_lens)
    if B == 0 or len(query_lens) != B:
        raise ValueError(f"context_lens and query_lens must both be (B,) with B >= 1, got {B} and "
                         f"{len(query_lens)} lengths")
    if any(not 1 <= t <= s for s, t in zip(context_lens, query_lens)):
        raise ValueError(f"need 1 <= query_lens <= context_lens, got query_lens {query_lens}, "
                         f"context_lens {context_lens}")
    lengths = ([len(t) for t in block_tables] if not isinstance(block_tables, torch.Tensor)
               else [block_tables.shape[1]] * block_tables.shape[0])
    if len(lengths) != B:
        raise ValueError(f"block_tables has {len(lengths)} sequences, context_lens {B}")
    for b, (n, s) in enumerate(zip(lengths, context_lens)):
        if n * block_size < s:
            raise ValueError(f"sequence {b} has {s} keys but its block table maps only {n} blocks "
                             f"of {block_size}")


def _check_shapes(q, k_pool, v_pool, layout: PagedLayout) -> None:
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape or k_pool.shape[1] != layout.block_size:
        raise ValueError(f"k_pool and v_pool must both be (num_blocks, block_size={layout.block_size}, K, H), "
                         f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    _, _, K, H = k_pool.shape
    if q.dim() != 3 or q.shape[2] != H or q.shape[1] % K != 0 or q.shape[0] != layout.num_queries:
        raise ValueError(f"q must be (sum of T = {layout.num_queries}, N, H={H}) with N a multiple of K={K}, "
                         f"got {tuple(q.shape)}")


__all__ = ["PagedLayout", "paged_attention", "padded_block_tables"]
