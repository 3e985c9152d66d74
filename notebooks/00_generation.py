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
# one-token forward pass. Then it times them properly, the way a shared machine needs.

# %%
import cs336_inference
import matplotlib.pyplot as plt

import torch

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate, get_device, seed_everything
from cs336_inference.figures import save_figure
from cs336_inference.generation import decode_one_token, prefill
from cs336_inference.timing import alternating_timings

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)

# %% [markdown]
# ## A model and a cache
# `ModelConfig` names every size in the lecture's letters; GQA is `num_kv_heads < num_heads`. The cache
# holds, per layer, keys and values of shape (B, K, S_max, H): batch, KV heads, positions, head dim.

# %%
config = ModelConfig(vocab_size=257, context_length=512, d_model=128, num_layers=4, num_heads=8,
                     num_kv_heads=2, d_ff=384)
model = TransformerLM(config).to(device).eval()
cache = model.new_cache(batch_size=1)
print(f"{model.num_parameters():,} parameters")
print("one layer's keys (B, K, S_max, H):", tuple(cache.layers[0].k.shape))
print(f"KV cache: {cache.bytes_per_token} bytes per token = 2 (K, V) x K={config.num_kv_heads} heads "
      f"x H={config.head_dim} x L={config.num_layers} x 4 bytes; {cache.nbytes / 1e6:.2f} MB reserved")

# %% [markdown]
# ## Prefill, then one token at a time
# `prefill` runs the whole prompt (B, T) and fills the cache; `decode_one_token` feeds one token (B,)
# per sequence at position `cache.length`. Both return the next token's logits (B, V).

# %%
tokenizer = ByteTokenizer()
prompt = tokenizer.encode("Once upon a time " * 12)            # a 204-token prompt
ids = torch.tensor([prompt], device=device)                    # (B, T) = (1, 204)
with torch.no_grad():
    logits = prefill(model, ids, cache)                        # (B, V)
    print("prompt", tuple(ids.shape), "-> logits", tuple(logits.shape), "| cache.length", cache.length)
    logits = decode_one_token(model, logits.argmax(-1), cache)  # token (B,) -> logits (B, V)
    print("one decode step -> logits", tuple(logits.shape), "| cache.length", cache.length)

# %% [markdown]
# ## Cached and naive generation agree
# The naive generator re-runs the whole prefix at every step; the cached one feeds one token.

# %%
new_tokens = 64
cached = generate(model, [prompt], max_new_tokens=new_tokens)
naive = generate(model, [prompt], max_new_tokens=new_tokens, use_cache=False)
assert cached.tokens == naive.tokens
print("identical tokens:", cached.tokens[0][:16], "...")

# %% [markdown]
# ## How much faster, measured side by side
# One thread (the package's policy for tiny models), the two generators alternated three times so a
# change of load on a shared machine hits both alike; medians with min..max. The narration below is
# computed from this run's numbers.

# %%
times = alternating_timings({"cached": lambda: generate(model, [prompt], max_new_tokens=new_tokens),
                             "naive": lambda: generate(model, [prompt], max_new_tokens=new_tokens, use_cache=False)},
                            repeats=3, device=device)
for name, t in times.items():
    print(f"{name:6s}: median {t['median']:.3f} s ({t['min']:.3f}..{t['max']:.3f}) for {new_tokens} tokens")
speedup = times["naive"]["median"] / times["cached"]["median"]
positions = {"naive": sum(len(prompt) + t for t in range(new_tokens)), "cached": len(prompt) + new_tokens - 1}
print(f"the cache made generation {speedup:.1f}x faster here" if speedup > 1 else
      f"on this run the cache was not faster ({speedup:.2f}x): the machine was too busy to tell")
ratio = positions["naive"] / positions["cached"]
print(f"positions run through the model: naive {positions['naive']:,}, cached {positions['cached']:,} ({ratio:.0f}x)"
      + ("; the time ratio is smaller: a one-token step still pays for reading every weight and for Python's "
         "dispatch, which a many-token step shares" if speedup < ratio else ""))

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

# %% [markdown]
# ## Summary
# - Generation is a loop: prefill the prompt once, then one forward per new token.
# - The KV cache keeps every past key and value, so a step runs one token instead of the whole prefix;
#   the tokens are identical, only the cost changes (O(T^2) total FLOPs instead of O(T^3)).
# - The cache costs memory: 2 x K x H x L x bytes per token per sequence, reserved up front here.
# - Time on a shared CPU: one thread, alternate the variants, report medians, narrate what the run measured.
#
# ## Exercises
# 1. Write the greedy loop yourself with `prefill` and `decode_one_token` (take the argmax of the logits)
#    and check that it reproduces `generate(model, [prompt], 32).tokens[0]`.
# 2. Predict `model.new_cache(batch_size=8, max_seq_len=512).nbytes` from the formula
#    2 x B x K x S x H x L x 4 bytes, then check it.
# 3. Count the token positions each generator runs through the model for a P-token prompt and N new
#    tokens (wrap `model.forward` to count), and compare with the formulas used above.
#
# Worked answers: `answers/00_generation.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
