# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Paged attention
#
# A KV cache reserved per request for its maximum length wastes memory twice (Kwon et al., SOSP
# 2023, "vLLM"): the tail a request never reaches (*internal* fragmentation) and the free memory
# scattered in gaps too small for the next request (*external* fragmentation). Paging borrows the
# operating system's answer: cut the cache into fixed-size **blocks**, give each sequence a **block
# table** from logical positions to physical blocks, and allocate a block only when the previous one
# is full. Blocks can then be **shared**: by requests with the same system prompt (prefix caching)
# and by the n samples of one prompt, with **copy-on-write** when a shared block is written.
#
# This notebook walks through `cs336_inference.serving`: the allocator, block tables with fork and
# copy-on-write, prefix sharing, paged attention, and then the memory of a real serving run.

# %%
import cs336_inference
import matplotlib.pyplot as plt
import torch

from cs336_inference import get_device, seed_everything
from cs336_inference.data import load_corpus
from cs336_inference.figures import save_figure
from cs336_inference.model import load_pretrained, scaled_dot_product_attention
from cs336_inference.serving import (BlockAllocator, ContiguousAllocator, Engine, KVCacheManager, OutOfBlocksError,
                                     TraceConfig, make_trace, paged_attention)
from cs336_inference.serving.plots import plot_batch_size, plot_memory

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny model: one thread is fastest
seed_everything(0)

# %% [markdown]
# ## Blocks, a free list and reference counts
# `BlockAllocator(num_blocks, block_size)` hands out block ids from a free list in O(1); each block
# has a reference count (how many block tables hold it). Running out raises and changes nothing.

# %%
alloc = BlockAllocator(num_blocks=4, block_size=16)
a, b = alloc.allocate(), alloc.allocate()
alloc.incref(a)  # a second table shares block a
print(f"blocks {a}, {b} in use; ref counts {alloc.ref_count(a)}, {alloc.ref_count(b)}; free {alloc.free_blocks()}")
alloc.allocate(), alloc.allocate()
try:
    alloc.allocate()
except OutOfBlocksError as e:
    print("5th block:", e)

# %% [markdown]
# ## Block tables, fork and copy-on-write
# `KVCacheManager` keeps one block table per sequence over one pool of blocks. Position p of a sequence
# lives in block `table[p // block_size]` at offset `p % block_size`. Forking (parallel sampling)
# shares every block; the first write into a shared, partly filled block copies it first.

# %%
m = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=False)
m.allocate("parent", list(range(10)))            # 10 tokens: blocks of 4 + 4 + 2
m.fork("parent", "child")
print("after fork:   parent", m.table("parent").blocks, " child", m.table("child").blocks)
(copy,) = m.allocate_slots("child")               # a slot for position 10, in the shared last block
print(f"child writes: copy block {copy[0]} -> {copy[1]};",
      f"parent {m.table('parent').blocks}, child {m.table('child').blocks}")
print("parent writes without a copy:", m.allocate_slots("parent"))
stats = m.memory_stats()
print(f"{stats.logical_tokens} tokens in two sequences, {stats.used_tokens} slots hold them "
      f"({stats.shared_tokens} shared), {stats.reserved_tokens} reserved")

# %% [markdown]
# ## Prefix sharing
# A full block is named by a hash chained over the previous block's hash and its own token ids, so the
# name covers the whole prefix. A new request looks its full prompt blocks up and reuses the hits:
# they cost no memory and skip their prefill. The hash is only an index: a hit must also match the
# token ids and the parent block, so a collision can never share wrong data.

# %%
m = KVCacheManager(num_blocks=32, block_size=16)
system = list(range(100, 164))                    # a 64-token system prompt = 4 full blocks
m.allocate("first", system + [1, 2, 3])
m.cache_blocks("first", system + [1, 2, 3])       # its K/V are being computed: name its full blocks
cached = m.allocate("second", system + [9, 8, 7, 6, 5])
print(f"second request: {cached} of {len(system) + 5} prompt tokens come from the cache; "
      f"shared blocks {m.table('second').blocks[:4]}")

# %% [markdown]
# ## Paged attention equals contiguous attention
# `paged_attention` gathers each sequence's blocks through its table (plain PyTorch; a GPU kernel
# reads them in place) and attends per sequence. Same keys and values, scattered over the pool in a
# random order, give the same result as attention over a contiguous cache.

# %%
K, N, H, bs = 2, 6, 32, 16
lengths = [37, 5, 60]
pool_k, pool_v = torch.randn(20, bs, K, H), torch.randn(20, bs, K, H)
order = torch.randperm(20).tolist()
tables = [order[0:3], order[3:4], order[4:8]]
q = torch.randn(len(lengths), N, H)               # one decode query per sequence
out = paged_attention(q, pool_k, pool_v, tables, lengths)
print(f"pool of keys (blocks, block_size, K, H) {tuple(pool_k.shape)}; queries (B, N, H) {tuple(q.shape)} "
      f"-> out {tuple(out.shape)}; block tables {tables}")
for i, (S, table) in enumerate(zip(lengths, tables)):
    k = torch.cat([pool_k[blk] for blk in table])[:S].transpose(0, 1)       # (K, S, H) contiguous
    v = torch.cat([pool_v[blk] for blk in table])[:S].transpose(0, 1)
    ref = scaled_dot_product_attention(q[i].view(K, N // K, H), k, v)        # grouped heads
    print(f"sequence {i} ({S} keys in blocks {table}): max |paged - contiguous| = "
          f"{(out[i].view(K, N // K, H) - ref).abs().max():.1e}")

# %% [markdown]
# ## Contiguous reservation, fragmented
# The baseline reserves prompt + max_new_tokens in one run of slots. When requests come and go, free
# slots end up in holes: here 7 slots are free but no request needing 5 fits.

# %%
c = ContiguousAllocator(10)
c.allocate("A", 4), c.allocate("B", 3), c.allocate("C", 3)
c.free("A"), c.free("C")
s = c.memory_stats()
print(f"free runs {c.free_runs()}: {s.free_tokens} slots free, longest run {s.largest_free_tokens}, "
      f"external fragmentation {s.external_fragmentation_tokens} slots; room for 5? {c.can_allocate(5)}")

# %% [markdown]
# ## A serving run: paged vs contiguous in the same memory
# The shipped target model serves one trace with continuous batching in a pool of 2048 token slots,
# once paged (blocks of 16, allocated as tokens arrive) and once contiguous (each request reserves
# its prompt + 128 new tokens up front, and 4 samples reserve 4 runs). Answers end with their line,
# usually long before 128 tokens. The engine runs on the lecture's simulated clock (a fixed cost per
# step), so the numbers are the same on every run.

# %%
def step_seconds(batch) -> float:
    return 0.010 + 0.0001 * batch.num_tokens   # 10 ms per step + 0.1 ms per token


model = load_pretrained("target", device=device).eval()
text = load_corpus("val")
requests = make_trace(text[1000:], TraceConfig(num_requests=32, rate=60.0, prompt_len=(16, 96), max_new_tokens=128,
                                               stop_tokens=(10,), system_prompt_fraction=0.5, sampled_fraction=0.2,
                                               n_samples=4, seed=0), system_prompt=text[:64].tolist())
runs = {layout: Engine(model, kv_layout=layout, block_size=16, num_blocks=128, max_num_seqs=64, watermark_blocks=0,
                       step_time=step_seconds).run(requests) for layout in ("paged", "contiguous")}
for layout, result in runs.items():
    s = result.summary()
    print(f"{layout:>10}: waste {100 * s['kv_waste_fraction']:4.1f}% of reserved slots | at most "
          f"{s['max_running']:2} sequences at once | {s['throughput_tok_per_s']:5.0f} tok/s | "
          f"shared {100 * s['kv_shared_fraction']:4.1f}% of logical tokens | {s['preemptions']} preemptions")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
for (layout, result), color in zip(runs.items(), ("C0", "C3")):
    plot_memory(ax1, result, layout, color)
    plot_batch_size(ax2, result, layout, color=color)
ax1.set_title("KV memory over time (2048 slots)")
ax1.legend(fontsize=8)
ax2.set_title("sequences running")
ax2.legend()
fig.tight_layout()
save_figure(fig, "07_paged_attention_memory")
plt.show()

# %% [markdown]
# Paged memory reserves only what is written, rounded up to a block: the waste is at most one
# partly filled block per sequence, and blocks of the shared system prompt and of forked samples
# are stored once. The contiguous layout reserves for answers that never come: it holds far fewer
# sequences at once in the same bytes, so the batch is smaller and requests wait longer.
#
# ## Block size: waste vs bookkeeping
# Smaller blocks waste less of the last block but mean longer tables and more gathering per step.

# %%
for bs in (4, 8, 16, 32):
    s = Engine(model, block_size=bs, num_blocks=2048 // bs, max_num_seqs=64, watermark_blocks=0,
               step_time=step_seconds).run(requests).summary()
    print(f"block size {bs:2}: waste {100 * s['kv_waste_fraction']:4.1f}%, at most {s['max_running']} running, "
          f"{s['throughput_tok_per_s']:5.0f} tok/s")

# %% [markdown]
# ## Summary
# - Reserving each request's maximum length wastes the tail it never reaches (internal fragmentation)
#   and leaves free memory in holes too small to use (external fragmentation).
# - Paging: fixed-size blocks from a free list, a block table per sequence, a new block only when the last
#   is full; the waste is at most one partly filled block per sequence.
# - Blocks are shared by reference count: a common system prompt (found by chained block hashes) and the
#   n samples of one prompt are stored once; copy-on-write splits a shared block when one sequence writes.
# - Attention reads the blocks through the table and gives exactly the contiguous result; more sequences
#   fit in the same memory, so the batch is larger and requests wait less.
#
# ## Exercises
# 1. Allocate sequences of 37, 5 and 60 tokens in a `KVCacheManager` with blocks of 16 and predict
#    `memory_stats()`: reserved slots, used slots, internal fragmentation.
# 2. Fork a 10-token sequence twice (blocks of 4) and `allocate_slots` one token to each of the three: which
#    appends copy a block, and how many blocks are in use afterwards?
# 3. Three requests behind the same 64-token system prompt (blocks of 16, `cache_blocks` after each):
#    how many prompt tokens does each find cached, and how many blocks do the three hold together?
#
# Worked answers: `answers/07_paged_attention.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
