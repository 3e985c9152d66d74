"""The reference solution, serving: paged KV memory (the block allocator, paged attention) and one
continuous-batching step.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ... import serving as _serving
from ..registry import graded


@graded("serving")
class BlockAllocator:
    """The physical KV blocks of paged attention (vLLM, Kwon et al. 2023): block ids 0 .. num_blocks - 1 of
    `block_size` token slots each. A block is free, or held by one or more block tables (its reference
    count: more than one when sequences share a prefix or were forked).
    Attribute (or property) `num_free` (int): how many blocks are free.
    """

    def __init__(self, num_blocks: int, block_size: int):
        """All num_blocks blocks free."""
        self._blocks = _serving.BlockAllocator(num_blocks, block_size)

    @property
    def num_free(self) -> int:
        return self._blocks.num_free

    def allocate(self) -> int:
        """The free block that has been free the longest, now held once. When none is free raise a
        RuntimeError and change nothing."""
        return self._blocks.allocate()

    def incref(self, block: int) -> None:
        """One more table holds `block` (which must be in use: a free block raises ValueError)."""
        self._blocks.incref(block)

    def free(self, block: int) -> bool:
        """One holder lets go of `block`; True when that was the last (the block is free again). Freeing a
        block that is already free raises ValueError and changes nothing."""
        return self._blocks.free(block)

    def ref_count(self, block: int) -> int:
        """How many tables hold `block` (0: free)."""
        return self._blocks.ref_count(block)


@graded("serving")
class KVCacheManager:
    """The block tables of many sequences over one pool of num_blocks blocks of block_size token slots
    (vLLM v1's KVCacheManager, nano-vllm's BlockManager; here without prefix caching). Position p of a
    sequence lives in block block_table(seq)[p // block_size]. Blocks come from a `BlockAllocator` (first in,
    first out). Attribute (or property) `num_free_blocks` (int). Every refused call (no free block:
    RuntimeError; an unknown or already present sequence: ValueError) raises before changing anything.
    """

    def __init__(self, num_blocks: int, block_size: int):
        """No sequences; every block free."""
        self._manager = _serving.KVCacheManager(num_blocks, block_size, prefix_caching=False)

    @property
    def num_free_blocks(self) -> int:
        return self._manager.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """A new sequence of num_tokens tokens (a prompt): ceil(num_tokens / block_size) fresh blocks, in
        the order the allocator hands them out. Returns its block table."""
        self._manager.allocate(seq_id, list(range(1, num_tokens + 1)))
        return self.block_table(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        """The physical blocks of seq_id, in position order."""
        return list(self._manager.table(seq_id).blocks)

    def ref_count(self, block: int) -> int:
        """How many block tables hold `block` (0: free)."""
        return self._manager.pool.ref_count(block)

    def append_needs_block(self, seq_id: int) -> bool:
        """Whether the next `append_slot(seq_id)` takes a free block: its last block is full, or shared with
        another table (copy-on-write)."""
        return self._manager.append_needs_block(seq_id)

    def append_slot(self, seq_id: int) -> tuple[int, int] | None:
        """Room for one more token of seq_id. If its last block is full, append a fresh block. Else, if the
        last block is shared (ref count > 1, after `fork`), copy-on-write: take a fresh block, let go of
        the shared one (the other holders keep it unchanged), put the fresh one last in the table and
        return (shared, fresh): the cache must copy that block's data before writing. Otherwise None."""
        copies = self._manager.allocate_slots(seq_id, 1)
        return tuple(copies[0]) if copies else None

    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id starts as a copy of parent_id (parallel sampling, beam search): the same block table,
        every block shared (one more holder each); no data is copied."""
        self._manager.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """seq_id lets go of every block (a block is free when its last holder lets go), last block first."""
        self._manager.free(seq_id)


@graded("serving")
def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: list[list[int]],
                    context_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    """Causal attention of a ragged batch whose keys and values sit in blocks scattered over one pool.

    q: (sum of T_b, N, H), the new tokens' queries, sequence after sequence; sequence b's T_b queries are
    its positions S_b - T_b .. S_b - 1. k_pool, v_pool: (num_blocks, block_size, K, H). block_tables[b]:
    the physical blocks of sequence b, in order: position p lives in block block_tables[b][p // block_size]
    at slot p % block_size. context_lens[b] = S_b (keys of sequence b, its new ones included);
    query_lens[b] = T_b. GQA: query head n reads key/value head n // (N / K). Returns (sum of T_b, N, H):
    each query attends (softmax of q k / sqrt(H)) to its own sequence's positions <= its own.
    """
    return _serving.paged_attention(q, k_pool, v_pool, block_tables, context_lens, query_lens)


@graded("serving")
def continuous_batching_step(running: list[tuple[int, int]], waiting: list[tuple[int, int]], num_blocks: int,
                             block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                             watermark_blocks: int) -> dict[str, list[int] | int]:
    """One step of continuous (iteration-level) batching over paged KV memory (Orca; vLLM), no prefix caching.

    running: (seq_id, num_tokens) of each running sequence in admission order (oldest first); it holds
    ceil(num_tokens / block_size) blocks and this step appends one token to it (a decode), which takes a
    new block when its blocks are full. waiting: (seq_id, num_tokens) in queue order; admitting one takes
    ceil(num_tokens / block_size) blocks (a prefill of all its tokens). The other blocks of the
    num_blocks are free. The step:
    1. decodes, oldest first: if the sequence needs a block and none is free, preempt the youngest running
       sequence not yet given its decode slot (it frees all its blocks and goes back to the front of the
       waiting queue), and repeat; if that youngest one is the sequence itself, it is preempted instead;
    2. if nothing was preempted, admit waiting sequences in order while all of these hold, stopping at
       the first that fails: running + admitted sequences stay <= max_num_seqs; the step's tokens (1 per
       decode + num_tokens per prefill) stay <= max_num_batched_tokens (the first prefill of a step with no
       decodes is always allowed); its blocks + watermark_blocks <= the free blocks.
    Returns {"decodes": seq ids, "prefills": seq ids, "preempted": seq ids in the order preempted,
    "waiting": the queue after the step, "num_free_blocks": free blocks after the step}.
    """
    manager = _serving.KVCacheManager(num_blocks, block_size, prefix_caching=False)
    scheduler = _serving.ContinuousScheduler(manager, max_num_seqs, max_num_batched_tokens, watermark_blocks)

    def sequence(seq_id, num_tokens):
        request = _serving.Request(seq_id, tuple(range(1, num_tokens + 1)), max_new_tokens=1)
        return _serving.Sequence(seq_id, request)
    for seq_id, num_tokens in running:
        seq = sequence(seq_id, num_tokens)
        manager.allocate(seq_id, seq.token_ids)
        seq.num_computed_tokens, seq.status = num_tokens, _serving.SequenceStatus.RUNNING
        seq.token_ids.append(0)  # its last sampled token: this step's decode runs it
        scheduler.running.append(seq)
    for seq_id, num_tokens in waiting:
        scheduler.waiting.append(sequence(seq_id, num_tokens))
    batch = scheduler.schedule(now=0.0)
    return {"decodes": [s.seq_id for s in batch.decodes], "prefills": [s.seq_id for s in batch.prefills],
            "preempted": [s.seq_id for s in batch.preempted], "waiting": [s.seq_id for s in scheduler.waiting],
            "num_free_blocks": manager.num_free_blocks}


@graded("serving")
def continuous_batching_run(requests: list[tuple[int, int]], num_blocks: int, block_size: int, max_num_seqs: int,
                            max_num_batched_tokens: int, watermark_blocks: int) -> list[dict[str, list[int]]]:
    """Serve requests to completion with continuous batching (no model: only who runs in each step).

    requests: (prompt_len, max_new_tokens) of requests 0, 1, ..., all waiting (in that order) at the start.
    Every step is one `continuous_batching_step` (same rules; a running sequence's num_tokens is the
    number of slots its table holds), then every scheduled sequence produces one token: a prefill its
    first output token (its table holds the prompt), a decode the next one (its new slot is for the token
    produced in the step before). A sequence that has produced max_new_tokens tokens is finished right
    after the step: it leaves the running list and frees its blocks. A preempted sequence waits with
    num_tokens = prompt_len + the tokens it produced so far (it recomputes them all when readmitted).
    Each request must fit alone: ceil((prompt_len + max_new_tokens) / block_size) + watermark_blocks <=
    num_blocks (else ValueError). Returns one dict per step, until no sequence waits or runs:
    {"decodes": seq ids, "prefills": seq ids, "preempted": seq ids}, as in `continuous_batching_step`.
    """
    manager = _serving.KVCacheManager(num_blocks, block_size, prefix_caching=False)
    scheduler = _serving.ContinuousScheduler(manager, max_num_seqs, max_num_batched_tokens, watermark_blocks)
    for seq_id, (prompt_len, max_new_tokens) in enumerate(requests):
        request = _serving.Request(seq_id, tuple(range(1, prompt_len + 1)), max_new_tokens=max_new_tokens)
        scheduler.add(_serving.Sequence(seq_id, request))
    steps = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule(now=0.0)
        steps.append({"decodes": [s.seq_id for s in batch.decodes], "prefills": [s.seq_id for s in batch.prefills],
                      "preempted": [s.seq_id for s in batch.preempted]})
        scheduler.postprocess(batch, [[0] * batch.samples_wanted(s) for s in batch.sequences], now=0.0)
    return steps


@graded("serving")
def postprocess_step(sequences: list[dict], num_scheduled_tokens: dict[int, int], sampled: dict[int, int],
                     preempted: list[int]) -> list[dict]:
    """The engine's bookkeeping around one forward (vLLM v1's `num_computed_tokens`): where each sequence
    stands after a step of chunked prefills, decodes and preemptions by recompute.

    sequences: one dict per sequence: {"seq_id": int, "prompt_len": int, "token_ids": list[int] (the prompt,
    then every token generated so far), "num_computed_tokens": int (how many leading token_ids have their
    K/V in the cache), "max_tokens": int (the most tokens it may generate)}.
    preempted: ids the scheduler preempted before this forward: each loses its whole cache
    (num_computed_tokens becomes 0) but keeps its tokens, all of which it recomputes when readmitted
    (prompt and output alike); it ran nothing this step.
    num_scheduled_tokens: seq_id -> how many tokens the forward ran for that sequence, its token_ids from
    position num_computed_tokens on (a prefill chunk, a whole prompt, or 1: the last sampled token of a
    decode); sequences absent from it ran nothing and are unchanged. sampled: seq_id -> the token sampled
    from that sequence's last row (given for every scheduled sequence).
    After the forward a scheduled sequence has computed its scheduled tokens. If none of its token_ids is
    left uncomputed, its sampled token is appended to token_ids (the next step's decode runs it), and it is
    finished once its output (token_ids after the prompt) holds max_tokens tokens; if a prefill chunk left
    part of its tokens uncomputed, the sampled token is discarded (it would follow an unfinished prompt).
    Returns new dicts, in the order of `sequences`, with the same keys plus "finished": bool.
    """
    from ...serving.scheduler import ContinuousScheduler, ScheduledBatch

    block_size = 16
    blocks = sum(-(-(len(s["token_ids"]) + 1) // block_size) for s in sequences) + 1
    manager = _serving.KVCacheManager(blocks, block_size, prefix_caching=False)
    scheduler = ContinuousScheduler(manager, max_num_seqs=len(sequences) + 1, watermark_blocks=0)
    batch = ScheduledBatch()
    built = []
    for s in sequences:
        request = _serving.Request(s["seq_id"], tuple(s["token_ids"][:s["prompt_len"]]), s["max_tokens"])
        seq = _serving.Sequence(s["seq_id"], request, token_ids=list(s["token_ids"]),
                                status=_serving.SequenceStatus.RUNNING, num_computed_tokens=s["num_computed_tokens"])
        manager.allocate(seq.seq_id, seq.token_ids)
        scheduler.running.append(seq)
        built.append(seq)
        if seq.seq_id in num_scheduled_tokens:
            batch.prefills.append(seq)
            batch.num_scheduled_tokens[seq.seq_id] = num_scheduled_tokens[seq.seq_id]
    for seq in built:
        if seq.seq_id in preempted:
            scheduler._preempt(seq, batch)
    rows = [[sampled[seq.seq_id]] if seq.num_computed_tokens + batch.num_scheduled_tokens[seq.seq_id]
            == len(seq.token_ids) else [] for seq in batch.prefills]
    scheduler.postprocess(batch, rows, now=0.0)
    return [{"seq_id": seq.seq_id, "prompt_len": seq.prompt_len, "token_ids": list(seq.token_ids),
             "num_computed_tokens": seq.num_computed_tokens, "max_tokens": seq.request.max_new_tokens,
             "finished": seq.status is _serving.SequenceStatus.FINISHED} for seq in built]
