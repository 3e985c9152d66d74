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
# # 08 · Alternatives to the transformer: worked answers
#
# The exercises of `../08_alternatives.ipynb`, answered step by step. Try them first; each answer here is
# checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
import cs336_inference
from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.accounting.fixed_state import HYBRIDS

cs336_inference.apply_thread_policy()
base = dict(vocab_size=257, context_length=512, d_model=64, num_layers=2, num_heads=2, d_ff=128)  # the notebook's

# %% [markdown]
# ## Exercise 1: the state of linear attention, by hand
# One layer keeps, per sequence: the state, N heads of F x H with F = 1 + d' + d'^2 (a row per feature
# of phi(k)); the normaliser z, N x F; and the short convolution's last width - 1 inputs of the
# 2 N d' + N H projected channels (q, k and v).

# %%
N, H, width = 2, 32, 4


def numbers_per_layer(d: int) -> int:
    F = 1 + d + d * d
    return N * F * (H + 1) + (width - 1) * (2 * N * d + N * H)


linear = TransformerLM(ModelConfig(**base, mixer="linear", feature_dim=4))
by_hand = base["num_layers"] * numbers_per_layer(4) * 4   # 2 layers, fp32
measured = linear.new_cache(1).nbytes
print(f"d' = 4: {by_hand:,} bytes by hand, {measured:,} measured")

attention_kv_at_64 = TransformerLM(ModelConfig(**base)).new_cache(1, 64).nbytes   # 2 (K, V) x 2 x 32 x 64 x 2 x 4 B
smallest_d = next(d for d in range(1, 64) if base["num_layers"] * numbers_per_layer(d) * 4 > attention_kv_at_64)
print(f"attention's KV cache at T = 64: {attention_kv_at_64:,} bytes; smallest d' with a larger state: {smallest_d}")

# %% [markdown]
# d' = 11: the state grows with d'^2 (the Taylor map's outer product), never with T. It then keeps as much
# as 64 tokens of this tiny model's KV cache, but keeps exactly that at T = 1 million, where the KV cache has
# grown 16,000-fold. BASED uses d' = 16 for the same reason: recall needs a big enough state.
#
# ## Exercise 2: Jamba's crossover context
# Its KV cache grows by `kv_bytes_per_token()` per token; its 28 Mamba states stay at `state_bytes()`.

# %%
jamba = HYBRIDS["jamba-52b"]
crossover = jamba.state_bytes() / jamba.kv_bytes_per_token()
print(f"state {jamba.state_bytes() / 2**20:.1f} MiB, KV {jamba.kv_bytes_per_token() / 1024:.0f} KiB per token: "
      f"equal at {crossover:,.0f} tokens")

# %% [markdown]
# About 500 tokens: beyond a short prompt, Jamba's memory is its 4 attention layers' cache, which is 8x
# smaller than an all-attention stack of the same shape would need (one attention layer in 8).
#
# ## Exercise 3: how many tokens one pass processes for free
# A forward over T tokens at batch 1 reads the weights once (2P bytes in bf16) and does 2PT FLOPs; it
# stays weight-bound while 2PT / peak < 2P / bandwidth, i.e. T < peak / bandwidth: the accelerator's
# intensity, whatever the model size.

# %%
peak, bandwidth, P = 989e12, 3.35e12, 7e9


def pass_seconds(tokens: int) -> float:
    return max(2 * P / bandwidth, 2 * P * tokens / peak)


free_tokens = max(t for t in range(1, 10_000) if pass_seconds(t) == pass_seconds(1))
print(f"one 7B pass stays weight-bound up to {free_tokens} tokens (peak / bandwidth = {peak / bandwidth:.0f})")

# %% [markdown]
# 295 tokens: the same B = 295 at which a decode batch becomes compute-bound (section 1). A diffusion
# model refining a block of up to ~295 tokens pays one weight read per step, so K steps instead of T
# tokens is up to a T / K speed-up, if K steps give the quality of T autoregressive ones.
