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
# # 07 · Paged attention: worked answers
#
# The exercises of `../07_paged_attention.ipynb`, answered step by step. Try them first; each answer here
# is checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
from cs336_inference.serving import KVCacheManager

# %% [markdown]
# ## Exercise 1: internal fragmentation by hand
# With blocks of 16, a sequence of n tokens holds ceil(n / 16) blocks; only its last block can be partly
# empty. Predict: 37 -> 3 blocks (48 slots), 5 -> 1 (16), 60 -> 4 (64): 128 reserved, 102 used, 26 wasted.

# %%
lengths, block_size = [37, 5, 60], 16
m = KVCacheManager(num_blocks=32, block_size=block_size, prefix_caching=False)
for i, n in enumerate(lengths):
    m.allocate(i, list(range(1000 * i, 1000 * i + n)))
fragmentation_stats = m.memory_stats()
print(fragmentation_stats)

# %% [markdown]
# ## Exercise 2: copy-on-write after two forks
# A 10-token sequence in blocks of 4 holds 4 + 4 + 2. Two forks share all three blocks (reference count
# 3). Appending a token writes into the shared, partly filled last block: the first two writers each get
# a private copy of it; by the time the original writes, it is the only one left holding the block.

# %%
m = KVCacheManager(num_blocks=16, block_size=4, prefix_caching=False)
m.allocate("a", list(range(10)))
m.fork("a", "b")
m.fork("a", "c")
copies = {seq: m.allocate_slots(seq) for seq in ("b", "c", "a")}
blocks_in_use = len({blk for seq in "abc" for blk in m.table(seq).blocks})
used_slots = m.memory_stats().used_tokens
print(f"copies per append {[len(c) for c in copies.values()]}; blocks in use {blocks_in_use}; used slots {used_slots}")

# %% [markdown]
# Two copies, then none: 2 shared full blocks + 3 private tails = 5 blocks, holding 8 + 3 x 3 = 17 token
# slots (shared slots counted once).
#
# ## Exercise 3: three requests behind one system prompt
# The 64-token system prompt fills 4 blocks of 16. After the first request registers its full blocks
# (`cache_blocks`), each later request finds them by their chained hashes.

# %%
m = KVCacheManager(num_blocks=32, block_size=16)
system = list(range(100, 164))
cached_prompt_tokens = []
for i in range(3):
    cached_prompt_tokens.append(m.allocate(i, system + [i, i + 1, i + 2]))
    m.cache_blocks(i, system + [i, i + 1, i + 2])
shared_blocks_total = len({blk for i in range(3) for blk in m.table(i).blocks})
print(f"cached prompt tokens per request {cached_prompt_tokens}; blocks held together {shared_blocks_total}")

# %% [markdown]
# The first request finds nothing, the next two find all 64 system-prompt tokens; together they hold
# the 4 shared blocks plus one private tail block each: 7 blocks instead of 15.
