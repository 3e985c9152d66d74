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
# # 01 · Arithmetic intensity: worked answers
#
# The exercises of `../01_arithmetic_intensity.ipynb`, answered step by step. Try them first; each answer
# here is checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
from cs336_inference.accounting import (HARDWARE, REAL_MODELS, kv_cache_bytes_per_token, max_batch_size,
                                        num_parameters, with_kv_heads)
from cs336_inference.accounting import symbolic as sym

h100 = HARDWARE["H100"]
print(f"H100: {h100.peak_flops:.3g} FLOP/s, {h100.memory_bandwidth:.3g} B/s, "
      f"accelerator intensity {h100.accelerator_intensity:.1f} FLOPs/byte")

# %% [markdown]
# ## Exercise 1: the smallest compute-bound batch for a 4096 x 4096 matmul
# `sym.matmul_cost()` holds the FLOPs (2BDF) and bytes (2BD + 2DF + 2BF) of X (B x D) @ W (D x F) in
# bf16. Substitute D = F = 4096 and walk B up until the intensity passes the H100's.

# %%
intensity = sym.matmul_cost().intensity.subs({sym.D: 4096, sym.F: 4096})
print("intensity(B) =", intensity)
smallest_batch = next(b for b in range(1, 4096) if float(intensity.subs(sym.B, b)) > h100.accelerator_intensity)
print("compute-bound from B =", smallest_batch)

# %% [markdown]
# Not 296: the limit "intensity -> B" holds only when B << D, F. At B ~ 300 the reads and writes of X
# and Y (2BD + 2BF) are no longer negligible next to W's 2DF, so B must go further before the FLOPs
# catch up: intensity = 2BDF / (2BD + 2DF + 2BF) = B D / (2B + D) for D = F.
#
# ## Exercise 2: the largest batch of Llama 2 13B that fits in 80 GB
# `with_kv_heads` gives the model with K KV heads; `max_batch_size` fills what the bf16 weights leave of
# the H100's memory with KV caches of S = 1024 tokens.

# %%
largest_batch = {K: max_batch_size(with_kv_heads("llama2-13b", K), "H100", seq_len=1024) for K in (40, 8)}
print(largest_batch)

# %% [markdown]
# With K = 8 the cache per sequence is 5 times smaller (and the weights slightly smaller too, as the K/V
# projections shrink), so more than 5 times as many sequences fit.
#
# ## Exercise 3: the context at which one sequence's cache outweighs the weights
# The bf16 weights take 2 x parameters bytes; one sequence's cache takes S x bytes per token.

# %%
llama = REAL_MODELS["llama2-13b"]
weight_bytes = 2 * num_parameters(llama)
crossover_context = weight_bytes / kv_cache_bytes_per_token(llama)
print(f"one sequence: S = {crossover_context:,.0f} tokens; at B = 64: S = {crossover_context / 64:,.0f}")

# %% [markdown]
# About 32k tokens for a single sequence (far beyond Llama 2's 4096-token context), but only ~500 tokens
# per sequence at B = 64: in a batch, the caches outweigh the weights almost at once.
