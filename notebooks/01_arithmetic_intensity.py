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
# # 01 · Arithmetic intensity, latency and throughput
#
# The first half of lecture 10 in one notebook. We derive, with sympy, how many FLOPs and bytes
# each part of a Transformer costs; turn that into memory, latency, throughput and TTFT for real
# models (Llama 2 13B on an H100); then *measure* this machine's roofline and check the
# predictions against a real ~88M-parameter model. Everything comes from `cs336_inference`.

# %%
import cs336_inference
from dataclasses import replace

import matplotlib.pyplot as plt
import sympy as sp
import torch
from torch.utils.flop_counter import FlopCounterMode

from cs336_inference import ModelConfig, TransformerLM, default_dtype, get_device, seed_everything
from cs336_inference.accounting import symbolic as sym
from cs336_inference.accounting import (HARDWARE, REAL_MODELS, forward_flops, kv_cache_bytes_per_token,
                                        num_parameters, transformer_performance_stats, with_kv_heads)
from cs336_inference.accounting.formulas import batch_sweep
from cs336_inference.accounting.model_roofline import measure_decode, measure_prefill
from cs336_inference.accounting.plots import plot_kv_memory, plot_latency_throughput, plot_model, plot_roofline
from cs336_inference.figures import save_figure
from cs336_inference.accounting import measure_hardware, roofline_sweep
from cs336_inference.accounting.roofline import predicted_flops

device = get_device()
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy(parallel=True))  # timing below: every core, passive waits
seed_everything(0)

# %% [markdown]
# ## 1. Arithmetic intensity of a matmul
# Y = X (B x D) @ W (D x F) in bf16 reads 2BD + 2DF bytes, writes 2BF and does 2BDF FLOPs.
# When B is much smaller than D and F, the FLOPs per byte tend to B.

# %%
mm = sym.matmul_cost()
print("FLOPs:", mm.flops, "| bytes:", mm.bytes)
print("intensity:", mm.intensity, "-> (B << D, F)", sym.matmul_intensity_limit())
h100 = HARDWARE["H100"]
print(f"H100: {h100.peak_flops:.3g} FLOP/s / {h100.memory_bandwidth:.3g} B/s = "
      f"accelerator intensity {h100.accelerator_intensity:.0f} FLOP/B: compute-bound only if B > 295")

# %% [markdown]
# ## 2. The Transformer at inference time
# Naive generation re-runs the prefix at each step (O(T^3) FLOPs in total); the KV cache makes each
# step a one-token forward (O(T^2)). Prefill processes T = S tokens at once, decode T = 1.

# %%
gen = sym.generation_flops()
print("naive :", gen["naive"], " degree in T:", sp.degree(sp.expand(gen["naive"]), sym.T))
print("cached:", gen["cached"], " degree in T:", sp.degree(sp.expand(gen["cached"]), sym.T))
mlp = sym.mlp_cost()
print("MLP: FLOPs", mlp.flops, "| bytes", mlp.bytes, "| intensity ->", sym.mlp_intensity_limit())
att = sym.attention_cost()
print("attention: intensity", att.intensity, "| prefill (T=S):", sym.attention_intensity_prefill(),
      "| generation (T=1):", sym.attention_intensity_generation())

# %% [markdown]
# The MLP's intensity grows with B·T, so decode can be batched towards the compute roof. Attention
# during generation has intensity S/(S+1) < 1 **whatever B is**: each sequence reads its own cache.

# %% [markdown]
# ## 3. Memory, latency and throughput of real models
# params = 2VD + 3DFL + (2DNH + 2DKH)L; the KV cache per sequence is S·K·H·L·2·2 bytes; a decode
# step reads both, so latency = memory / bandwidth and throughput = B / latency.

# %%
for name, shape in REAL_MODELS.items():
    print(f"{name:12s} {num_parameters(shape) / 1e9:6.1f}B params "
          f"({num_parameters(shape, active_only=True) / 1e9:5.1f}B active), "
          f"KV cache {kv_cache_bytes_per_token(shape):>7,d} bytes/token "
          f"({shape.attention_type}, K={shape.num_kv_heads})")
ds = REAL_MODELS["deepseek-v2"]
print(f"DeepSeek-V2 MLA caches {kv_cache_bytes_per_token(ds, 1) // ds.num_layers} elements per token per layer "
      f"(512 latent + 64 RoPE) instead of 2NH = {2 * ds.num_heads * ds.head_dim} for MHA")

# %%
for b in (1, 64, 256):
    print(transformer_performance_stats("llama2-13b", "H100", batch_size=b, seq_len=1024).summary())
fig = plot_latency_throughput(batch_sweep("llama2-13b", "H100", 1024))
print("saved", save_figure(fig, "01_latency_throughput_llama2_13b"))

# %% [markdown]
# GQA shares each KV head among G = N/K query heads: with K = 8 the cache shrinks 5x and B = 64
# (even 256) fits again.

# %%
for b in (64, 256):
    print(transformer_performance_stats(with_kv_heads("llama2-13b", 8), "H100", b, 1024).summary())
fig = plot_kv_memory("llama2-13b", "H100", 1024)
print("saved", save_figure(fig, "01_kv_memory_mha_vs_gqa"))

# %% [markdown]
# ## 4. This machine's roofline, measured
# Two numbers describe the machine: peak matmul FLOP/s and streaming memory bandwidth. Their ratio
# is its accelerator intensity. Then Y = X @ W with a W larger than the caches, for growing B:
# achieved FLOP/s should follow min(peak, intensity x bandwidth), timed with every core. On a
# shared machine the load changes while we measure, so the roofs are measured before *and* after
# the sweep and the roof is the best this run saw: a "peak" taken at a busy moment would otherwise
# sit below what the sweep reaches at a quiet one.

# %%
hw_before = measure_hardware(device)
sweep = roofline_sweep(device, batch_sizes=[2**i for i in range(10)], repeats=3, hardware=hw_before)
hw_after = measure_hardware(device)
peaks = {"before": hw_before.peak_flops, "after": hw_after.peak_flops, "sweep": max(sweep.achieved_flops)}
hw = replace(hw_before, peak_flops=max(peaks.values()),
             memory_bandwidth=max(hw_before.memory_bandwidth, hw_after.memory_bandwidth))
sweep = replace(sweep, hardware=hw, predicted_flops=[predicted_flops(i, hw.peak_flops, hw.memory_bandwidth)
                                                     for i in sweep.intensity])
print("matmul GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()))
if peaks["sweep"] > max(peaks["before"], peaks["after"]):
    print("the sweep beat both peak measurements: the load changed during the run, so the roof is the sweep's best")
print(hw.summary())
for b, a, p in zip(sweep.batch_sizes, sweep.achieved_flops, sweep.predicted_flops):
    print(f"B={b:4d}: {a / 1e9:7.1f} GFLOP/s achieved ({a / hw.peak_flops:4.0%} of peak), roofline {p / 1e9:7.1f}")
print(f"ridge at B = {sweep.ridge_batch_size:.1f}; measured knee (80% of best) at B = {sweep.knee_batch_size()}")
fig = plot_roofline(sweep)
print("saved", save_figure(fig, "01_roofline_measured"))

# %% [markdown]
# ## 5. A real model on this machine
# The "bench-90m" preset (~88M parameters, 352 MB in fp32) is far bigger than the CPU caches, so its
# decode should be memory-bound: time per step ≈ bytes read / bandwidth. Prefill processes many
# tokens per weight read and should be much cheaper per token (the printout says what this run
# measured). We also time the step's weight matmuls
# alone: the gap between them and bytes / bandwidth is the BLAS library not streaming small
# matrices at full speed; the rest of the step (attention, norms, Python) is the remainder.

# %%
config = ModelConfig.from_name("bench-90m")
model = TransformerLM(config, device=device, dtype=default_dtype(device)).eval()
prefill = measure_prefill(model, 128, hw, repeats=2)
decode = [measure_decode(model, b, 128, hw, repeats=3) for b in (1, 4, 16)]
print(f"{model.num_parameters() / 1e6:.0f}M parameters; token embeddings {tuple(model.token_embeddings.weight.shape)} "
      f"(V, D), layer 0 w1 {tuple(model.layers[0].ffn.w1.weight.shape)} (F, D)")
print(f"prefill: {prefill['seconds_per_token'] * 1e3:.2f} ms per prompt token")
for d in decode:
    print(f"decode B={d['batch_size']:2d}: {d['seconds'] * 1e3:7.2f} ms/step measured "
          f"(matmuls alone {d['matmul_only_seconds'] * 1e3:6.2f}), {d['predicted_seconds'] * 1e3:7.2f} "
          f"predicted ({d['bytes'] / 1e6:.0f} MB read, {d['achieved_bandwidth'] / 1e9:.1f} GB/s achieved, "
          f"{d['achieved_bandwidth'] / hw.memory_bandwidth:.0%} of the measured stream)")
cheaper = decode[0]["seconds"] / prefill["seconds_per_token"]
print(f"this run: a prompt token costs 1/{cheaper:.0f} of a B = 1 decode step" if cheaper > 1 else
      f"this run: prefill was not cheaper per token ({cheaper:.2f}x): the machine was too busy to tell")
tokens_per_s = {d["batch_size"]: d["batch_size"] / d["seconds"] for d in decode}
print("decode tokens/s by batch:", {b: round(v, 1) for b, v in tokens_per_s.items()})
fig = plot_model(prefill, decode)
print("saved", save_figure(fig, "01_bench90m_prefill_decode"))

# %% [markdown]
# ## 6. Cross-checks
# The FLOP formula against torch's own counter (which counts matmul-family ops, as the formula
# does, so they agree exactly), and the KV-bytes formula against the real cache's tensors.

# %%
ids = torch.randint(0, config.vocab_size, (1, 64), device=device)
with torch.no_grad(), FlopCounterMode(display=False) as counter:
    model(ids)
print(f"FlopCounterMode: {counter.get_total_flops():,}  formula: {forward_flops(config, 1, 64):,}")
cache = model.new_cache(batch_size=2, max_seq_len=100)
element = model.lm_head.weight.element_size()
print(f"cache.nbytes / tokens = {cache.nbytes // 200:,}  "
      f"formula: {kv_cache_bytes_per_token(config, element):,} bytes/token")
plt.close("all")

# %% [markdown]
# ## Summary
# - A matmul's arithmetic intensity tends to B (the rows sharing each weight); an accelerator is
#   compute-bound only above its own intensity (H100: ~295 FLOP per byte).
# - Prefill is compute-bound (MLP intensity B·S, attention S/2); decode is memory-bound (MLP intensity B,
#   attention below 1 whatever B is, since each sequence reads its own cache).
# - Decode latency ≈ (weights + B caches) / bandwidth; throughput = B / latency grows with B until the
#   caches fill memory; GQA's smaller cache buys a larger batch.
# - Measured roofs on a shared machine move with the load: measure around the experiment, take medians,
#   and read every ratio from the same run.
#
# ## Exercises
# 1. With `sym.matmul_cost()`, find the smallest B at which X (B x 4096) @ W (4096 x 4096) in bf16 is
#    compute-bound on an H100 (intensity above `HARDWARE["H100"].accelerator_intensity`).
# 2. With `with_kv_heads` and `max_batch_size`, find the largest batch of Llama 2 13B at S = 1024 that
#    fits in an H100's 80 GB with K = 40 and with K = 8.
# 3. With `kv_cache_bytes_per_token` and `num_parameters`, find the context length S at which one
#    Llama 2 13B sequence's KV cache outweighs the bf16 weights (and at B = 64: S / 64).
#
# Worked answers: `answers/01_arithmetic_intensity.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
