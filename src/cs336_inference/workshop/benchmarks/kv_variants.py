"""`bench kv_variants`: does a variant that shrinks the KV cache still "support long context"?

Small models of each variant (MHA, GQA, MQA, MLA, sliding window, local/global hybrid, CLA) train with
the same parameter budget (d_ff absorbs the difference), data, steps and seed; then quality (validation
loss, long-range recall against distance, also per digit), KV bytes per token and decode latency at a
long context, timed side by side. An accounting-only part (`accounting.kv_variants`) draws cache bytes
against context at Llama-2-13B and DeepSeek-V2 scale.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch

from ...accounting import formulas as accounting
from ...accounting.kv_variants import SCALE_MODELS, SCALE_VARIANTS, cache_bytes_vs_context
from ...accounting.model_roofline import decode_step_seconds
from ...accounting.plots import plot_cache_vs_context
from ...model.config import ModelConfig
from ...model.transformer import TransformerLM
from ...tables import kv_variants_table, ordered_variants
from .base import Benchmark

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


def _train_and_measure(name: str, config: ModelConfig, train_config, train_data, val_data, distances,
                       num_trials: int) -> dict:
    from ...data.evaluation import evaluate_lm, long_range_recall, recall_digit_scores
    from ...data.training import train_lm

    t0 = time.perf_counter()
    model, history = train_lm(config, train_config, train_data, val_data, desc=name)
    train_s = time.perf_counter() - t0
    val = evaluate_lm(model, val_data, seq_len=config.context_length, batch_size=8, max_batches=16)
    recall = long_range_recall(model, distances, num_trials=num_trials, num_items=2)
    digits = recall_digit_scores(model, distances, num_trials, num_items=2)
    cache = model.new_cache(1, config.context_length, dtype=torch.float32)
    assert cache.bytes_per_token == accounting.kv_cache_bytes_per_token(config, 4)
    return {"config": config.to_dict(), "params": model.num_parameters(), "train_seconds": train_s,
            "val_loss": val["loss"], "val_bits_per_byte": val["bits_per_byte"],
            "train_loss_last": history["train_loss"][-1], "recall": {str(d): acc for d, acc in recall.items()},
            "recall_digits": digits, "kv_bytes_per_token_fp32": cache.bytes_per_token,
            "kv_bytes_per_token_bf16": accounting.kv_cache_bytes_per_token(config, 2),
            "kv_cache_bytes_at_context": cache.nbytes}          # one sequence of context_length tokens, fp32


def measure_decode_latency(configs: dict[str, ModelConfig], latency: dict, device, rounds: int = 3) -> dict:
    """Median decode step time of each variant at a long context, every variant once per round (load
    on a shared machine hits all alike), on untrained copies (speed does not depend on the weights);
    B sequences, S cached tokens, fp32. MLA also through its naive (up-projecting) path."""
    B, S, steps = latency["batch_size"], latency["context"], latency["steps"]
    models = {name: TransformerLM(cfg.replace(context_length=S + steps + 8), device=device).eval()
              for name, cfg in configs.items()}
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, model in models.items():
            paths = [("", True)] + ([("_naive_mla", False)] if model.config.attention_type == "mla" else [])
            for suffix, absorb in paths:
                for block in model.layers:
                    if hasattr(block.attn, "absorb"):
                        block.attn.absorb = absorb
                times.setdefault(name + suffix, []).append(decode_step_seconds(model, B, context=S, steps=steps))
    out = {}
    for name, model in models.items():
        cache = model.new_cache(B, S + steps + 4)
        out[name] = {"decode_ms_per_step": 1e3 * statistics.median(times[name]),
                     "decode_ms_rounds": [1e3 * t for t in times[name]],
                     "kv_cache_bytes_at_long_context": cache.nbytes}
        if name + "_naive_mla" in times:
            out[name]["decode_ms_per_step_naive_mla"] = 1e3 * statistics.median(times[name + "_naive_mla"])
    return out


def measure(run) -> dict:
    """Train every variant with the same budget, measure quality / cache bytes / decode latency."""
    from ...data.corpus import load_corpus
    from ...data.training import TrainConfig

    quick, device = run.quick, run.device
    steps = 20 if quick else 100   # 2 shared CPU cores: each variant trains for a minute or two
    train_config = TrainConfig(steps=steps, batch_size=8, seq_len=BASE["context_length"], lr=5e-3,
                               warmup_steps=max(1, steps // 10), eval_every=steps, eval_batches=4, seed=0,
                               device=str(device), progress=False)
    latency = dict(batch_size=8, context=256 if quick else 1024, steps=8 if quick else 16,
                   cpu_threads=torch.get_num_threads())
    num_trials = 8 if quick else 32
    budget = TransformerLM(variant_config(VARIANTS["MHA"])).num_parameters()
    train_data, val_data = load_corpus("train"), load_corpus("val")
    # from inside the window (a 2-fact probe needs >= ~50) to near the end of the context
    distances = [56, 96, 160, 224] if quick else [56, 80, 96, 128, 160, 192, 224]
    results, configs = {}, {}
    for name, overrides in VARIANTS.items():
        configs[name] = variant_config(overrides, budget=budget)
        results[name] = r = _train_and_measure(name, configs[name], train_config, train_data, val_data,
                                               distances, num_trials)
        print(f"  {name:<36} params {r['params']:>7,}  val loss {r['val_loss']:.3f}  "
              f"recall {[round(v, 2) for v in r['recall'].values()]}", flush=True)
    for name, timing in measure_decode_latency(configs, latency, device).items():
        results[name].update(timing)
    lengths = [2 ** k for k in range(10, 18)]  # 1K .. 128K tokens
    return {"device": str(device), "train": train_config.to_dict(), "base": BASE, "window": WINDOW,
            "budget_params": budget, "recall_distances": distances, "recall_trials": num_trials,
            "latency": latency, "variants": results, "variant_order": list(results),
            "scale": {"context_lengths": lengths, "bytes_per_element": 2, "bytes": cache_bytes_vs_context(lengths)},
            "note": "CPU shared with other jobs: latencies are medians of noisy measurements."}


def plot_results(data: dict):
    """Left: recall beyond the window against the cache bytes of one full-context sequence; right:
    recall against distance. Variants that coincide (these tiny models mostly score 0) are drawn from
    the widest marker and line down, so each one stays visible under the next."""
    window, distances, context = data["window"], data["recall_distances"], data["base"]["context_length"]
    far = [d for d in distances if d > window]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (name, r) in enumerate(ordered_variants(data)):
        color, size, width = f"C{i}", 150 - 16 * i, 4.5 - 0.55 * i
        digits = [r["recall_digits"][str(d)]["digit_accuracy"] for d in distances]
        x = r["kv_cache_bytes_at_context"] / 1024
        ax1.scatter(x, sum(r["recall"][str(d)] for d in far) / len(far), s=size, color=color)
        ax1.scatter(x, sum(r["recall_digits"][str(d)]["digit_accuracy"] for d in far) / len(far), s=size,
                    color=color, marker="x")
        ax2.plot(distances, [r["recall"][str(d)] for d in distances], marker="o", ms=size ** 0.5 / 1.6, lw=width,
                 color=color, label=f"{name} (val loss {r['val_loss']:.2f})")
        ax2.plot(distances, digits, ls=":", marker="x", color=color)
    ax1.axhline(0.1, color="gray", ls=":", lw=1, label="guessing a digit (0.1)")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_xscale("log", base=2)
    ax1.set(xlabel=f"KV cache of one {context}-token sequence (KiB, fp32)",
            ylabel=f"recall beyond the window (distance > {window})", ylim=(-0.03, 1.05),
            title="quality vs cache size (o exact answer, x per digit; colours as on the right)")
    ax2.axvline(window, color="gray", ls="--", lw=1)
    ax2.text(window, 1.0, " window", color="gray", fontsize=8)
    ax2.set(xlabel="distance from fact to query (tokens)", ylim=(-0.03, 1.05),
            ylabel="recall accuracy (solid: exact answer, dotted: per digit)",
            title=f"long-range recall vs distance ({data['train']['steps']} training steps)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


BENCHMARK = bench_kv_variants = Benchmark(
    "kv_variants", measure, lambda data: print(kv_variants_table(data)),
    plots={"kv_variants": plot_results, "kv_variants_scale": lambda data: plot_cache_vs_context(
        data["scale"]["context_lengths"], {m: {v: data["scale"]["bytes"][m][v] for v in SCALE_VARIANTS}
                                           for m in SCALE_MODELS})})
