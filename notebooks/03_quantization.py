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
# # 03 · Quantization: from one number to a quantized model
#
# Batch-1 decode is memory-bound: every step streams every weight from memory. Storing weights in
# fewer bits moves fewer bytes per token. This notebook starts with one number (scale and zero
# point), grows it to tensors (granularity, packing, fp8), meets the two problems that make naive
# quantization fail on real models (outlier activations, accumulated rounding error) and the
# methods that fix them (LLM.int8(), GPTQ, AWQ, QAT), shows the committed table of every method on
# the shipped target model (`python -m cs336_inference bench quantization`), and ends on a real
# pretrained model, SmolLM2-135M, and real English text (`bench quantization_smollm2`).

# %%
import cs336_inference
import statistics
import time

import matplotlib.pyplot as plt
import torch

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate, get_device, seed_everything
from cs336_inference.data.real_text import pydoc_documents
from cs336_inference.generation import decode_one_token
from cs336_inference.model import load_pretrained, load_tokenizer
from cs336_inference.model.gguf import gguf_round_trip
from cs336_inference.model.real_models import real_model_missing
from cs336_inference.tables import quantization_smollm2_table
from cs336_inference.timing import num_threads
from cs336_inference.data import load_corpus
from cs336_inference.figures import load_result, save_figure
from cs336_inference.quantization import (
    awq_search_scales, capture_linear_inputs, count_activation_outliers, dequantize, fp8_range, fp8_round_trip,
    gptq_quantize, layer_output_error, model_nbytes, pack_int4, planted_outlier_demo, qrange, quantize,
    quantize_kv_cache, quantize_model, quantize_tensor,
)

device = get_device("cpu")  # the table below was measured on the CPU; everything here is cheap
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)

# %% [markdown]
# ## One number
# `q = round(x / scale) + zero_point`, and back: `x_hat = (q - zero_point) * scale`. The lecture's
# example: x = 5.2342 with scale 0.1 and zero point 4.

# %%
q = quantize(torch.tensor(5.2342), scale=0.1, zero_point=4)
x_hat = dequantize(q, 0.1, 4)
print(f"q = {int(q)}, x_hat = {float(x_hat):.4f}, error = {5.2342 - float(x_hat):.4f} (at most scale/2 = 0.05)")

# %% [markdown]
# ## Number formats
# Floating-point formats spend bits on an exponent (range) and a mantissa (precision); integers
# spread their codes evenly and need a scale. Note the two fp8 e4m3 variants: H100's e4m3 is torch's
# `float8_e4m3fn`, whose maximum is 448; the ±240 the official lecture quotes "on H100s" is the maximum of
# `float8_e4m3fnuz`, the variant of some other accelerators (e.g. AMD MI300).

# %%
rows = []
for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                    ("fp8 e4m3fn", torch.float8_e4m3fn), ("fp8 e4m3fnuz", torch.float8_e4m3fnuz),
                    ("fp8 e5m2", torch.float8_e5m2)]:
    info = torch.finfo(dtype)
    rows.append((name, info.bits // 8, f"±{info.max:.4g}", f"{info.eps:.3g}"))
for bits in (8, 4, 3):
    lo, hi = qrange(bits, symmetric=True)
    rows.append((f"int{bits}", bits / 8, f"[{lo}, {hi}]", "uniform (needs a scale)"))
print(f"{'format':<14}{'bytes':>6}  {'range':<18}eps")
for name, nbytes, rng, eps in rows:
    print(f"{name:<14}{nbytes:>6}  {rng:<18}{eps}")
assert fp8_range("e4m3")[1] == 448 and fp8_range("e4m3fnuz")[1] == 240

# %% [markdown]
# ## A weight matrix: granularity
# The shipped target model's first SwiGLU matrix. One scale for the whole tensor is set by its
# single largest entry; one per output row (channel) or per group of input columns follows the
# local range. Smaller groups cost one more scale (and zero point) per group.

# %%
model = load_pretrained("target", device=device)
config = model.config
print(config)
w = model.layers[0].ffn.w1.weight.detach()
choices = [("tensor", None), ("channel", None)] + [("group", g) for g in (128, 32) if w.shape[1] % g == 0]
labels = [kind if g is None else f"group {g}" for kind, g in choices]
fig, ax = plt.subplots(figsize=(7, 3.5))
for k, bits in enumerate((8, 4, 3)):
    mses = [float((quantize_tensor(w, bits, False, kind, g).dequantize() - w).pow(2).mean()) for kind, g in choices]
    ax.bar([i + 0.27 * k for i in range(len(choices))], mses, width=0.27, label=f"int{bits}")
    print(f"int{bits} weight MSE:", ", ".join(f"{lab} {m:.2e}" for lab, m in zip(labels, mses)))
ax.set_xticks([i + 0.27 for i in range(len(choices))], labels)
ax.set_yscale("log")
ax.set_ylabel("weight MSE")
ax.set_title("RTN error of layers.0.ffn.w1 by granularity (affine)")
ax.legend()
save_figure(fig, "03_quantization_granularity")

# %% [markdown]
# ## Real bytes: packing two int4 codes per byte
# PyTorch has no int4 dtype; kept in int8, a "4-bit" weight would still cost a byte. Packing puts
# two codes in each byte, so a quantized model's measured size is its true size.

# %%
codes = quantize_tensor(w, 4, True, "channel").q
packed = pack_int4(codes)
print(f"int8 storage {codes.to(torch.int8).nbytes:,} B -> packed {packed.nbytes:,} B; fp32 {w.nbytes:,} B")

# %% [markdown]
# fp8 keeps one scale but a non-uniform grid: e4m3 (3 mantissa bits) is the usual choice for
# weights and activations, e5m2 trades precision for range (gradients).

# %%
for fmt in ("e4m3", "e5m2"):
    err = float((fp8_round_trip(w, fmt, per_channel=True) - w).pow(2).mean())
    print(f"fp8 {fmt} per-channel weight MSE {err:.2e}")

# %% [markdown]
# ## Outliers: why absmax int8 breaks, and LLM.int8()
# In large models a few hidden dimensions carry activations 20-100x larger than the rest. With one
# absmax scale per token, those values stretch the scale so far that ordinary entries round to 0.
# LLM.int8() sends the outlier columns (|x| > 6) through a high-precision matmul.

# %%
demo = planted_outlier_demo()
print(demo)
assert demo["llm_int8_rel_error"] < demo["plain_int8_rel_error"] / 5

# %% [markdown]
# ## GPTQ and AWQ on one layer, with calibration text
# Calibration inputs of `layers.0.ffn.w2` (the SwiGLU down projection) from 8 training windows.
# GPTQ quantizes column by column and pushes each column's error onto the columns not yet
# quantized (weighted by the inverse Hessian 2XᵀX/n); AWQ scales up the input channels with the
# largest activations before rounding. Both are judged by the layer's output error ‖XWᵀ − XŴᵀ‖.

# %%
train = load_corpus("train")
starts = torch.linspace(0, train.numel() - 257, 8).long().tolist()
calib = [torch.stack([train[s:s + 256] for s in starts])]
name = "layers.0.ffn.w2"
x = capture_linear_inputs(model, [name], calib)[0][name]
w2 = model.get_submodule(name).weight.detach()
g = 128 if w2.shape[1] % 128 == 0 else None
for bits in (4, 3):
    rtn = quantize_tensor(w2, bits, False, "group" if g else "channel", g).dequantize()
    gptq = gptq_quantize(w2, inputs=x, bits=bits, group_size=g).quantized.dequantize()
    s = awq_search_scales(w2, x, bits, g).scales
    awq = quantize_tensor(w2 * s, bits, False, "group" if g else "channel", g).dequantize() / s
    errs = {k: layer_output_error(w2, v, x) for k, v in (("RTN", rtn), ("GPTQ", gptq), ("AWQ", awq))}
    print(f"int{bits}: layer output error", {k: f"{v:.3f}" for k, v in errs.items()})

# %% [markdown]
# ## A quantized model runs unchanged
# `quantize_model` replaces every linear of the transformer blocks by a `QuantizedLinear` holding
# packed codes (two 4-bit codes per byte: D/2 bytes per row), one scale and one zero point per group
# of 32 inputs (embedding and lm_head stay fp32 by default). Prefill, decode and `generate` do not
# know the difference.

# %%
q_model = quantize_model(model, "rtn", bits=4, group_size=32)
layer = q_model.layers[0].ffn.w1
print(f"{type(layer).__name__} for w1 (F x D = {tuple(model.layers[0].ffn.w1.weight.shape)}): "
      + ", ".join(f"{n} {tuple(b.shape)} {str(b.dtype).removeprefix('torch.')}"
                  for n, b in layer.named_buffers() if b is not None))
tok = ByteTokenizer()
prompt = tok.encode("Once upon a time")
for label, m in (("fp32", model), ("int4 RTN g32", q_model)):
    out = generate(m, [prompt], max_new_tokens=40)
    print(f"{label:>14} ({model_nbytes(m) / 1e6:.2f} MB): {tok.decode(out.tokens[0])!r}")

# %% [markdown]
# The KV cache can be stored in 8 bits too (one fp16 scale per token and head):

# %%
cache = model.new_cache(1)
q_cache = quantize_kv_cache(model.new_cache(1))
print(f"KV bytes per token: fp32 {cache.bytes_per_token}, int8 {q_cache.bytes_per_token} "
      f"({cache.bytes_per_token / q_cache.bytes_per_token:.1f}x smaller)")

# %% [markdown]
# ## The table
# Every method on the target model, measured by `python -m cs336_inference bench quantization`
# and committed as `figures/quantization.json` (re-running it takes a few minutes on 2 cores).
# bits per byte (bpb) on the validation split; KL(fp32 ‖ quantized) and top-1 agreement against
# the fp32 model on the same tokens. (Speed comes in the next section, on a model too big for the caches.)

# %%
table = load_result("quantization")  # figures/quantization.json
print(f"{table['model']}: {table['parameters']:,} parameters, eval on {table['eval_tokens']:,} tokens")
print(f"{'variant':<22}{'MB':>7}{'bpb':>8}{'Δbpb':>8}{'KL':>8}{'top1':>7}")
for r in table["rows"]:
    print(f"{r['variant']:<22}{r['model_bytes'] / 1e6:>7.2f}{r['val_bits_per_byte']:>8.4f}"
          f"{r['delta_bits_per_byte']:>+8.4f}{r['kl_to_fp32']:>8.4f}{r['top1_agreement']:>7.3f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4.5))
for r in table["rows"]:
    if r["method"] == "kv_int8":
        continue
    ax.scatter(r["model_bytes"] / 1e6, r["kl_to_fp32"] + 1e-5, s=30)
    ax.annotate(r["variant"], (r["model_bytes"] / 1e6, r["kl_to_fp32"] + 1e-5), fontsize=7)
ax.set_yscale("log")
ax.set_xlabel("model MB (measured)")
ax.set_ylabel("KL(fp32 || quantized), nats/token")
ax.set_title("Quality vs bytes on the target model")
save_figure(fig, "03_quantization_kl_vs_bytes")

# %% [markdown]
# **Reading the table.** Bytes shrink with the bit width (the fp32 embedding and lm_head stay, so
# the ratio is below 32/bits). int8 and fp8 are nearly free in quality; at 4 and especially 3 bits
# round-to-nearest loses visibly; GPTQ (calibrated) and QAT (a short fine-tune) win much of it
# back, while AWQ, built for the few salient activation channels of large models, gains little on
# this 2M-parameter model.

# %% [markdown]
# ## Fewer bytes, faster decode
# Speed shows only when decode streams the weights from memory, so we time a ~90M-parameter model
# (random weights: speed does not depend on what they are), ~330 MB in fp32, far larger than the
# CPU caches. How a quantized layer multiplies matters as much as its bytes: the readable
# `kernel="reference"` dequantizes the whole weight and then runs an ordinary matmul, writing and
# re-reading a full-precision matrix every step; the default kernel hands the packed codes to
# torch's int4pack / int8pack matmuls, which dequantize in registers (with bf16 activations). (The
# CLI's fast path adds its own int4 kernel for CPUs with bf16 dot products: `cs336_inference.workshop`.)
# Variants alternate round by round (the machine is shared) on one thread; medians are printed.

# %%
seed_everything(0)
big = TransformerLM(ModelConfig.from_name("bench-90m")).eval()
variants = {"fp32": big,
            "int8": quantize_model(big, "rtn", bits=8, group_size=None, symmetric=True, quantize_lm_head=True),
            "int4": quantize_model(big, "rtn", bits=4, group_size=128, quantize_lm_head=True),
            "int4 (reference kernel)": quantize_model(big, "rtn", bits=4, group_size=128, quantize_lm_head=True,
                                                      kernel="reference")}


@torch.inference_mode()
def ms_per_step(m, steps=8):
    cache = m.new_cache(1, 32 + steps + 2)
    m(torch.randint(0, m.config.vocab_size, (1, 32)), cache=cache)
    token = torch.zeros(1, dtype=torch.long)
    decode_one_token(m, token, cache)   # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        decode_one_token(m, token, cache)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


measured = {name: [] for name in variants}
with num_threads(1):
    for _ in range(3):
        for name, m in variants.items():
            measured[name].append(ms_per_step(m))
ms = {name: statistics.median(v) for name, v in measured.items()}
for name, m in variants.items():
    print(f"{name:<24} {model_nbytes(m) / 1e6:7.1f} MB  {ms[name]:6.1f} ms/token "
          f"({min(measured[name]):.1f}..{max(measured[name]):.1f})  {ms['fp32'] / ms[name]:.2f}x the fp32 speed")
faster = [name for name in ("int8", "int4") if ms[name] < ms["fp32"]]
print(f"this run: packed {' and '.join(faster)} decoded faster than fp32" if faster else
      "this run: neither packed kernel beat fp32 (a busy machine can hide it: rerun, or see bench generation)")
print("this run: the reference kernel was " + ("slower" if ms["int4 (reference kernel)"] > ms["fp32"] else
                                                "not slower") + " than fp32")

# %% [markdown]
# **Reading the numbers** (the printout says what this run measured; the committed `bench generation`
# run shows the same). With the packed kernels int8 and int4 decode faster than fp32, though not by the
# full 4x / 8x of the bytes: unpacking the codes costs compute (on
# one CPU core int4 can even land close to int8), and the rest of the step (attention, norms, Python)
# does not shrink. The same int4 model with the
# reference kernel is the slowest of all: it moves *more* bytes than fp32, since it writes out the
# dequantized weight before reading it again. `python -m cs336_inference bench generation` measures
# the full picture (bf16, batch 8, compiled steps, Hugging Face on the same weights, the bandwidth
# roof); on a GPU the same kernels run with no code change.

# %% [markdown]
# ## A real model on real text: SmolLM2-135M
# The shipped target is too small to have outlier activations or to suffer much from rounding. A
# model trained for real does. SmolLM2-135M-Instruct is published as a GGUF file whose weights are
# *already* 4-bit: Q4_1, blocks of 32 weights with an fp16 scale d and an fp16 minimum m,
# w = d·q + m. We dequantize them to fp32 and use that as the reference.
#
# First lesson: quantizing an already-quantized weight on *its own* grid changes nothing, on another
# grid it adds a second rounding error.

# %%
missing = real_model_missing("smollm2-135m")  # None when the wheel is installed, else how to install it
have_smollm2 = missing is None
if missing:
    print(missing)
if have_smollm2:
    smol = load_pretrained("smollm2-135m", device=device)
    w = smol.layers[0].ffn.w1.weight.detach()
    again = gguf_round_trip(w, "Q4_1")  # llama.cpp's own quantizer (the gguf package)
    ours = quantize_tensor(w, bits=4, symmetric=False, granularity="group", group_size=32).dequantize()
    print(f"Q4_1 again: identical = {torch.equal(again, w)}; our affine int4 g32: "
          f"{(ours != w).float().mean():.0%} of weights moved, relative RMS {(ours - w).norm() / w.norm():.1%}")

# %% [markdown]
# Second lesson: real activations have outliers. LLM.int8() keeps the feature dims holding any
# |x| > 6 in 16 bits; here is how many such dims enter each layer's linears on 128 tokens of English.

# %%
if have_smollm2:
    smol_tok = load_tokenizer("smollm2-135m")
    sample = torch.tensor([smol_tok.encode(pydoc_documents("eval")[0])[:128]])
    stats = count_activation_outliers(smol, [sample], threshold=6.0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for kind in ("attn_in", "attn_out", "mlp_in", "mlp_down"):
        ax.plot([layer[kind]["outlier_dims"] for layer in stats], "o-", ms=3, label=kind)
    ax.set_xlabel("layer")
    ax.set_ylabel("dims with any |x| > 6")
    ax.legend()
    save_figure(fig, "03_quantization_smollm2_outliers")
    peak = max(layer["mlp_down"]["max_abs"] for layer in stats)
    print(f"largest |activation| entering an MLP down projection: {peak:.0f}")

# %% [markdown]
# The committed table (`python -m cs336_inference bench quantization_smollm2`): every method on
# held-out text from CPython's documentation, against the published model. Groups of 128 do not
# divide D = 576, so the "g128" methods use groups of 96.

# %%
real = load_result("quantization_smollm2")
if real is not None:
    print(f"{real['model']}, {real['eval_tokens']:,} eval tokens, {real['calibration_tokens']:,} calibration tokens")
    print(quantization_smollm2_table(real))
else:
    print("no committed results: run `python -m cs336_inference bench quantization_smollm2 --quick`")

# %% [markdown]
# ![quality vs bytes and outliers per layer on SmolLM2](../figures/quantization_smollm2.png)
#
# Reading it: bf16, int8 and fp8 are close to free; LLM.int8()'s mixed precision handles the real
# outliers; re-quantizing the published 4-bit weights on llama.cpp's grid is exact, on our grid it
# costs visibly; at 3 bits the calibrated methods matter. The int8 KV cache costs almost nothing.

# %% [markdown]
# ## Summary
# - q = round(x / scale) + zero_point: the scale sets the step, and the error per entry is at most half
#   a step; per-channel and per-group scales follow the local range at the cost of storing more scales.
# - Fewer bits are fewer bytes only when the codes are packed (two int4 per byte), and fewer milliseconds
#   only when the kernel reads the packed codes (dequantizing first moves *more* bytes).
# - Real models have outlier activations (LLM.int8() keeps those columns in 16 bits) and salient input
#   channels (AWQ scales them); calibrated methods (GPTQ, AWQ) and QAT win back what round-to-nearest
#   loses at 3-4 bits. Judge quality by KL to the full model on real text, not by one task.
#
# ## Exercises
# 1. Put one large value (100) into row 0 of `w` and compare, with `quantize_tensor(w, 8, True, ...)`, the
#    error of the *other* rows per tensor and per channel. What happens to the ordinary weights?
# 2. Check that `pack_int4` / `unpack_int4` round-trip every code in [-8, 7] and halve the bytes.
# 3. GPTQ is calibrated on training text: with `capture_linear_inputs` on the `"val"` split, check whether
#    its gain over round-to-nearest (`layer_output_error`) on `layers.0.ffn.w2` at int3 holds on text it
#    was not calibrated on.
#
# Worked answers: `answers/03_quantization.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
