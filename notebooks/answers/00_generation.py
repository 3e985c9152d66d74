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
# # 00 · Generation and the KV cache: worked answers
#
# The exercises of `../00_generation.ipynb`, answered step by step. Try them first; each answer here is
# checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
import cs336_inference
import torch

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate, get_device, seed_everything
from cs336_inference.generation import decode_one_token, prefill

device = get_device()
print("device:", device)
cs336_inference.apply_thread_policy()
seed_everything(0)
config = ModelConfig(vocab_size=257, context_length=512, d_model=128, num_layers=4, num_heads=8,
                     num_kv_heads=2, d_ff=384)   # the notebook's model
model = TransformerLM(config).to(device).eval()
tokenizer = ByteTokenizer()

# %% [markdown]
# ## Exercise 1: the greedy loop, by hand
# `prefill` runs the prompt and returns the logits for the next token; each `decode_one_token` feeds
# the token just chosen and returns the logits after it. Greedy decoding takes the argmax every time.

# %%
prompt = tokenizer.encode("Once upon a time")
cache = model.new_cache(batch_size=1)
my_tokens = []
with torch.no_grad():
    logits = prefill(model, torch.tensor([prompt], device=device), cache)   # (B, V)
    for _ in range(32):
        token = logits.argmax(-1)                                            # (B,)
        my_tokens.append(int(token))
        logits = decode_one_token(model, token, cache)
print(my_tokens == generate(model, [prompt], 32).tokens[0])

# %% [markdown]
# The same 32 tokens: `generate` is exactly this loop (plus sampling options, stop tokens and timing).
#
# ## Exercise 2: the cache's bytes from the formula
# Keys and values (2), for B sequences, K KV heads, S positions, H dims per head, L layers, 4 bytes each
# (fp32 on the CPU).

# %%
B, S = 8, 512
predicted_bytes = 2 * B * config.num_kv_heads * S * config.head_dim * config.num_layers * 4
measured_bytes = model.new_cache(batch_size=B, max_seq_len=S).nbytes
print(f"predicted {predicted_bytes:,} bytes, measured {measured_bytes:,}")

# %% [markdown]
# They agree: the cache is nothing but those two tensors per layer, allocated up front for S positions.
# It grows with B and S while the weights do not: at long context and large batch the cache dominates.
#
# ## Exercise 3: positions run through the model
# Wrap `model.forward` to record how many positions each call runs, then generate N tokens after a
# P-token prompt with and without the cache.

# %%
P, N = 11, 9
toy_prompt = list(range(1, P + 1))
positions, counted = {}, []
forward = model.forward


def counting_forward(token_ids, *args, **kwargs):
    counted.append(token_ids.shape[-1])   # (B, T): T positions in this call
    return forward(token_ids, *args, **kwargs)


model.forward = counting_forward
for use_cache in (False, True):
    counted.clear()
    generate(model, [toy_prompt], N, use_cache=use_cache)
    positions[use_cache] = sum(counted)
model.forward = forward
print(f"without the cache: {positions[False]} positions; with it: {positions[True]}")

# %% [markdown]
# Without the cache, step t re-runs the prompt and the t tokens made so far: P + (P + 1) + ... +
# (P + N - 1) = N P + N (N - 1) / 2 positions, quadratic in N. With it, the prompt runs once and every
# later step runs one position: P + N - 1 (the last token needs no forward of its own).
