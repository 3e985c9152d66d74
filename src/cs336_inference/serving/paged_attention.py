"""PagedAttention in plain PyTorch: attention whose keys/values are read through block tables.

Each sequence's K/V sit in fixed-size blocks scattered over a shared pool (vLLM, Kwon et al. 2023).
Here the blocks a batch needs are gathered into a padded (B, K, S_max, H) copy and attended with the
model's grouped attention, masked per sequence; a fused GPU kernel reads the blocks in place instead
(no gather), which is the point of the real thing, but the arithmetic is the same.

Ragged batches: sequence b brings T_b new queries (T_b = prompt length for a prefill, 1 for a decode
step) and has S_b keys in total (cached + new). The queries come concatenated, [sum of T_b, N, H]:
attention is the one operation that must be done per sequence, everything else in the model runs on
the concatenated tokens (Orca's selective batching).

Padding is never read as data: the gather also brings slots past S_b (the rest of the last block,
and block 0, which pads shorter tables) that may hold anything, another sequence's keys or even
NaN. They are replaced by zeros with `torch.where` before attention (a mask that multiplies, or adds
-inf to a score, would turn NaN garbage into NaN output).

`PagedLayout` is everything about a batch that does not depend on the layer (which blocks, which
query goes where, the mask); the engine builds it once per step from Python lists, without reading
anything back from the device, and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from einops import rearrange

from ..model.attention import grouped_attention


@dataclass(frozen=True)
class _PaddedGroup:
    """Sequences attended together, padded to the group's longest query run and key run."""

    tables: torch.Tensor        # (b, n): the blocks holding positions 0 .. S_max - 1 of each sequence
    seq: torch.Tensor           # (sum T,) which sequence of the group each query belongs to
    row: torch.Tensor           # (sum T,) its index among that sequence's new tokens
    mask: torch.Tensor          # (b, 1, T_max, S_max) True = may attend
    valid: torch.Tensor         # (b, 1, S_max, 1) True = a key of this sequence (not padding)

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device) -> "_PaddedGroup":
        S_max, T_max = max(context_lens), max(query_lens)
        n = -(-S_max // block_size)
        tables = [list(t[:n]) + [0] * (n - len(t[:n])) for t in block_tables]  # shorter tables: block 0
        # query t of sequence i is row (i, t) of the padded (b, T_max) layout
        seq = [i for i, T in enumerate(query_lens) for _ in range(T)]
        row = [t for T in query_lens for t in range(T)]
        context_lens, query_lens = torch.tensor(context_lens), torch.tensor(query_lens)
        # key j is visible to query t of sequence i iff j <= its position S_i - T_i + t (causal) and
        # j < S_i (a real key); padding rows (t >= T_i) see all real keys and are dropped later
        positions = (context_lens - query_lens)[:, None] + torch.arange(T_max)       # (b, T_max)
        j = torch.arange(S_max)
        real = j[None, :] < context_lens[:, None]                                     # (b, S_max)
        mask = (j[None, None, :] <= positions[:, :, None]) & real[:, None, :]
        return cls(torch.tensor(tables, device=device), torch.tensor(seq, device=device),
                   torch.tensor(row, device=device), mask[:, None].to(device), real[:, None, :, None].to(device))

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale, kernel: str) -> torch.Tensor:
        b, _, T_max, S_max = self.mask.shape
        k = torch.where(self.valid, _gather(k_pool, self.tables, S_max), 0)  # (b, K, S_max, H), padding -> 0
        v = torch.where(self.valid, _gather(v_pool, self.tables, S_max), 0)
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

    last_rows: torch.Tensor     # (B,) the row of each sequence's last query, on the device
    groups: list                # (query rows of the group or None for all, _PaddedGroup)
    block_size: int
    num_queries: int

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int] | None,
              block_size: int, device=None) -> "PagedLayout":
        """Python lists in (what the engine has; `paged_attention` checks a caller's arguments first):
        block_tables B lists of block ids, context_lens S_b, query_lens T_b (None: all 1)."""
        query_lens = [1] * len(context_lens) if query_lens is None else list(query_lens)
        ends = list(accumulate(query_lens))                                  # one past the last query row of each
        decodes = [i for i, T in enumerate(query_lens) if T == 1]
        if len(decodes) in (0, len(query_lens)):   # one kind of sequence: one group of all of them
            groups = [(None, _PaddedGroup.build(block_tables, context_lens, query_lens, block_size, device))]
        else:
            groups = []
            for m in (decodes, [i for i, T in enumerate(query_lens) if T > 1]):
                group = _PaddedGroup.build([block_tables[i] for i in m], [context_lens[i] for i in m],
                                           [query_lens[i] for i in m], block_size, device)
                rows = torch.tensor([r for i in m for r in range(ends[i] - query_lens[i], ends[i])], device=device)
                groups.append((rows, group))
        last_rows = torch.tensor(ends, device=device) - 1
        return cls(last_rows, groups, block_size, ends[-1] if ends else 0)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               scale: float | None = None, kernel: str = "reference") -> torch.Tensor:
        """q (sum T, N, H) over pools (num_blocks, block_size, K, H) -> (sum T, N, H); kernel as in
        `grouped_attention` ("reference" or torch's fused "sdpa"). Shapes are the caller's: `paged_attention`
        checks a user's; the engine's follow from the layout it built (every layer reuses it)."""
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
    block_tables: (B, max blocks) integer tensor or B lists of block ids, logical block i of sequence
      b -> physical block block_tables[b][i] (a table lists a block at most once);
    context_lens (B,): S_b, keys of sequence b (the new tokens' keys already written);
    query_lens (B,): T_b (default: all 1, a decode step);
    kernel: "reference" (hand-written softmax attention) or "sdpa" (torch's fused kernel).
    Returns (sum T_b, N, H).
    """
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or not pool.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float tensor (num_blocks, block_size, K, H), "
                             f"got {getattr(pool, 'shape', type(pool).__name__)}")
    if not isinstance(q, torch.Tensor) or not q.dtype.is_floating_point:
        raise TypeError(f"q must be a float tensor (sum of T, N, H), got {type(q).__name__}")
    context_lens = _int_list("context_lens", context_lens)
    query_lens = [1] * len(context_lens) if query_lens is None else _int_list("query_lens", query_lens)
    tables = _check_tables(block_tables, len(context_lens), k_pool.shape[0])
    _check_lengths(tables, context_lens, query_lens, k_pool.shape[1])
    layout = PagedLayout.build(tables, context_lens, query_lens, k_pool.shape[1], q.device)
    _check_shapes(q, k_pool, v_pool, layout)
    return layout.attend(q, k_pool, v_pool, scale, kernel)


def _gather(pool: torch.Tensor, tables: torch.Tensor, S_max: int) -> torch.Tensor:
    """pool (num_blocks, s, K, H), tables (B, n) -> (B, K, S_max, H): the blocks in table order."""
    blocks = torch.index_select(pool, 0, tables.reshape(-1))  # (B n, s, K, H); faster than pool[tables]
    return rearrange(blocks, "(B n) s K H -> B K (n s) H", B=tables.shape[0])[:, :, :S_max]


def _int_list(name: str, values) -> list[int]:
    """A 1-D integer tensor or a sequence of ints -> list[int] (floats refused, never truncated)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool or values.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got a {values.dim()}-D "
                            f"{values.dtype} tensor")
        return values.tolist()
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(f"{name} must be a list of ints (or a 1-D integer tensor), got {values!r:.80}")
    return list(values)


def _check_tables(block_tables, B: int, num_blocks: int) -> list[list[int]]:
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.dtype.is_floating_point or block_tables.dtype == torch.bool:
            raise TypeError(f"block_tables must be a (B, max blocks) integer tensor or lists of ints, got a "
                            f"{block_tables.dim()}-D {block_tables.dtype} tensor")
        block_tables = block_tables.tolist()
    if not isinstance(block_tables, (list, tuple)) or len(block_tables) != B:
        raise ValueError(f"block_tables must hold one table per sequence ({B}), got {block_tables!r:.80}")
    tables = [_int_list(f"block_tables[{b}]", t) for b, t in enumerate(block_tables)]
    for b, table in enumerate(tables):
        bad = [x for x in table if not 0 <= x < num_blocks]
        if bad:
            raise ValueError(f"block_tables[{b}] holds block ids {bad[:4]} outside the pool's [0, {num_blocks})")
    return tables


def _check_lengths(tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int) -> None:
    B = len(context_lens)
    if B == 0 or len(query_lens) != B:
        raise ValueError(f"context_lens and query_lens must both have B >= 1 entries, got {B} and {len(query_lens)}")
    if any(not 1 <= T <= S for S, T in zip(context_lens, query_lens)):
        raise ValueError(f"need 1 <= query_lens <= context_lens, got query_lens {query_lens}, "
                         f"context_lens {context_lens}")
    for b, (table, S) in enumerate(zip(tables, context_lens)):
        used = table[:-(-S // block_size)]
        if len(used) * block_size < S:
            raise ValueError(f"sequence {b} has {S} keys but its block table maps only {len(table)} blocks "
                             f"of {block_size}")
        if len(set(used)) != len(used):
            raise ValueError(f"block_tables[{b}] lists a block twice ({used}): each position needs its own slot")


def _check_shapes(q, k_pool, v_pool, layout: PagedLayout) -> None:
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape or k_pool.shape[1] != layout.block_size:
        raise ValueError(f"k_pool and v_pool must both be (num_blocks, block_size={layout.block_size}, K, H), "
                         f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    _, _, K, H = k_pool.shape
    if q.dim() != 3 or q.shape[2] != H or q.shape[1] % K != 0 or q.shape[0] != layout.num_queries:
        raise ValueError(f"q must be (sum of T = {layout.num_queries}, N, H={H}) with N a multiple of K={K}, "
                         f"got {tuple(q.shape)}")


__all__ = ["PagedLayout", "paged_attention"]
