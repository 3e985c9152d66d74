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
# # 08 · Alternatives to the transformer: a fixed state instead of a KV cache
#
# Every variant of notebook 02 still caches something per token. Linear attention and state-space
# models go further: each layer keeps one state of fixed size, whatever the context, so decode reads
# the same bytes at token 10 and at token 10 million. The catch is *recall*: everything the model was
# told must fit in that state. "Supports long context" therefore needs three numbers side by side:
# recall, bytes kept per sequence, and decode latency.
#
# | layer | what one sequence keeps per layer | paper |
# | --- | --- | --- |
# | attention | K and V of every past token: 2·K·H·T | Vaswani et al. 2017 |
# | linear attention (BASED) | a state N·F·H (+ a normaliser), F = 1 + d' + d'² | Katharopoulos 2020; Arora 2024 |
# | Mamba-2 (SSD) | a state N·n·H, with an input-dependent decay | Dao & Gu 2024 |
# | hybrid | attention every few layers, fixed-state layers between | Jamba, MiniMax-01 |

# %%
import cs336_inference

import matplotlib.pyplot as plt
import torch

from cs336_inference import ModelConfig, TransformerLM, get_device, seed_everything
from cs336_inference.accounting.fixed_state import HYBRIDS, state_bytes
from cs336_inference.data.mqar import MQARTask, mqar_recall
from cs336_inference.figures import load_result, save_figure
from cs336_inference.model import load_pretrained
from cs336_inference.tables import alternatives_table

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)

# %% [markdown]
# ## One family: gated linear attention
# Per head, a state S of F × H numbers; each token updates it and reads it:
#
#     S_t = a_t S_{t-1} + k_t v_tᵀ        y_t = q_tᵀ S_t
#
# Linear attention uses a_t = 1 and feature maps of the query and key (BASED's makes φ(q)·φ(k) the
# second-order Taylor expansion of exp(q·k/√d')); Mamba-2 uses a decay a_t = exp(−exp(A)·dt_t) with
# a step dt_t that each token chooses. `ModelConfig(mixer=...)` builds either; `global_every` mixes in
# attention layers (a hybrid).

# %%
base = dict(vocab_size=257, context_length=512, d_model=64, num_layers=2, num_heads=2, d_ff=128)
kinds = {"attention": dict(), "linear d'=4": dict(mixer="linear", feature_dim=4),
         "SSD n=16": dict(mixer="ssd", state_dim=16), "hybrid (SSD + attention)": dict(mixer="ssd", global_every=2)}
models = {name: TransformerLM(ModelConfig(**base, **kw), device=device).eval() for name, kw in kinds.items()}
for name, model in models.items():
    print(f"{name:<26} {model.num_parameters():>7,} params  layers: {[type(b.attn).__name__ for b in model.layers]}")

# %% [markdown]
# ## Two forms, one answer
# Prefill and training use the *parallel* form (all tokens at once, quadratic in T like attention);
# decode uses the *recurrent* form (one state update per token). They must agree.

# %%
ids = torch.randint(0, 257, (2, 80), device=device)
with torch.no_grad():
    for name, model in models.items():
        cache = model.new_cache(2)
        steps = [model(ids[:, :20], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(20, 80)]
        gap = (torch.cat(steps, 1) - model(ids)).abs().max().item()
        print(f"{name:<26} token-by-token decode vs one full forward: max |Δ logit| = {gap:.1e}")
        assert gap < 1e-4

# %% [markdown]
# ## Bytes kept per sequence against context
# A KV cache grows by 2·K·H numbers per token and layer; a state does not grow at all. The hybrid
# pays the KV cost for its one attention layer only.

# %%
contexts = [64, 256, 1024, 4096]
kept = {}
for name, kw in kinds.items():
    config = ModelConfig(**{**base, "context_length": max(contexts)}, **kw)
    meta = TransformerLM(config, device="meta")          # shapes only: no weights are allocated
    kept[name] = [meta.new_cache(1, T, dtype=torch.float32).nbytes for T in contexts]
    print(f"{name:<26}", "  ".join(f"T={T}: {b / 1024:7.1f} KiB" for T, b in zip(contexts, kept[name])))
assert kept["SSD n=16"][0] == kept["SSD n=16"][-1] == state_bytes(models["SSD n=16"].config)

fig, ax = plt.subplots(figsize=(6, 4))
for name, values in kept.items():
    ax.plot(contexts, [v / 1024 for v in values], marker="o", label=name)
ax.set(xscale="log", yscale="log", xlabel="context T (tokens)", ylabel="KiB one sequence keeps (fp32)",
       title="KV cache vs fixed state")
ax.legend()
save_figure(fig, "08_state_vs_cache")
plt.show()

# %% [markdown]
# ## Recall: the price of a fixed state (MQAR)
# Multi-query associative recall (Zoology, Arora et al. 2023): a sequence lists key-value pairs, then
# asks for every key again. `bench alternatives` trained 2-layer models of each kind on it with the
# same parameter budget; five of them ship with the package. Recall is measured here, live.

# %%
task = MQARTask(num_keys=32, num_values=32, seq_len=64)
inputs, targets = task.batch(1, 4, torch.Generator().manual_seed(0))
print("a sequence with 4 pairs:", inputs[0].tolist())
print("what must be answered  :", [t if t >= 0 else "." for t in targets[0].tolist()])

pairs = [2, 4, 8, 12, 16, 20]
shipped = {name: load_pretrained(f"mqar-{name}", device=device) for name in ("attention", "window", "linear", "ssd",
                                                                             "hybrid")}
recall = {name: [mqar_recall(model, task, p, num_sequences=128) for p in pairs] for name, model in shipped.items()}
state_kib = {name: model.new_cache(1, task.seq_len).nbytes / 1024 for name, model in shipped.items()}
fig, ax = plt.subplots(figsize=(6, 4))
for name, values in recall.items():
    ax.plot(pairs, values, marker="o", label=f"{name} ({state_kib[name]:.1f} KiB kept)")
    print(f"{name:<10} recall {[round(v, 2) for v in values]}  keeps {state_kib[name]:.1f} KiB per sequence")
ax.set(xlabel="key-value pairs", ylabel="recall", ylim=(-0.03, 1.05), title="MQAR recall (shipped models)")
ax.legend(fontsize=8)
save_figure(fig, "08_mqar_recall")
plt.show()

# %% [markdown]
# Attention looks every pair up. A small state (the shipped SSD model keeps n = 4 numbers per value
# dim and head; the linear model d' = 2, so F = 7 key features) recalls less and less as the pairs
# outgrow it; a single attention layer (the hybrid: the same SSD layer, then attention) brings it back,
# at the cost of a KV cache for that layer. A sliding window of 16 tokens cannot reach pairs listed
# more than 16 tokens before their query at all.
#
# ## The whole sweep (committed run of `bench alternatives`)
# Several state sizes per kind, and decode latency measured against context on untrained copies.

# %%
results = load_result("alternatives")
if results is None:
    print("run `python -m cs336_inference bench alternatives` for the whole sweep (about 20 minutes)")
else:
    print(alternatives_table(results))

# %% [markdown]
# ## At real scale: Jamba and MiniMax-01
# Both keep one attention layer in eight. Per sequence, in bf16:

# %%
long_contexts = [2**k for k in range(12, 21)]
fig, ax = plt.subplots(figsize=(6, 4))
for name, shape in HYBRIDS.items():
    memory = [shape.memory(T) for T in long_contexts]
    ax.plot(long_contexts, [m["total_bytes"] / 2**30 for m in memory], marker="o", label=f"{name} (hybrid)")
    ax.plot(long_contexts, [m["all_attention_kv_bytes"] / 2**30 for m in memory], ls="--",
            label=f"{name} if every layer were attention")
    print(f"{name}: state {shape.state_bytes() / 2**20:.0f} MiB, "
          f"KV {shape.kv_bytes_per_token() / 1024:.0f} KiB per token")
ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="GiB per sequence (bf16)",
       title="hybrids: KV cache + state")
ax.legend(fontsize=7)
save_figure(fig, "08_hybrids_at_scale")
plt.show()

# %% [markdown]
# ## Summary
# - Linear attention and state-space models are one family, gated linear attention: a state of fixed
#   size, updated by every token; a parallel form for prefill and training, a recurrent one for decode.
# - Bytes per token drop to 0 and decode no longer slows down with the context ("O(T) cache → O(1) state").
# - The price is recall: the state must hold everything the model may be asked for. Recall falls once
#   the key-value pairs outgrow the state; one attention layer in a few (Jamba, MiniMax-01, BASED's
#   local attention) brings most of it back.
# - "Supports long context" is three numbers: recall (or long-context accuracy), bytes per sequence and
#   decode latency.

# %% [markdown]
# ## Exercises
# 1. State size by hand: for the `linear d'=4` model above (N = 2 heads, H = 32), write the numbers one
#    layer keeps, N·(1 + d' + d'²)·(H + 1) for the state and its normaliser plus (width − 1)·(2·N·d' + N·H)
#    for the short convolution, and check it against `new_cache(1).nbytes`. Then find the smallest
#    feature_dim d' whose state (at fp32) is larger than the attention model's KV cache at T = 64.
# 2. Jamba keeps a Mamba state in 28 layers and a KV cache in 4: from `HYBRIDS["jamba-52b"]`, at what
#    context do its KV cache and its state hold the same bytes?
# 3. Diffusion decoding runs K passes over a block of T tokens instead of T passes over one token. On an
#    H100 in bf16 (989e12 FLOP/s, 3.35e12 B/s), how many tokens can one pass of a 7B model process before
#    it becomes compute-bound rather than weight-bound? Predict it from section 1's intensity first.
#
# Worked answers: `answers/08_alternatives.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
