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

A step is `schedule` -> the model runs the batch -> `postprocess`:
- schedule: (1) make room for one more token of every running sequence, oldest first; when no block
  is free, preempt the youngest running sequence (free its blocks; it recomputes later: vLLM's
  preemption by recompute); (2) continue prefills cut short by the token budget (chunked prefill,
  Sarathi: a long prompt runs in pieces beside the decodes instead of stalling them); (3) admit
  waiting sequences by the policy. Full blocks are named in the prefix cache as soon as their K/V
  are scheduled, so identical prompts admitted in the same step already share them (every layer
  writes the step's K/V before it attends).
- postprocess: advance `num_computed_tokens`, record the sampled tokens, fork the siblings of a
  fresh n > 1 request, retire finished sequences.

The memory is a `KVCacheManager` (paged) or a `ContiguousManager` (one reserved run per sequence):
the schedulers only ask it `can_allocate` / `allocate` / `allocate_slots` / `fork` / `free`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from .. import _checks
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The one batch object of a step: who runs, how many tokens each, which blocks to copy first."""

    prefills: list[Sequence] = field(default_factory=list)   # run num_scheduled_tokens from num_computed_tokens
    decodes: list[Sequence] = field(default_factory=list)    # run their last sampled token
    num_scheduled_tokens: dict[Hashable, int] = field(default_factory=dict)  # seq_id -> tokens this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        """The rows of the forward, in order: prefills, then decodes."""
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        """Tokens this step runs: each prefill's chunk plus one per decode."""
        return sum(self.num_scheduled_tokens.values())

    def samples_wanted(self, seq: Sequence) -> int:
        """Tokens to sample from `seq`'s row: one per sample once its prefill is complete, else none
        (a prefill chunk that leaves part of the prompt, or a finished row of a static batch)."""
        # (seq.num_uncomputed and seq.num_samples, written out: this runs for every row of every step)
        if seq.status is SequenceStatus.FINISHED or \
                len(seq.token_ids) - seq.num_computed_tokens > self.num_scheduled_tokens[seq.seq_id]:
            return 0
        return 1 + len(seq.pending_forks)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    """Queues + paged memory + preemption; subclasses choose when waiting sequences join."""

    policy = "base"

    def __init__(self, manager, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 watermark_blocks: int | None = None, chunked_prefill: bool = False):
        self.manager = manager
        self.max_num_seqs = _checks.positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _checks.positive_int("max_num_batched_tokens", max_num_batched_tokens)
        # blocks kept free at admission so running sequences can grow without preempting at once
        self.watermark_blocks = (max(1, manager.num_blocks // 100) if watermark_blocks is None
                                 else _checks.non_negative_int("watermark_blocks", watermark_blocks))
        self.chunked_prefill = _checks.boolean("chunked_prefill", chunked_prefill)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last one is preempted first
        self._copies: list[tuple[int, int]] = []  # block copies owed by forks, done before the next step

    # --- intake -----------------------------------------------------------------------------------
    def never_fits(self, seq: Sequence) -> str | None:
        """Why `seq` could never be admitted, even into an empty engine (None if it can be)."""
        if seq.num_samples > self.max_num_seqs:
            return f"n={seq.num_samples} samples exceed max_num_seqs={self.max_num_seqs}"
        if not self._fits_empty(seq):
            m = self.manager
            return (f"prompt {seq.prompt_len} + max_tokens {seq.request.sampling.max_tokens} (n={seq.num_samples}) "
                    f"needs more than the {m.num_blocks} KV blocks of {m.block_size} tokens the engine has "
                    f"({self.watermark_blocks} kept free at admission)")
        return None

    def _fits_empty(self, seq: Sequence) -> bool:
        return self.manager.fits_empty(seq.token_ids, seq.max_len, seq.num_samples, self.watermark_blocks)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence by arrival time (its request's arrival_time says when it may run)."""
        reason = self.never_fits(seq)
        if reason is not None:
            raise ValueError(f"request {seq.request.request_id!r} can never run: {reason}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        i = len(self.waiting) - 1
        while i > 0 and self.waiting[i - 1].request.arrival_time > seq.request.arrival_time:
            self.waiting[i - 1], self.waiting[i] = seq, self.waiting[i - 1]
            i -= 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: Hashable) -> list[Sequence]:
        """Drop every unfinished sequence of the request now, freeing its blocks; returns them."""
        dropped = [s for s in list(self.waiting) + self.running
                   if s.request.request_id == request_id and s.status is not SequenceStatus.FINISHED]
        for seq in dropped:
            if seq.status is SequenceStatus.RUNNING:
                self.manager.free(seq.seq_id)
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._release_finished_batch()
        return dropped

    # --- one step: schedule, (the model runs), postprocess ---------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch(copies=self._copies)
        self._copies = []
        partial = self._reserve_decode_slots(batch)
        for seq in partial:  # prefills cut short last step continue, oldest first
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget > 0:
                self._schedule_prefill(seq, min(seq.num_uncomputed, budget), batch)
        if not batch.preempted:  # no admission while memory is short
            self._admit(now, batch)
        return batch

    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int]], now: float) -> list[Sequence]:
        """After the forward: every row's tokens are computed; rows that were sampled (`sampled[i]`
        for row i, `batch.samples_wanted` tokens) take their tokens, a fresh leader first forks its
        siblings (they share all its blocks and take the other tokens), finished sequences leave.
        Returns the sequences that got a token, in row order."""
        got = []
        for seq, tokens in zip(batch.sequences, sampled):
            if seq.status is SequenceStatus.FINISHED:
                continue  # a padding row of a static batch: its token is discarded
            seq.num_computed_tokens += batch.num_scheduled_tokens[seq.seq_id]
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prefill chunk: the rest of the prompt runs next step
            family = [seq]
            if seq.pending_forks:
                family += [self._fork(seq, k + 1, gen) for k, gen in enumerate(seq.pending_forks)]
                seq.pending_forks = []
            for member, token in zip(family, tokens, strict=True):
                got.append(member)
                if member.append(token, now):
                    self.finish(member)
        return got

    def finish(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _fork(self, parent: Sequence, sample_index: int, generator) -> Sequence:
        """A sibling sample that shares all of `parent`'s blocks and runs right after it."""
        child = parent.fork(sample_index, generator)
        self._copies.extend(self.manager.fork(parent.seq_id, child.seq_id))
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def _release_finished_batch(self) -> None:
        """Static batches hold finished rows until the whole batch is done (see StaticScheduler)."""

    # --- the parts of schedule --------------------------------------------------------------------
    def _reserve_decode_slots(self, batch: ScheduledBatch) -> list[Sequence]:
        """A slot for the last sampled token of every running sequence, oldest first; preempt the
        youngest while no block is free. Returns the running prefills that still have prompt left."""
        manager, queue, partial = self.manager, deque(self.running), []
        while queue:
            seq = queue.popleft()
            table = manager.tables[seq.seq_id]   # a running sequence always holds a table
            if seq.status is SequenceStatus.FINISHED:  # a padding row of a static batch
                if table.num_tokens < seq.max_len:  # within its reservation
                    manager.allocate_slots(seq.seq_id)
                    batch.decodes.append(seq)
                    batch.num_scheduled_tokens[seq.seq_id] = 1
                continue
            if table.num_tokens == len(seq.token_ids):  # every slot reserved: a prefill cut short
                partial.append(seq)
                continue
            while manager.append_needs_block(seq.seq_id) and manager.num_free_blocks == 0:
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:  # its slot, and the name of a block its last token fills (one manager call)
                copies = manager.allocate_slots(seq.seq_id, 1, seq.token_ids)
                if copies:
                    batch.copies.extend(copies)
                batch.decodes.append(seq)
                batch.num_scheduled_tokens[seq.seq_id] = 1
        return partial

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Preemption by recompute: drop the cache; the sequence re-prefills prompt + output later."""
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # it arrived before everything still waiting
        batch.preempted.append(seq)

    def _schedule_prefill(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> None:
        batch.prefills.append(seq)
        batch.num_scheduled_tokens[seq.seq_id] = num_tokens
        self.manager.cache_blocks(seq.seq_id, seq.token_ids[:seq.num_computed_tokens + num_tokens])

    def _admit(self, now: float, batch: ScheduledBatch) -> None:
        raise NotImplementedError

    def _try_admit(self, seq: Sequence, batch: ScheduledBatch, reserve_blocks: int) -> bool:
        """Allocate `seq` and add it to the batch if the limits and `reserve_blocks` free blocks allow."""
        num_running = sum(s.num_samples for s in self.running)
        if num_running + seq.num_samples > self.max_num_seqs:
            return False
        new_tokens = len(seq.token_ids) - self.manager.num_cached_tokens(seq.token_ids)
        if self.chunked_prefill:  # take what the budget leaves; the rest runs in later steps
            new_tokens = min(new_tokens, self.max_num_batched_tokens - batch.num_tokens)
            if new_tokens < 1:
                return False
        elif batch.num_tokens and batch.num_tokens + new_tokens > self.max_num_batched_tokens:
            return False
        if not self.manager.can_allocate(seq.token_ids, seq.max_len, seq.num_samples, reserve_blocks):
            return False
        seq.num_computed_tokens = self.manager.allocate(seq.seq_id, seq.token_ids, seq.max_len, seq.num_samples)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.waiting.popleft()
        self.running.append(seq)
        self._schedule_prefill(seq, new_tokens, batch)
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
    length (every sample side by side) so the batch never runs out of memory midway. As in
    `generate` on a batch, a finished sequence keeps its row until the batch's longest one is done:
    it is computed as padding (its tokens discarded) and holds its memory."""

    policy = "static"

    def _fits_empty(self, seq: Sequence) -> bool:
        return self.manager.fits_empty(seq.token_ids, seq.max_len, seq.num_samples, 0, together=True)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self._release_finished_batch()

    def _release_finished_batch(self) -> None:
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
