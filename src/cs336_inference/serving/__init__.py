"""Serving dynamic workloads: paged KV memory, schedulers (static / continuous batching), engine.

Paging (vLLM, Kwon et al. 2023): `BlockAllocator` (free list + reference counts), `BlockTable`,
`BlockManager` (tables of many sequences: prefix sharing, fork, copy-on-write), `PrefixCache`,
`paged_attention`, and the `ContiguousAllocator` baseline with `KVMemoryStats` for both.
Scheduling (Orca, Yu et al. 2022): `Request`, `StaticScheduler`, `ContinuousScheduler`.
"""

from .block_allocator import BlockAllocator, OutOfBlocksError
from .block_manager import BlockManager
from .block_table import BlockTable, blocks_for
from .contiguous_allocator import ContiguousAllocator
from .memory_stats import KVMemoryStats
from .paged_attention import paged_attention
from .prefix_cache import PrefixCache, chained_block_hash
from .request import Request, RequestOutput, SamplingParams
from .scheduler import ContinuousScheduler, ScheduledBatch, Scheduler, StaticScheduler
from .sequence import Sequence, SequenceStatus

__all__ = [
    "BlockAllocator", "BlockManager", "BlockTable", "ContiguousAllocator", "ContinuousScheduler",
    "KVMemoryStats", "OutOfBlocksError", "PrefixCache", "Request", "RequestOutput", "SamplingParams",
    "ScheduledBatch", "Scheduler", "Sequence", "SequenceStatus", "StaticScheduler", "blocks_for",
    "chained_block_hash", "paged_attention",
]
