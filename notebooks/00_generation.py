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
# # 00 · Generation and the KV cache
#
# A language model produces one token at a time. This notebook builds the CS336 assignment-1
# Transformer from `cs336_inference`, generates with and without a KV cache, checks that both give
# the same tokens, and times them: the cache turns every step after the first into a
# one-token forward pass.

# %%
import cs336_inference  # first, before torch: sets OpenMP's wait policy (see cs336_inference/_openmp.py)
# isort: split
import matplotlib.pyplot as plt

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate, get_device, seed_everything
from cs336_inference.figures import save_figure

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)

# %% [markdown]
# ## A model and a cache
# `ModelConfig` names every size in the lecture's letters; GQA is `num_kv_heads < num_heads`.

# %%
config = ModelConfig(vocab_size=257, context_length=512, d_model=128, num_layers=4, num_heads=8,
                     num_kv_heads=2, d_ff=384)
model = TransformerLM(config).to(device).eval()
cache = model.new_cache(batch_size=1)
print(f"{model.num_parameters():,} parameters")
print(f"KV cache: {cache.bytes_per_token} bytes per token = 2 (K, V) x K={config.num_kv_heads} heads "
      f"x H={config.head_dim} x L={config.num_layers} x 4 bytes; {cache.nbytes / 1e6:.2f} MB reserved")

# %% [markdown]
# ## Cached and naive generation agree
# The naive generator re-runs the whole prefix at every step; the cached one feeds one token.

# %%
tokenizer = ByteTokenizer()
prompt = tokenizer.encode("Once upon a time")
cached = generate(model, [prompt], max_new_tokens=64)
naive = generate(model, [prompt], max_new_tokens=64, use_cache=False)
assert cached.tokens == naive.tokens
print("identical tokens:", cached.tokens[0][:16], "...")
print(f"TTFT {cached.ttft * 1e3:.1f} ms; cached total {cached.total_time:.3f} s; naive total {naive.total_time:.3f} s")

# %% [markdown]
# ## Where the time goes
# Per-step latency: flat with a cache (one token in, the cache read grows slowly), growing with the
# prefix without one.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(cached.inter_token_latencies, label="KV cache")
ax.plot(naive.inter_token_latencies, label="no cache (re-run prefix)")
ax.set_xlabel("generated token")
ax.set_ylabel("seconds per step")
ax.legend()
fig.tight_layout()
print("saved", save_figure(fig, "00_generation_step_latency"))
