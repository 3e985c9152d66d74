"""Serving dynamic workloads: paged KV memory, schedulers (static / continuous batching), engine.

Paging (vLLM, Kwon et al. 2023): `BlockAllocator` (free list + reference counts), `BlockTable`,
`BlockManager` (tables of many sequences: prefix sharing, fork, copy-on-write), `PrefixCache`,
`paged_attention`, and the `ContiguousAllocator` baseline with `KVMemoryStats` for both.
Scheduling (Orca, Yu et al. 2022): `Request`, `StaticScheduler`, `ContinuousScheduler`.
Serving: `PagedKVCache` (the model's K/V in block pools), `Engine` (runs a `TransformerLM` on a
request trace, `make_trace`), `summarize` (throughput, TTFT / ITL / queueing percentiles).
"""

from .block_allocator import BlockAllocator, OutOfBlocksError
from .block_manager import BlockManager
from .block_table import BlockTable, blocks_for
from .contiguous_allocator import ContiguousAllocator
from .contiguous_manager import ContiguousManager
from .engine import Engine, EngineConfig, EngineResult, StepRecord
from .memory_stats import KVMemoryStats
from .metrics import RequestMetrics, benchmark_metrics, distribution, request_metrics, summarize
from .paged_attention import paged_attention
from .paged_kv_cache import PagedKVCache, PagedLayerCache, PagedStep
from .prefix_cache import PrefixCache, chained_block_hash
from .request import Request, RequestOutput, SamplingParams
from .scheduler import ContinuousScheduler, ScheduledBatch, Scheduler, StaticScheduler
from .sequence import Sequence, SequenceStatus
from .trace import TraceConfig, make_chat_trace, make_trace, poisson_arrivals

__all__ = [
    "BlockAllocator", "BlockManager", "BlockTable", "ContiguousAllocator", "ContiguousManager",
    "ContinuousScheduler", "Engine", "EngineConfig", "EngineResult", "KVMemoryStats", "OutOfBlocksError",
    "PagedKVCache", "PagedLayerCache", "PagedStep", "PrefixCache", "Request", "RequestMetrics",
    "RequestOutput",
    "SamplingParams", "ScheduledBatch", "Scheduler", "Sequence", "SequenceStatus", "StaticScheduler",
    "StepRecord", "TraceConfig", "benchmark_metrics", "blocks_for", "distribution",
    "chained_block_hash", "make_chat_trace", "make_trace", "paged_attention",
    "poisson_arrivals", "request_metrics", "summarize",
]
