"""PagedAttention in plain PyTorch: attention whose keys/values are read through block tables.

Each sequence's K/V sit in fixed-size blocks scattered over a shared pool (vLLM, Kwon et al. 2023).
Here the blocks a batch needs are gathered into a padded (B, K, S_max, H) view and attended with the
model's grouped attention, masked per sequence; a fused GPU kernel reads the blocks in place instead
(no gather), which is the point of the real thing, but the arithmetic is the same.

Ragged batches: sequence b brings T_b new queries (T_b = prompt length for a prefill, 1 for a decode
step) and has S_b keys in total (cached + new). The queries come concatenated, [sum of T_b, N, H]:
attention is the one operation that must be done per sequence, everything else in the model runs on
the concatenated tokens (Orca's selective batching).
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..model.attention import grouped_attention


def padded_block_tables(block_tables, device=None) -> torch.Tensor:
    """list of per-sequence block id lists -> (B, max blocks) long tensor, padded with block 0."""
    if isinstance(block_tables, torch.Tensor):
        return block_tables.to(device=device, dtype=torch.long)
    width = max(len(t) for t in block_tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables,
                    context_lens, query_lens=None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of new queries over K/V stored in blocks.

    q (sum T_b, N, H): the new tokens' queries, sequence after sequence (positions S_b - T_b .. S_b - 1);
    k_pool, v_pool (num_blocks, block_size, K, H): the layer's pool;
    block_tables: (B, max blocks) tensor or list of block-id lists, logical block i of sequence b
      -> physical block block_tables[b][i];
    context_lens (B,): S_b, keys of sequence b (the new tokens' keys already written);
    query_lens (B,): T_b (default: all 1, a decode step).
    Returns (sum T_b, N, H).
    """
    num_blocks, block_size, K, H = k_pool.shape
    context_lens = torch.as_tensor(context_lens, dtype=torch.long)
    B = context_lens.shape[0]
    query_lens = torch.ones(B, dtype=torch.long) if query_lens is None else torch.as_tensor(query_lens, dtype=torch.long)
    _check(q, k_pool, v_pool, block_tables, context_lens, query_lens)
    device = q.device
    tables = padded_block_tables(block_tables, device)                          # (B, max blocks)
    S_max, T_max = int(context_lens.max()), int(query_lens.max())
    tables = tables[:, :-(-S_max // block_size)]                                # the blocks in use

    # gather every sequence's blocks into one padded view: (B, K, S_max, H)
    k = rearrange(k_pool[tables], "B n s K H -> B K (n s) H")[:, :, :S_max]
    v = rearrange(v_pool[tables], "B n s K H -> B K (n s) H")[:, :, :S_max]

    # scatter the concatenated queries into (B, N, T_max, H): query t of sequence b is row (b, t)
    seq = torch.repeat_interleave(torch.arange(B, device=device), query_lens.to(device))  # (sum T,)
    starts = torch.cumsum(query_lens, 0) - query_lens
    row = torch.arange(q.shape[0], device=device) - starts.to(device)[seq]
    q_pad = q.new_zeros(B, T_max, *q.shape[1:])
    q_pad[seq, row] = q
    q_pad = rearrange(q_pad, "B T N H -> B N T H")

    # key j is visible to query t of sequence b iff j <= its position S_b - T_b + t (causal) and
    # j < S_b (a real key); padding rows (t >= T_b) see all real keys and are dropped below
    positions = (context_lens - query_lens).to(device)[:, None] + torch.arange(T_max, device=device)  # (B, T)
    j = torch.arange(S_max, device=device)
    mask = (j[None, None, :] <= positions[:, :, None]) & (j[None, None, :] < context_lens.to(device)[:, None, None])
    out = grouped_attention(q_pad, k, v, mask[:, None], scale)                  # (B, N, T_max, H)
    return rearrange(out, "B N T H -> B T N H")[seq, row]


def _check(q, k_pool, v_pool, block_tables, context_lens, query_lens) -> None:
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be (num_blocks, block_size, K, H), got "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    num_blocks, block_size, K, H = k_pool.shape
    if q.dim() != 3 or q.shape[2] != H or q.shape[1] % K != 0:
        raise ValueError(f"q must be (sum of T, N, H={H}) with N a multiple of K={K}, got {tuple(q.shape)}")
    B = context_lens.shape[0]
    if context_lens.dim() != 1 or query_lens.shape != (B,):
        raise ValueError(f"context_lens and query_lens must both be (B,), got {tuple(context_lens.shape)} "
                         f"and {tuple(query_lens.shape)}")
    if int(query_lens.min()) < 1 or bool((query_lens > context_lens).any()):
        raise ValueError(f"need 1 <= query_lens <= context_lens, got query_lens {query_lens.tolist()}, "
                         f"context_lens {context_lens.tolist()}")
    if int(query_lens.sum()) != q.shape[0]:
        raise ValueError(f"q holds {q.shape[0]} queries but query_lens sum to {int(query_lens.sum())}")
    lengths = ([len(t) for t in block_tables] if not isinstance(block_tables, torch.Tensor)
               else [block_tables.shape[1]] * block_tables.shape[0])
    if len(lengths) != B:
        raise ValueError(f"block_tables has {len(lengths)} sequences, context_lens {B}")
    for b, (n, s) in enumerate(zip(lengths, context_lens.tolist())):
        if n * block_size < s:
            raise ValueError(f"sequence {b} has {s} keys but its block table maps only {n} blocks "
                             f"of {block_size}")


__all__ = ["paged_attention", "padded_block_tables"]
