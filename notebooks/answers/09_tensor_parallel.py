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
# # 09 · Tensor parallelism: worked answers
#
# The exercises of `../09_tensor_parallel.ipynb`, answered step by step. Try them first; each answer here
# is checked against an independent computation by `tests/library/test_notebook_exercises.py`. None of them
# starts processes: the formulas need none, and `shard_model` needs a process group only to run a forward.

# %%
import torch

from cs336_inference.accounting.communication import allreduce_bytes_per_step, ring_allreduce_seconds
from cs336_inference.model import load_pretrained
from cs336_inference.parallel import shard_model

# %% [markdown]
# ## Exercise 1: bytes all-reduced per decode step, SmolLM2-135M at TP = 3
# Two all-reduces per layer, each of the (B, 1, D) activations: 2 × 30 × B × 576 × 2 bytes. The world size
# does not appear: p changes how the sums travel, not what is summed.

# %%
smollm2_bytes = {B: allreduce_bytes_per_step(num_layers=30, d_model=576, batch_size=B, bytes_per_element=2)
                 for B in (1, 64)}
print({B: f"{n / 1e3:.1f} kB" for B, n in smollm2_bytes.items()})

# %% [markdown]
# 69.1 kB per step at B = 1, spread over 60 all-reduces of 1.15 kB each; 4.4 MB at B = 64.
#
# ## Exercise 2: where the bandwidth term catches up with the latency term
# Per all-reduce of n bytes: 2(p-1)/p × n / bandwidth = 2(p-1) × latency when n = p × latency × bandwidth
# = 8 × 5e-6 × 1e11 = 4 MB. One decode all-reduce carries B × 8192 × 2 bytes, so B = 4e6 / 16384 ≈ 244.

# %%
p, latency, bandwidth, d_model = 8, 5e-6, 100e9, 8192
crossover_batch = p * latency * bandwidth / (d_model * 2)
n = crossover_batch * d_model * 2
bandwidth_term = ring_allreduce_seconds(n, p, bandwidth)
latency_term = ring_allreduce_seconds(n, p, bandwidth, latency) - bandwidth_term
print(f"B = {crossover_batch:.0f}: bandwidth term {bandwidth_term * 1e6:.0f} us, "
      f"latency term {latency_term * 1e6:.0f} us")

# %% [markdown]
# Below about 244 sequences, a decode all-reduce on that machine costs its 70 us of latency whatever its
# size: that is a chat server's usual batch. A faster link would not help it; fewer all-reduces would.
#
# ## Exercise 3: what rank 0 of 2 holds
# The projections (q/k/v/output, w1/w2/w3) are halved; the embedding, norms and output head are not. The KV
# cache keeps K/p = 1 of the 2 key/value heads per layer: exactly half.

# %%
whole = load_pretrained("target", dtype=torch.float32).eval()
rank0 = shard_model(load_pretrained("target", dtype=torch.float32).eval(), rank=0, world_size=2)
whole_params = sum(p.numel() for p in whole.parameters())
rank0_params = sum(p.numel() for p in rank0.parameters())
parameter_fraction = rank0_params / whole_params
cache_fraction = rank0.new_cache(1, 256).nbytes / whole.new_cache(1, 256).nbytes
print(f"rank 0 holds {rank0_params:,} of {whole_params:,} parameters ({parameter_fraction:.1%}); "
      f"KV cache fraction {cache_fraction:.2f}")

# %% [markdown]
# More than half of the parameters: the 257-token embedding and output head (2 × 257 × 192) stay whole on
# every rank. In a large model the layers dominate and the fraction tends to 1/p; a vocab-parallel
# embedding and head would split the rest.
