"""`Engine`: serve a request trace with a `TransformerLM`, a scheduler and a paged KV cache.

One step of the loop: the scheduler picks the batch (admissions = prefills, running = decodes,
preemptions), the model runner applies copy-on-write copies and runs every scheduled token in one
forward (selective batching), and the engine samples one token per sequence, forks the extra samples
of a fresh n > 1 request, retires finished sequences and records the time.

The clock: the trace's arrival times are seconds from its start. The engine's clock advances by the
measured wall time of each step (scheduling, forward and sampling included), and when nothing can
run it jumps to the next arrival instead of sleeping. So every latency is real compute time, and a
trace with idle gaps replays without waiting through them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..generation.sampling import sample_next_token
from .. import _checks
from .block_manager import BlockManager
from .contiguous_manager import ContiguousManager
from .metrics import summarize
from .model_runner import ModelRunner
from .request import Request, RequestOutput
from .scheduler import SCHEDULERS, ScheduledBatch
from .sequence import Sequence, SequenceStatus


KV_LAYOUTS = ("paged", "contiguous")


@dataclass
class EngineConfig:
    scheduler: str = "continuous"        # "continuous" (iteration-level) or "static" (request-level)
    kv_layout: str = "paged"             # "paged" (blocks on demand) or "contiguous" (reserve prompt +
                                         # max_new_tokens per sequence; the same bytes, for comparison)
    block_size: int = 16                 # tokens per KV block
    num_blocks: int | None = None        # KV pool size; None: from kv_budget_bytes, else room for
                                         # max_num_seqs sequences of min(context_length, 2048) tokens
    kv_budget_bytes: int | None = None   # alternative to num_blocks: the pool's size in bytes
    max_num_seqs: int = 32               # sequences running at once
    max_num_batched_tokens: int = 2048   # tokens per forward (limits how many prefills join a step)
    prefix_caching: bool = True          # share full blocks of common prefixes across requests
    watermark_blocks: int | None = None  # blocks kept free at admission (None: 1% of the pool)

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {self.scheduler!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _checks.positive_int(name, getattr(self, name))
        if self.num_blocks is not None:
            _checks.positive_int("num_blocks", self.num_blocks)
        if self.num_blocks is not None and self.kv_budget_bytes is not None:
            raise ValueError("give num_blocks or kv_budget_bytes, not both")


@dataclass
class StepRecord:
    """One engine step: when it ran and what the batch and the KV memory looked like after it."""

    start: float
    end: float
    num_prefills: int
    num_decodes: int
    num_tokens: int
    tokens_per_sequence: list[int]   # prefills (uncached prompt tokens) first, then decodes (1 each)
    num_preempted: int
    num_padding: int            # rows of a static batch that finished but still run (discarded)
    num_running: int
    num_waiting: int            # arrived, not running
    reserved_tokens: int        # KV slots in blocks held by sequences
    used_tokens: int            # KV slots holding a token (shared ones once)
    logical_tokens: int         # sum of sequence lengths


@dataclass
class EngineResult:
    outputs: list[RequestOutput]        # in the order the requests were given
    steps: list[StepRecord]
    config: EngineConfig
    num_blocks: int
    capacity_tokens: int                # KV slots in the pool
    bytes_per_token: int                # KV bytes per token over all layers
    free_blocks_at_end: int             # all of them, unless a sequence leaked its blocks
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Latency/throughput (see `summarize`) plus the KV memory over the run, each step weighted
        by its duration: waste = unused share of the reserved slots, sharing = logical tokens that
        did not need their own slot (prefix caching, forks)."""
        s = summarize(self.outputs)
        steps = self.steps
        dt = [r.end - r.start for r in steps]
        reserved = sum(r.reserved_tokens * d for r, d in zip(steps, dt))
        used = sum(r.used_tokens * d for r, d in zip(steps, dt))
        logical = sum(r.logical_tokens * d for r, d in zip(steps, dt))
        s.update(steps=len(steps), max_running=max((r.num_running for r in steps), default=0),
                 peak_reserved_bytes=max((r.reserved_tokens for r in steps), default=0) * self.bytes_per_token,
                 kv_waste_fraction=1 - used / reserved if reserved else 0.0,
                 kv_reserved_fraction_of_pool=reserved / (sum(dt) * self.capacity_tokens) if steps else 0.0,
                 kv_shared_fraction=1 - used / logical if logical else 0.0)
        return s


class Engine:
    """Serve requests with `model`. `Engine(model, scheduler="static")` overrides EngineConfig fields."""

    def __init__(self, model, config: EngineConfig | None = None, **overrides):
        self.model = model
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        c = self.config
        self.runner = ModelRunner.for_model(model, c.block_size, num_blocks=c.num_blocks,
                                            kv_budget_bytes=c.kv_budget_bytes,
                                            default_tokens=c.max_num_seqs * min(model.config.context_length, 2048))
        if c.kv_layout == "contiguous":  # the same token slots, one slot per "block"
            self.runner = ModelRunner(model, self.runner.num_blocks * c.block_size, block_size=1)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def new_manager(self):
        """Empty KV memory for one run: paged blocks, or contiguous runs of token slots."""
        c = self.config
        if c.kv_layout == "contiguous":
            return ContiguousManager(self.num_blocks)
        return BlockManager(self.num_blocks, c.block_size, prefix_caching=c.prefix_caching)

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> EngineResult:
        """Serve every request of the trace to completion; per-request outputs, times and step records."""
        c = self.config
        requests = list(requests)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        context = self.model.config.context_length
        for r in requests:
            if len(r.prompt) + r.max_new_tokens > context:
                raise ValueError(f"request {r.request_id!r}: prompt ({len(r.prompt)}) + max_new_tokens "
                                 f"({r.max_new_tokens}) exceeds the model's context_length ({context})")
            if max(r.prompt) >= self.model.config.vocab_size:
                raise ValueError(f"request {r.request_id!r}: token ids must be < vocab_size "
                                 f"{self.model.config.vocab_size}")
        manager = self.new_manager()
        scheduler = SCHEDULERS[c.scheduler](manager, c.max_num_seqs, c.max_num_batched_tokens, c.watermark_blocks)
        run = _Run(requests)
        for request in sorted(requests, key=lambda r: r.arrival_time):
            scheduler.add(run.new_sequence(request, 0, num_forks=request.sampling.n - 1))

        now, steps = 0.0, []
        while scheduler.has_unfinished():
            t0 = time.perf_counter()
            batch = scheduler.schedule(now)
            if not batch:
                head = scheduler.waiting[0]
                if head.request.arrival_time <= now and not scheduler.running:
                    raise RuntimeError(f"request {head.request.request_id!r} can never be admitted: the KV "
                                       f"pool of {self.num_blocks} blocks cannot hold what it needs")
                now = max(now, head.request.arrival_time)  # idle: jump to the next arrival
                continue
            for seq in batch.prefills:
                run.scheduled(seq, now)
            tokens_per_sequence = ([len(s.token_ids) - s.num_computed for s in batch.prefills]
                                   + [1] * len(batch.decodes))
            padding = sum(s.status is SequenceStatus.FINISHED for s in batch.decodes)
            logits = self.runner.execute(batch, manager)             # (len(batch.sequences), V)
            tokens = self._sample(logits, batch, scheduler, run)
            elapsed = time.perf_counter() - t0
            start, now = now, now + elapsed
            for seq, token in tokens:
                if seq.append(token, now):
                    scheduler.finish(seq)
            stats = manager.memory_stats()
            steps.append(StepRecord(
                start, now, len(batch.prefills), len(batch.decodes), sum(tokens_per_sequence), tokens_per_sequence,
                len(batch.preempted), padding, len(scheduler.running),
                sum(s.request.arrival_time <= now for s in scheduler.waiting),
                stats.reserved_tokens, stats.used_tokens, stats.logical_tokens))
        return EngineResult([run.output(r) for r in requests], steps, c, self.num_blocks,
                            manager.memory_stats().capacity_tokens, self.runner.bytes_per_token,
                            manager.num_free_blocks)

    def _sample(self, logits: torch.Tensor, batch: ScheduledBatch, scheduler, run) -> list[tuple[Sequence, int]]:
        """One token per sequence (and per new sibling of a fresh n > 1 request), greedy rows batched."""
        greedy = logits.argmax(-1).tolist()  # waits for the device: the tokens really exist now
        out = []
        for i, seq in enumerate(batch.sequences):
            if seq.status is SequenceStatus.FINISHED:
                continue  # a padding row of a static batch: its token is discarded
            seq.num_computed = len(seq.token_ids)
            scheduler.manager.cache_full_blocks(seq.seq_id, seq.num_computed)
            family = [seq]
            for k in range(seq.num_forks_pending):  # the prompt is in the cache: siblings share it
                child = run.new_sequence(seq.request, k + 1)
                scheduler.fork(seq, child)
                family.append(child)
            seq.num_forks_pending = 0
            for member in family:
                p = member.request.sampling
                if p.temperature == 0:
                    out.append((member, greedy[i]))
                else:
                    token = sample_next_token(logits[i], p.temperature, p.top_k, p.top_p, member.generator)
                    out.append((member, int(token)))
        return out


class _Run:
    """Bookkeeping of one `Engine.run`: the sequences of each request and their times."""

    def __init__(self, requests: list[Request]):
        self.sequences: dict = {r.request_id: [] for r in requests}
        self.first_scheduled: dict = {}
        self.cached_tokens: dict = {r.request_id: 0 for r in requests}
        self._next_id = 0

    def new_sequence(self, request: Request, sample_index: int, num_forks: int = 0) -> Sequence:
        p = request.sampling
        generator = None
        if p.temperature > 0 and p.seed is not None:
            generator = torch.Generator().manual_seed(p.seed + sample_index)
        seq = Sequence(self._next_id, request, sample_index, num_forks_pending=num_forks, generator=generator)
        self._next_id += 1
        self.sequences[request.request_id].append(seq)
        return seq

    def scheduled(self, seq: Sequence, now: float) -> None:
        rid = seq.request.request_id
        self.first_scheduled.setdefault(rid, now)
        if seq.num_preemptions == 0 and seq.sample_index == 0:
            self.cached_tokens[rid] = seq.num_computed  # prompt tokens taken from the prefix cache

    def output(self, request: Request) -> RequestOutput:
        seqs = sorted(self.sequences[request.request_id], key=lambda s: s.sample_index)
        return RequestOutput(
            request.request_id, len(request.prompt), request.arrival_time,
            tokens=[s.output for s in seqs], token_times=[list(s.token_times) for s in seqs],
            finish_reasons=[s.finish_reason for s in seqs],
            first_scheduled_time=self.first_scheduled.get(request.request_id),
            finish_time=max(s.token_times[-1] for s in seqs),
            cached_prompt_tokens=self.cached_tokens[request.request_id],
            num_preemptions=sum(s.num_preemptions for s in seqs))


__all__ = ["Engine", "EngineConfig", "EngineResult", "StepRecord"]
