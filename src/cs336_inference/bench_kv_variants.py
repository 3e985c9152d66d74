"""The KV-cache experiment: does a variant that shrinks the cache still "support long context"?

Three numbers per variant (lecture section `reduce_kv_cache_size`): quality (validation loss and
long-range recall accuracy vs distance), KV-cache bytes per token, and measured decode latency at a
long context. We train small models of each variant (MHA, GQA, MQA, MLA, sliding window, a
local/global hybrid, CLA) with the same parameter budget (d_ff absorbs the difference), the same
data, steps and seed, then measure. A second, accounting-only part plots cache bytes vs context
length for each variant at Llama-2-13B and DeepSeek-V2 scale.

`python -m cs336_inference bench kv_variants [--quick]` writes figures/kv_variants.{json,png} and
figures/kv_variants_scale.png.
"""

from __future__ import annotations

import math
import time

import torch

from . import accounting
from .benchmark import decode_step_seconds
from .config import ModelConfig
from .device import get_device, seed_everything
from .figures import save_figure, save_json
from .model import TransformerLM
from .model_shapes import REAL_MODELS, ModelShape

# The small models: a byte-level 4-layer model, N = 4 heads of H = 16 dims.
BASE = dict(vocab_size=257, context_length=256, d_model=64, num_layers=4, num_heads=4, d_ff=176)
WINDOW = 64
VARIANTS: dict[str, dict] = {
    "MHA": dict(num_kv_heads=4),
    "GQA (K=2)": dict(num_kv_heads=2),
    "MQA (K=1)": dict(num_kv_heads=1),
    "MLA (C=16, R=8)": dict(attention_type="mla", kv_lora_rank=16, rope_head_dim=8),
    f"window {WINDOW}": dict(num_kv_heads=4, sliding_window=WINDOW),
    f"hybrid (window {WINDOW}, 1 global in 2)": dict(num_kv_heads=4, sliding_window=WINDOW, global_every=2),
    "CLA (2 layers share)": dict(num_kv_heads=4, kv_share_group=2),
}

# At real scale (accounting only): each variant applied to the attention of Llama 2 13B (MHA, 40 layers)
# and of DeepSeek-V2 (MLA, 60 layers of 128 heads x 128 dims), from `model_shapes.REAL_MODELS`.
SCALE_VARIANTS = {
    "MHA": dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None),
    "GQA (K=8)": dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None, num_kv_heads=8),
    "MQA (K=1)": dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None, num_kv_heads=1),
    "MLA (C=512, R=64)": dict(attention_type="mla", kv_lora_rank=512, rope_head_dim=64),
    "window 4096": dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None, sliding_window=4096),
    "hybrid (window 1024, 1 global in 6) + GQA (K=8)": dict(
        attention_type="gqa", kv_lora_rank=None, rope_head_dim=None, num_kv_heads=8, sliding_window=1024,
        global_every=6),
    "CLA (2 layers) + GQA (K=8)": dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None,
                                       num_kv_heads=8, kv_share_group=2),
}
SCALE_MODELS = {"Llama-2-13B": "llama2-13b", "DeepSeek-V2": "deepseek-v2"}


def variant_config(overrides: dict, base: dict = BASE, budget: int | None = None) -> ModelConfig:
    """The base config with a variant's knobs; with `budget`, d_ff is set so the model's parameter
    count (embeddings included) is as close to `budget` as a whole d_ff allows."""
    config = ModelConfig(**{**base, **overrides})
    if budget is None:
        return config
    per_ff = 3 * config.d_model * config.num_layers          # w1, w2, w3 grow by D each per unit of d_ff
    params = TransformerLM(config).num_parameters()
    d_ff = max(8, config.d_ff + round((budget - params) / per_ff))
    return config.replace(d_ff=d_ff)


def scale_shapes(model: str) -> dict[str, ModelShape]:
    """Each variant applied to a real model's attention shape (its heads, head dim and layers)."""
    base = REAL_MODELS[model]
    return {name: base.replace(name=f"{base.name} {name}", num_kv_heads=kw.get("num_kv_heads", base.num_heads),
                               **{k: v for k, v in kw.items() if k != "num_kv_heads"})
            for name, kw in SCALE_VARIANTS.items()}


def cache_bytes_vs_context(lengths, bytes_per_element: int = 2) -> dict:
    """Accounting only: KV-cache bytes of one sequence vs context length at both real scales (bf16)."""
    return {title: {name: [accounting.kv_cache_bytes(shape, 1, int(S), bytes_per_element) for S in lengths]
                    for name, shape in scale_shapes(model).items()}
            for title, model in SCALE_MODELS.items()}


def recall_distances(context: int, quick: bool) -> list[int]:
    """Distances from inside the window to near the end of the context (probes need ~24 extra tokens)."""
    return [40, 96, 160, 224] if quick else [40, 64, 96, 128, 160, 192, 224]


def _train_and_measure(name: str, config: ModelConfig, train_config, train_data, val_data, distances,
                       num_trials: int, latency: dict, device) -> dict:
    from .evaluation import evaluate_lm, long_range_recall
    from .train import train_lm

    t0 = time.perf_counter()
    model, history = train_lm(config, train_config, train_data, val_data, desc=name)
    train_s = time.perf_counter() - t0
    val = evaluate_lm(model, val_data, seq_len=config.context_length, batch_size=8, max_batches=16)
    recall = long_range_recall(model, distances, num_trials=num_trials, num_items=2)
    cache = model.new_cache(1, config.context_length, dtype=torch.float32)
    assert cache.bytes_per_token == accounting.kv_cache_bytes_per_token(config, 4)
    # Latency at a long context: an untrained copy with a longer RoPE table (speed does not depend on
    # the weights); B sequences, S cached tokens, fp32.
    long_config = config.replace(context_length=latency["context"] + 64)
    timing_model = TransformerLM(long_config, device=device).eval()
    step_s = decode_step_seconds(timing_model, latency["batch_size"], context=latency["context"],
                                 steps=latency["steps"])
    long_cache = timing_model.new_cache(latency["batch_size"], latency["context"] + latency["steps"] + 4)
    return {
        "config": config.to_dict(),
        "params": model.num_parameters(),
        "train_seconds": train_s,
        "val_loss": val["loss"],
        "val_bits_per_byte": val["bits_per_byte"],
        "train_loss_last": history["train_loss"][-1],
        "recall": {str(d): acc for d, acc in recall.items()},
        "kv_bytes_per_token_fp32": cache.bytes_per_token,
        "kv_bytes_per_token_bf16": accounting.kv_cache_bytes_per_token(config, 2),
        "kv_cache_bytes_at_long_context": long_cache.nbytes,
        "decode_ms_per_step": step_s * 1e3,
    }


def bench_kv_variants(quick: bool = False, device: str | None = None) -> dict:
    """Train every variant with the same budget, measure quality / cache bytes / decode latency."""
    from .data import load_corpus
    from .train import TrainConfig

    device = get_device(device)
    seed_everything(0)
    steps = 60 if quick else 500
    train_config = TrainConfig(steps=steps, batch_size=8, seq_len=BASE["context_length"], lr=3e-3,
                               warmup_steps=max(1, steps // 10), eval_every=steps, eval_batches=4, seed=0,
                               device=str(device), progress=False)
    latency = dict(batch_size=8, context=512 if quick else 2048, steps=8 if quick else 24)
    num_trials = 16 if quick else 64
    budget = TransformerLM(variant_config(VARIANTS["MHA"])).num_parameters()
    train_data, val_data = load_corpus("train"), load_corpus("val")
    distances = recall_distances(BASE["context_length"], quick)

    results = {}
    for name, overrides in VARIANTS.items():
        config = variant_config(overrides, budget=budget)
        results[name] = _train_and_measure(name, config, train_config, train_data, val_data, distances,
                                           num_trials, latency, device)
        r = results[name]
        print(f"  {name:<36} params {r['params']:>7,}  val loss {r['val_loss']:.3f}  "
              f"recall {[round(v, 2) for v in r['recall'].values()]}  "
              f"KV {r['kv_bytes_per_token_fp32']:>5} B/token  decode {r['decode_ms_per_step']:.2f} ms", flush=True)

    lengths = [2 ** k for k in range(10, 18)]  # 1K .. 128K tokens
    scale = cache_bytes_vs_context(lengths)
    data = {
        "device": str(device), "quick": quick, "train": train_config.to_dict(), "base": BASE, "window": WINDOW,
        "budget_params": budget, "recall_distances": distances, "recall_trials": num_trials,
        "latency": latency, "variants": results,
        "scale": {"context_lengths": lengths, "bytes_per_element": 2, "bytes": scale},
        "note": "CPU shared with other jobs: latencies are medians of noisy measurements.",
    }
    print_table(data)
    path = save_json(data, "kv_variants" + ("_quick" if quick else ""))
    plot_results(data, suffix="_quick" if quick else "")
    print(f"wrote {path}")
    return data


def print_table(data: dict) -> None:
    distances = data["recall_distances"]
    head = (f"{'variant':<38} {'params':>8} {'val loss':>8} " + " ".join(f"r@{d:<4}" for d in distances)
            + f" {'KV B/tok':>9} {'ms/step':>8}")
    print(head)
    print("-" * len(head))
    for name, r in data["variants"].items():
        accs = " ".join(f"{r['recall'][str(d)]:6.2f}" for d in distances)
        print(f"{name:<38} {r['params']:>8,} {r['val_loss']:8.3f} {accs} {r['kv_bytes_per_token_fp32']:>9,} "
              f"{r['decode_ms_per_step']:8.2f}")


def plot_results(data: dict, suffix: str = "") -> None:
    import matplotlib.pyplot as plt

    window = data["window"]
    distances = data["recall_distances"]
    far = [d for d in distances if d > window]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in data["variants"].items():
        acc_far = sum(r["recall"][str(d)] for d in far) / len(far)
        ax1.scatter(r["kv_bytes_per_token_fp32"], acc_far, s=60)
        ax1.annotate(f"{name}\nloss {r['val_loss']:.2f}", (r["kv_bytes_per_token_fp32"], acc_far),
                     textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax2.plot(distances, [r["recall"][str(d)] for d in distances], marker="o", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("KV-cache bytes per token (fp32, all layers)")
    ax1.set_ylabel(f"recall accuracy, distance > window ({window})")
    ax1.set_title("quality vs cache size")
    ax2.axvline(window, color="gray", ls="--", lw=1)
    ax2.text(window, 1.02, " window", color="gray", fontsize=8)
    ax2.set_xlabel("distance from fact to query (tokens)")
    ax2.set_ylabel("recall accuracy")
    ax2.set_ylim(-0.03, 1.08)
    ax2.set_title("long-range recall vs distance")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, "kv_variants" + suffix)
    plt.close(fig)
    plot_scale(data["scale"])


def plot_scale(scale: dict) -> None:
    import matplotlib.pyplot as plt

    lengths = scale["context_lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, (model_name, curves) in zip(axes, scale["bytes"].items()):
        for name, values in curves.items():
            ax.plot(lengths, [v / 2 ** 30 for v in values], marker=".", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("KV cache of one sequence (GiB, bf16)")
        ax.set_title(f"{model_name} attention shape")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, "kv_variants_scale")
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    bench_kv_variants(quick=True)
