"""The engine's configuration and what a run leaves behind: one `StepRecord` per step, one
`RequestRecord` per request (assembled from the step's `RequestOutput` deltas), an `EngineResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _checks
from .metrics import summarize
from .request import Request, RequestOutput, RequestRecord
from .scheduler import SCHEDULERS
from .speculative import SPECULATIVE_METHODS

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
    chunked_prefill: bool = False        # cut a prefill to what the token budget leaves (the rest runs
                                         # in later steps, beside the decodes) instead of waiting
    prefix_caching: bool = True          # share full blocks of common prefixes across requests
    watermark_blocks: int | None = None  # blocks kept free at admission (None: 1% of the pool)
    speculative: str | None = None       # None, "prompt_lookup", "draft" (with Engine(draft_model=...)),
                                         # "medusa" or "eagle" (draft_model= the heads, or the shipped SmolLM2
                                         # ones): drafts verified in the engine's forward (serving/speculative.py)
    num_speculative_tokens: int = 4      # most drafts per sequence and step
    speculative_disable_by_batch_size: int | None = None  # draft nothing in a step where more sequences
                                         # than this decode (vLLM's name): big batches gain little from drafts

    def __post_init__(self):
        _checks.one_of("scheduler", self.scheduler, sorted(SCHEDULERS))
        _checks.one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_budget_bytes"):
            if getattr(self, name) is not None:
                _checks.positive_int(name, getattr(self, name))
        if self.num_blocks is not None and self.kv_budget_bytes is not None:
            raise ValueError("give num_blocks or kv_budget_bytes, not both")
        if self.watermark_blocks is not None:
            _checks.non_negative_int("watermark_blocks", self.watermark_blocks)
        _checks.boolean("chunked_prefill", self.chunked_prefill)
        _checks.boolean("prefix_caching", self.prefix_caching)
        _checks.one_of("speculative", self.speculative, [None, *SPECULATIVE_METHODS])
        _checks.positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.speculative_disable_by_batch_size is not None:
            _checks.positive_int("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size)


@dataclass(kw_only=True)
class StepRecord:
    """One engine step: when it ran and what the batch and the KV memory looked like after it."""

    start: float
    end: float
    num_prefills: int                # sequences running (a chunk of) their prompt
    num_decodes: int
    num_tokens: int
    tokens_per_sequence: list[int]   # prefills (uncached prompt tokens or a chunk) first, then decodes (1 each)
    num_preempted: int
    num_padding: int                 # rows of a static batch that finished but still run (discarded)
    num_running: int
    num_waiting: int                 # arrived, not running
    reserved_tokens: int             # KV slots in blocks held by sequences
    used_tokens: int                 # KV slots holding a token (shared ones once)
    logical_tokens: int              # sum of sequence lengths


@dataclass(kw_only=True)
class EngineResult:
    outputs: list[RequestRecord]        # in the order the requests were given
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


def records_from_outputs(requests: list[Request], outputs: list[RequestOutput]) -> list[RequestRecord]:
    """Fold a run's stream of deltas into one record per request (in the order of `requests`)."""
    records = {r.request_id: RequestRecord(
        request_id=r.request_id, prompt_len=len(r.prompt), arrival_time=r.arrival_time,
        tokens=[[] for _ in range(r.sampling.n)], token_times=[[] for _ in range(r.sampling.n)],
        finish_reasons=[None] * r.sampling.n) for r in requests}
    for out in outputs:
        record = records[out.request_id]
        record.tokens[out.index] += out.new_token_ids
        record.token_times[out.index] += [out.time] * len(out.new_token_ids)
        if out.first_scheduled_time is not None:
            record.first_scheduled_time = out.first_scheduled_time
        if out.index == 0 and out.num_cached_tokens:
            record.cached_prompt_tokens = out.num_cached_tokens
        if out.finished:
            record.finish_reasons[out.index] = out.finish_reason
            record.num_preemptions += out.num_preemptions
            record.error = record.error or out.error
    for record in records.values():
        times = [t[-1] for t in record.token_times if t]
        record.finish_time = max(times) if times else None
    return list(records.values())


__all__ = ["EngineConfig", "EngineResult", "KV_LAYOUTS", "StepRecord", "records_from_outputs"]
