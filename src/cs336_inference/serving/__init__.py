"""Serving dynamic workloads: paged KV memory, schedulers (static / continuous batching), an online engine.

Paging (vLLM, Kwon et al. 2023): one `BlockPool` (free queue, reference counts, the prefix hash map
naming full blocks; `BlockAllocator` is its old name) under `KVCacheManager` (the `BlockTable`s of many
sequences: prefix sharing, fork, copy-on-write; the one place paging checks its inputs),
`paged_attention`, and the `ContiguousAllocator` baseline (`ContiguousManager`) with `KVMemoryStats` for both.
Scheduling (Orca, Yu et al. 2022; chunked prefill, Sarathi): `Request`, `StaticScheduler`,
`ContinuousScheduler`, one `ScheduledBatch` per step.
Serving: `PagedKVCache` (the model's K/V in block pools), `Engine` (online: `add_request`, `step`,
`abort`; `run` replays a trace from `make_trace`; `ChatSession`s share one engine through
`RequestStreams`), `RequestOutput` (a step's deltas),
`RequestRecord` and `summarize` / `benchmark_metrics` (throughput, TTFT / ITL / queueing percentiles);
`Workload` (a named trace and batch limit: an operating point) and `serve_one_at_a_time` (the
one-sequence baseline, plain or speculative).
Speculative decoding inside the engine (`serving.speculative`): `Engine(model, speculative="prompt_lookup")`
(or "draft" with draft_model=, "medusa" / "eagle" with the heads or the shipped SmolLM2 ones:
`serving.feature_proposers`, or proposer= any `Proposer`) verifies every running sequence's drafts in
the step's one forward and rolls the rejected ones back (`KVCacheManager.truncate`).
Online: `AsyncEngine` (asyncio streams per request over one engine thread); the OpenAI-compatible
HTTP server in `serving.http` (the `[serve]` extra) and its streaming client in `serving.client`.
"""

from ..generation.sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .block_pool import BlockAllocator, BlockPool, OutOfBlocksError, chained_block_hash
from .chat import ChatSession, RequestStreams
from .contiguous_allocator import ContiguousAllocator
from .contiguous_manager import ContiguousManager
from .engine import Engine
from .engine_records import EngineConfig, EngineResult, StepRecord
from .kv_cache_manager import BlockTable, KVCacheManager, blocks_for
from .memory_stats import KVMemoryStats
from .metrics import RequestMetrics, benchmark_metrics, distribution, flat_metrics, request_metrics, summarize
from .paged_attention import paged_attention
from .paged_kv_cache import PagedKVCache, PagedLayerCache, PagedStep
from .one_at_a_time import serve_one_at_a_time
from .request import Request, RequestOutput, RequestRecord
from .scheduler import ContinuousScheduler, ScheduledBatch, Scheduler, StaticScheduler
from .sequence import Sequence, SequenceStatus
from .feature_proposers import EagleProposer, MedusaProposer
from .speculative import DraftModelProposer, PromptLookupProposer, Proposer, TargetFeatures
from .trace import TraceConfig, make_chat_trace, make_trace, poisson_arrivals
from .workload import Workload

__all__ = [
    "AsyncEngine", "BlockAllocator", "BlockPool", "BlockTable", "ChatSession", "ContiguousAllocator",
    "ContiguousManager",
    "ContinuousScheduler", "DraftModelProposer", "EagleProposer", "Engine", "EngineConfig", "EngineResult",
    "KVCacheManager", "KVMemoryStats", "MedusaProposer", "OutOfBlocksError", "PagedKVCache", "PagedLayerCache",
    "PagedStep", "PromptLookupProposer",
    "Proposer", "Request",
    "RequestMetrics", "RequestOutput", "RequestRecord", "RequestStreams", "SamplingParams", "ScheduledBatch",
    "Scheduler", "Sequence", "SequenceStatus", "StaticScheduler", "StepRecord", "TargetFeatures", "TraceConfig",
    "Workload",
    "benchmark_metrics", "blocks_for", "chained_block_hash", "distribution", "flat_metrics", "make_chat_trace",
    "make_trace", "paged_attention", "poisson_arrivals", "request_metrics", "serve_one_at_a_time", "summarize",
]
