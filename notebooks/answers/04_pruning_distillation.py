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
# # 04 · Pruning and distillation: worked answers
#
# The exercises of `../04_pruning_distillation.ipynb`, answered step by step. Try them first; each answer
# here is checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
import cs336_inference
import torch

from cs336_inference.compression import importance_scores, prune_model
from cs336_inference.data import evaluate_lm, load_corpus
from cs336_inference.model import checkpoints

cs336_inference.apply_thread_policy()
target = checkpoints.load_pretrained("target")
calibration = load_corpus("train")[: 4 * 257].view(4, 257)   # 4 sequences (the notebook uses 16)
scores = importance_scores(target, calibration)
val = load_corpus("val")


def bits_per_byte(model):
    return evaluate_lm(model, val, seq_len=256, batch_size=4, max_batches=2)["bits_per_byte"]


# %% [markdown]
# ## Exercise 1: importance against random channels
# Halve the MLP twice: keep the channels `scores["mlp"]` ranks highest, and keep random ones.

# %%
F = target.config.d_ff
by_importance = prune_model(target, calibration, d_ff=F // 2, scores=scores)
random_scores = dict(scores, mlp=torch.rand(scores["mlp"].shape, generator=torch.Generator().manual_seed(0)))
at_random = prune_model(target, calibration, d_ff=F // 2, scores=random_scores)
halved_bpb = {"target": bits_per_byte(target), "by importance": bits_per_byte(by_importance),
              "at random": bits_per_byte(at_random)}
print({k: round(v, 3) for k, v in halved_bpb.items()})

# %% [markdown]
# Both cuts cost something (nothing is repaired yet), but the channels with the largest activations
# carry more of the function: cutting by importance loses clearly less than cutting at random.
#
# ## Exercise 2: the pruned model's parameters, from its config
# Embedding and lm_head (2VD, untied), per layer the MLP (3DF), the attention projections (2DNH for Q and
# the output, 2DKH for K and V) and two RMSNorm weights (2D), and the final norm (D).

# %%
pruned = prune_model(target, calibration, num_layers=3, num_kv_heads=1, d_ff=320, scores=scores)
c = pruned.config
V, D, Fp, N, K, H, L = c.vocab_size, c.d_model, c.d_ff, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
predicted_parameters = 2 * V * D + L * (3 * D * Fp + 2 * D * N * H + 2 * D * K * H + 2 * D) + D
print(f"predicted {predicted_parameters:,}, counted {pruned.num_parameters():,}")

# %% [markdown]
# ## Exercise 3: drop the least important layer, then the most important one
# `prune_model(..., num_layers=L - 1)` removes the layer whose skipping raised the calibration loss
# least; negating the layer scores removes the one that matters most.

# %%
L0 = target.config.num_layers
least = prune_model(target, calibration, num_layers=L0 - 1, scores=scores)
most = prune_model(target, calibration, num_layers=L0 - 1, scores=dict(scores, layers=-scores["layers"]))
dropped_bpb = {"least important dropped": bits_per_byte(least), "most important dropped": bits_per_byte(most)}
print("layer scores (loss increase when skipped):", [round(float(v), 3) for v in scores["layers"]])
print({k: round(v, 3) for k, v in dropped_bpb.items()})

# %% [markdown]
# The layer scores are far apart, and so are the results: dropping the least important layer costs
# little, dropping the most important one (here the first) wrecks the model. The score measured on
# a few calibration sequences predicts the damage.
