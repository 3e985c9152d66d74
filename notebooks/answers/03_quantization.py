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
# # 03 · Quantization: worked answers
#
# The exercises of `../03_quantization.ipynb`, answered step by step. Try them first; each answer here is
# checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
import cs336_inference
import torch

from cs336_inference.data import load_corpus
from cs336_inference.model import load_pretrained
from cs336_inference.quantization import (capture_linear_inputs, gptq_quantize, layer_output_error, pack_int4,
                                          quantize_tensor, unpack_int4)

cs336_inference.apply_thread_policy()
model = load_pretrained("target")
w = model.layers[0].ffn.w1.weight.detach().clone()   # the notebook's weight matrix (F x D)

# %% [markdown]
# ## Exercise 1: one outlier and the scale it shares
# Put 100 into row 0 and quantize to int8 (symmetric, absmax) with one scale for the whole tensor and
# with one scale per row (channel); measure the error of every *other* row.

# %%
spiked = w.clone()
spiked[0, 0] = 100.0


def mse_of_other_rows(x, granularity):
    return float((quantize_tensor(x, 8, True, granularity).dequantize() - x)[1:].pow(2).mean())


other_rows_mse = {(name, g): mse_of_other_rows(x, g) for name, x in (("plain", w), ("spiked", spiked))
                  for g in ("tensor", "channel")}
for key, mse in other_rows_mse.items():
    print(key, f"{mse:.3e}")
zeroed = float((quantize_tensor(spiked, 8, True, "tensor").dequantize()[1:] == 0).float().mean())
print(f"per tensor, spiked: {zeroed:.0%} of the other weights round to 0 "
      f"(largest ordinary |w| {float(w[1:].abs().max()):.3f} < half a step {100 / 127 / 2:.3f})")

# %% [markdown]
# Per channel, row 0's scale absorbs the outlier and the other rows do not notice (the same error as
# without the spike). Per tensor, the one scale becomes 100 / 127: every ordinary weight is smaller than
# half a step, rounds to 0, and the error of those rows is the weights themselves. That is the outlier
# problem LLM.int8() solves for activations (and why weights get per-channel or per-group scales).
#
# ## Exercise 2: int4 packing
# Two 4-bit codes per byte: every code in [-8, 7] must come back, in half the bytes of int8.

# %%
codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)   # every code, (3, 32)
packed = pack_int4(codes)
round_trip_ok = torch.equal(unpack_int4(packed), codes)
print(packed.dtype, tuple(packed.shape), f"{packed.nbytes} bytes vs {codes.nbytes}; round trip: {round_trip_ok}")

# %% [markdown]
# ## Exercise 3: does GPTQ's gain hold on text it was not calibrated on?
# Calibrate on training text, then measure the layer's output error on validation text.

# %%
name = "layers.0.ffn.w2"


def layer_inputs(split):
    data = load_corpus(split)
    starts = torch.linspace(0, data.numel() - 129, 4).long().tolist()
    return capture_linear_inputs(model, [name], [torch.stack([data[s:s + 128] for s in starts])])[0][name]


calibration, held_out = layer_inputs("train"), layer_inputs("val")
weight = model.get_submodule(name).weight.detach()
rtn_weight = quantize_tensor(weight, 3, False, "channel").dequantize()
gptq_weight = gptq_quantize(weight, inputs=calibration, bits=3).quantized.dequantize()
held_out_error = {"rtn": layer_output_error(weight, rtn_weight, held_out),
                  "gptq": layer_output_error(weight, gptq_weight, held_out)}
print({k: round(v, 3) for k, v in held_out_error.items()})

# %% [markdown]
# It holds: GPTQ's error on unseen text stays well below round-to-nearest's. GPTQ uses the inputs only
# through H = 2 X^T X / n, the layer's input statistics, and those are much the same on any text of the
# same kind: it fits the layer, not the calibration sentences.
