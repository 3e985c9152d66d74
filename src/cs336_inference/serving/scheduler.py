"""Who runs in the next forward pass: static batching vs continuous (iteration-level) batching.

Both schedulers share the queues, the paged memory and preemption; they differ only in *when*
waiting requests may join:
- `StaticScheduler` (request-level batching, e.g. a plain `generate` over a batch): form a batch from
  whatever has arrived, run it until its longest sequence finishes, only then take the next batch.
  Early finishers leave holes nobody can fill, and late arrivals wait for the whole batch. (Prompts
  still run unpadded, as one concatenated row: only the decode side pays for the batch's shape.)
- `ContinuousScheduler` (Orca, Yu et al. 2022: iteration-level scheduling): before *every* step,
  admit arrived requests while KV blocks and the batch limits allow, so a finished sequence's slot
  is refilled at the very next step.

Each step: (1) make room for one more token of every running sequence, oldest first; when no block
is free, preempt the youngest running sequence (free its blocks; it recomputes later: vLLM's
preemption by recompute); (2) admit waiting sequences (prefills) by the policy; (3) the engine runs
prefills and decodes together in one forward.

The memory is a `BlockManager` (paged) or a `ContiguousManager` (one reserved run per sequence):
the schedulers only ask it `can_allocate` / `allocate` / `append_slot` / `fork` / `free`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .. import _checks
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)   # run token_ids[num_computed:]
    decodes: list[Sequence] = field(default_factory=list)    # run their last token
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        """Tokens this step runs: the uncached part of each prefill plus one per decode."""
        return sum(len(s.token_ids) - s.num_computed for s in self.prefills) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    """Queues + paged memory + preemption; subclasses choose when waiting sequences join."""

    policy = "base"

    def __init__(self, manager, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 watermark_blocks: int | None = None):
        self.manager = manager
        self.max_num_seqs = _checks.positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _checks.positive_int("max_num_batched_tokens", max_num_batched_tokens)
        # blocks kept free at admission so running sequences can grow without preempting at once
        self.watermark_blocks = (max(1, manager.num_blocks // 100) if watermark_blocks is None
                                 else watermark_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last one is preempted first
        self._copies: list[tuple[int, int]] = []  # block copies owed by forks, done before the next step

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (arrival order; its request's arrival_time says when it may run)."""
        if not self.manager.fits_empty(seq.max_len, seq.num_samples, self.watermark_blocks):
            raise ValueError(f"request {seq.request.request_id!r} (prompt {seq.prompt_len} + max_new_tokens "
                             f"{seq.request.max_new_tokens}, n={seq.num_samples}) needs more than the "
                             f"{self.manager.num_blocks} KV blocks of {self.manager.block_size} tokens the "
                             f"engine has ({self.watermark_blocks} kept free)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch(copies=self._copies)
        self._copies = []
        self._reserve_decode_slots(batch)
        if not batch.preempted:  # no admission while memory is short
            self._admit(now, batch)
        return batch

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a sibling sample) shares all of `parent`'s blocks and runs right after it."""
        self._copies.extend(self.manager.fork(parent.seq_id, child.seq_id))
        child.num_computed, child.status = parent.num_computed, SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    # --- the two halves of a step ---------------------------------------------------------------
    def _reserve_decode_slots(self, batch: ScheduledBatch) -> None:
        """A slot for the last sampled token of every running sequence, oldest first; preempt the
        youngest while no block is free."""
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            if seq.status is SequenceStatus.FINISHED:  # a padding row of a static batch
                if self.manager.table(seq.seq_id).num_tokens < seq.max_len:  # within its reservation
                    self.manager.append_slot(seq.seq_id, seq.token_ids[-1])
                    batch.decodes.append(seq)
                continue
            while self.manager.append_needs_block(seq.seq_id) and self.manager.num_free_blocks == 0:
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                copy = self.manager.append_slot(seq.seq_id, seq.token_ids[-1])
                if copy is not None:
                    batch.copies.append(copy)
                batch.decodes.append(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Preemption by recompute: drop the cache; the sequence re-prefills prompt + output later."""
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed = SequenceStatus.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # it arrived before everything still waiting
        batch.preempted.append(seq)

    def _admit(self, now: float, batch: ScheduledBatch) -> None:
        raise NotImplementedError

    def _try_admit(self, seq: Sequence, batch: ScheduledBatch, reserve_blocks: int) -> bool:
        """Allocate `seq` and add it to the batch if the limits and `reserve_blocks` free blocks allow."""
        num_running = sum(s.num_samples for s in self.running)
        if num_running + seq.num_samples > self.max_num_seqs:
            return False
        new_tokens = len(seq.token_ids) - self.manager.num_cached_tokens(seq.token_ids)
        if batch.num_tokens and batch.num_tokens + new_tokens > self.max_num_batched_tokens:
            return False
        if not self.manager.can_allocate(seq.token_ids, seq.max_len, seq.num_samples, reserve_blocks):
            return False
        seq.num_computed = self.manager.allocate(seq.seq_id, seq.token_ids, seq.max_len, seq.num_samples)
        seq.status = SequenceStatus.RUNNING
        self.waiting.popleft()
        self.running.append(seq)
        batch.prefills.append(seq)
        return True


class ContinuousScheduler(Scheduler):
    """Iteration-level scheduling: every step admits arrived requests, first come first served,
    while blocks (plus a small watermark) and the batch limits allow."""

    policy = "continuous"

    def _admit(self, now: float, batch: ScheduledBatch) -> None:
        while self.waiting and self.waiting[0].request.arrival_time <= now:
            if not self._try_admit(self.waiting[0], batch, self.watermark_blocks):
                return


class StaticScheduler(Scheduler):
    """Request-level batching: a new batch only when the previous one has completely finished; a
    batch is what has arrived by then (up to the limits), each reserved for its longest possible
    length so the batch never runs out of memory midway. As in `generate` on a batch, a finished
    sequence keeps its row until the batch's longest one is done: it is computed as padding (its
    tokens discarded) and holds its memory."""

    policy = "static"

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if all(s.status is SequenceStatus.FINISHED for s in self.running):  # the batch is done
            for s in self.running:
                self.manager.free(s.seq_id)
            self.running.clear()

    def _admit(self, now: float, batch: ScheduledBatch) -> None:
        if self.running:
            return  # the batch runs until its longest sequence is done
        reserved = 0
        while self.waiting and self.waiting[0].request.arrival_time <= now:
            seq = self.waiting[0]
            growth = self.manager.growth(seq.token_ids, seq.max_len, seq.num_samples)
            if not self._try_admit(seq, batch, reserved + growth):
                return
            reserved += growth


SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler}

__all__ = ["ContinuousScheduler", "SCHEDULERS", "ScheduledBatch", "Scheduler", "StaticScheduler"]
