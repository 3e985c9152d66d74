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
# # 02 · Shrinking the KV cache: worked answers
#
# The exercises of `../02_kv_cache.ipynb`, answered step by step. Try them first; each answer here is
# checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
import cs336_inference
import torch

from cs336_inference import ModelConfig, TransformerLM, seed_everything
from cs336_inference.accounting import REAL_MODELS, kv_cache_bytes_per_token

cs336_inference.apply_thread_policy()
base = dict(vocab_size=257, context_length=128, d_model=64, num_layers=4, num_heads=4, d_ff=176)  # the notebook's

# %% [markdown]
# ## Exercise 1: GQA shrinks the cache N/K times
# Build the base model with K = N = 4 (MHA), 2 and 1 (MQA) KV heads and read the bytes its cache holds.

# %%
cache_bytes = {K: TransformerLM(ModelConfig(**base, num_kv_heads=K)).new_cache(1, 128).nbytes for K in (4, 2, 1)}
for K, nbytes in cache_bytes.items():
    print(f"K = {K}: {nbytes:,} bytes (MHA's / {cache_bytes[4] / nbytes:.0f})")

# %% [markdown]
# Exactly N/K: the cache holds K heads of keys and values per layer and position, and nothing else. The
# query heads (N = 4 in all three) are never cached.
#
# ## Exercise 2: DeepSeek-V2's MLA against MHA of the same heads
# MHA caches 2 x N x H numbers per token and layer (keys and values of every head); MLA caches one
# latent of C dims plus a shared RoPE key of R dims.

# %%
ds = REAL_MODELS["deepseek-v2"]
ds_mha = ds.replace(name="deepseek-v2-mha", attention_type="gqa", kv_lora_rank=None, rope_head_dim=None)
mla_ratio = kv_cache_bytes_per_token(ds_mha) / kv_cache_bytes_per_token(ds)
print(f"N = {ds.num_heads}, H = {ds.head_dim}: 2 N H = {2 * ds.num_heads * ds.head_dim} vs "
      f"C + R = {ds.kv_lora_rank} + {ds.rope_head_dim}: {mla_ratio:.1f}x smaller")

# %% [markdown]
# (2 x 128 x 128) / (512 + 64) = 56.9: the latent replaces both keys and values, and it is shared by
# every head; the up-projections W_UK, W_UV are weights, read once per step, not cached per token.
#
# ## Exercise 3: the receptive field of a window
# Predict first. In this codebase a query at position t sees positions t - W + 1 ... t (W positions,
# itself included), so one layer carries information W - 1 positions forward, and L layers carry it
# L (W - 1) positions: 4 x 15 = 60 for W = 16. Then change token 0 and see which logits move.

# %%
seed_everything(0)
L, W = 4, 16
window_model = TransformerLM(ModelConfig(**base, sliding_window=W)).eval()
x = torch.randint(0, 257, (1, 80))
y = x.clone()
y[0, 0] = (x[0, 0] + 1) % 257
with torch.no_grad():
    moved = (window_model(x) - window_model(y)).abs().amax(-1)[0] > 0
changed_positions = moved.nonzero().flatten().tolist()
print(f"logits change at positions {changed_positions[0]} ... {changed_positions[-1]}; "
      f"predicted last: L (W - 1) = {L * (W - 1)}")

# %% [markdown]
# Positions 0 to 60 move, 61 on do not: L (W - 1), as predicted (the lecture measures the same on its
# window-8 model: 4 x 7 = 28). Information still travels, but one window per layer.
