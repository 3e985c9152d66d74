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
# # 04 · Pruning and distillation (Minitron)
#
# A smaller model decodes faster, but training one from scratch throws away what the big model
# learned. Minitron's recipe: measure which layers, attention heads and MLP channels matter on a
# little calibration data, cut the rest, then *distill* the big model into the cut one.
#
# This notebook does every step on the shipped ~2M-parameter `target` and compares the result with
# the two shipped drafts: `draft` (pruned + distilled, made by `python -m cs336_inference train
# --preset draft`) and `draft-scratch` (same shape, trained from scratch for the same steps).

# %%
import cs336_inference
import matplotlib.pyplot as plt

from cs336_inference import get_device, seed_everything
from cs336_inference.model import checkpoints
from cs336_inference.data import TrainConfig, compare_to_reference, evaluate_lm, load_corpus
from cs336_inference.figures import save_figure
from cs336_inference.compression import distill, importance_scores, prune_model

device = get_device("cpu")  # the shipped models are tiny: the CPU is the fair place to run them
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)
target = checkpoints.load_pretrained("target")
draft = checkpoints.load_pretrained("draft")
scratch = checkpoints.load_pretrained("draft-scratch")
for name, m in [("target", target), ("draft", draft), ("draft-scratch", scratch)]:
    c = m.config
    print(f"{name:14s} L={c.num_layers} D={c.d_model} N={c.num_heads} K={c.num_kv_heads} F={c.d_ff} "
          f"params={m.num_parameters():,}")

# %% [markdown]
# ## 1. Importance from activations
# Forward passes over 16 calibration windows, no gradients. Heads are scored by the norm of their
# output; with GQA, a KV group's score is the sum over its query heads, and groups are kept or
# cut whole. Layers are scored by how much the loss rises when the layer is skipped.

# %%
calibration = load_corpus("train")[: 16 * 257].view(16, 257)
scores = importance_scores(target, calibration)
fig, ax = plt.subplots(1, 3, figsize=(13, 3.2))
ax[0].bar(range(target.config.num_layers), scores["layers"])
ax[0].set(title="layer: loss increase when skipped", xlabel="layer", ylabel="nats")
ax[1].imshow(scores["heads"], cmap="viridis")
ax[1].set(title="head output norm", xlabel="query head", ylabel="layer")
for i in range(target.config.num_layers):
    ax[2].plot(sorted(scores["mlp"][i].tolist(), reverse=True), label=f"layer {i}")
ax[2].set(title="MLP channel importance (sorted)", xlabel="rank", yscale="log")
ax[2].legend(fontsize=7)
save_figure(fig, "04_pruning_importance")
print("layer loss increase:", [round(float(v), 3) for v in scores["layers"]])
print("KV-group scores:\n", scores["kv_groups"])

# %% [markdown]
# ## 2. Prune to the draft's shape, then repair by distillation
# The pruned model keeps the original weights of everything it keeps (the rows and columns of the
# kept heads and channels: the shapes below), so it starts far better than a random model but far
# worse than the target. A few distillation steps (KL to the target's
# next-token distribution) recover much of the gap; the shipped draft ran the full recipe.

# %%
d = draft.config
pruned = prune_model(target, calibration, num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                     num_heads=d.num_heads, d_ff=d.d_ff, scores=scores)
for key in ("attn.q_proj", "attn.k_proj", "ffn.w1", "ffn.w2"):
    print(f"layers.0.{key}: {tuple(target.get_submodule(f'layers.0.{key}').weight.shape)} -> "
          f"{tuple(pruned.get_submodule(f'layers.0.{key}').weight.shape)}")
print(f"{target.num_parameters():,} -> {pruned.num_parameters():,} parameters")
val = load_corpus("val")
quick = dict(seq_len=256, batch_size=4, max_batches=4)
before = compare_to_reference(pruned, target, val, **quick)
cfg = TrainConfig(steps=30, batch_size=4, seq_len=256, lr=3e-3, warmup_steps=5, eval_every=30, eval_batches=1,
                  progress=False, num_threads=1)
repaired = prune_model(target, calibration, num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                       num_heads=d.num_heads, d_ff=d.d_ff, scores=scores)
distill(repaired, target, cfg)
after = compare_to_reference(repaired, target, val, **quick)
print(f"KL to target: pruned {before['kl']:.3f} -> after 30 distillation steps {after['kl']:.3f} nats")

# %%
rows = {"target": target, "pruned (no repair)": pruned, "pruned + 30 steps": repaired,
        "draft (shipped)": draft, "draft-scratch (shipped)": scratch}
results = {}
for name, m in rows.items():
    results[name] = (evaluate_lm(m, val, **quick)["bits_per_byte"],
                     compare_to_reference(m, target, val, **quick)["top1_agreement"])
    print(f"{name:26s} val bits/byte {results[name][0]:.3f}   top-1 agreement with target {results[name][1]:.3f}")
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.barh(list(results), [v[0] for v in results.values()])
ax.set(xlabel="validation bits per byte (lower is better)", title="pruning, distillation, scratch")
ax.invert_yaxis()
save_figure(fig, "04_pruning_bpb")

# %% [markdown]
# The distilled draft agrees with the target more often than the from-scratch draft: exactly the
# property speculative decoding rewards, since a draft token is accepted with probability
# min(1, q/p), which is high where the draft's distribution matches the target's.

# %% [markdown]
# ## Summary
# - Importance comes from activations on a little calibration data: head output norms (a GQA group is
#   kept or cut whole), MLP channel magnitudes, and the loss increase when a layer is skipped.
# - Pruning keeps the original weights of what it keeps; distillation (KL to the target's next-token
#   distribution) repairs the rest, and beats training the same shape from scratch for the same steps.
# - A distilled draft agrees with the target more often, which is exactly what speculative decoding
#   turns into accepted tokens.
#
# ## Exercises
# 1. Halve the MLP (`prune_model(target, calibration, d_ff=F // 2, scores=scores)`) and compare its bits
#    per byte (`evaluate_lm`) with the same cut on random channel scores (replace `scores["mlp"]`).
# 2. Predict `pruned.num_parameters()` from its config: 2VD + L(3DF + 2DNH + 2DKH + 2D) + D (embedding and
#    lm_head, MLP, attention, the two norms per layer and the final one).
# 3. Drop one layer with `prune_model(..., num_layers=L - 1)`: it removes the layer `scores["layers"]`
#    ranks lowest. Compare with dropping the highest-ranked one (negate the layer scores).
#
# Worked answers: `answers/04_pruning_distillation.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
