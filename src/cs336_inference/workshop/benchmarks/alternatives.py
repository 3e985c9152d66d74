"""`bench alternatives`: fixed-state layers against attention on associative recall, bytes and latency.

2-layer models of each kind (attention, a sliding window, BASED linear attention and Mamba-2's SSD at
several state sizes, an SSD + attention hybrid) train on MQAR (Zoology, Arora et al. 2023) with one
parameter budget; then recall per number of key-value pairs, the bytes one sequence keeps at context T,
and decode latency against T (untrained copies, timed side by side). A full run ships five of the
trained models (`assets/mqar-*.pt`) for the lecture and notebook 08.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch

from ...data.mqar import MQARTask, MQARTraining, mqar_recall, train_mqar
from ...model.config import ModelConfig
from ...model.transformer import TransformerLM
from ...tables import alternatives_table
from ...timing import median_seconds
from .base import Benchmark, alternate
from .kv_variants import variant_config as budgeted_config

TASK = MQARTask(num_keys=32, num_values=32, seq_len=64)
BASE = dict(vocab_size=TASK.vocab_size, context_length=TASK.seq_len, d_model=64, num_layers=2, num_heads=2, d_ff=128)
PAIRS = (2, 4, 8, 12, 16, 20)
VARIANTS: dict[str, dict] = {     # name -> ModelConfig overrides; the shipped file is assets/mqar-<key>.pt
    "attention": dict(),
    "window 16": dict(sliding_window=16),
    "linear d'=2": dict(mixer="linear", feature_dim=2),
    "linear d'=4": dict(mixer="linear", feature_dim=4),
    "linear d'=8": dict(mixer="linear", feature_dim=8),
    "SSD n=2": dict(mixer="ssd", state_dim=2),
    "SSD n=4": dict(mixer="ssd", state_dim=4),
    "SSD n=16": dict(mixer="ssd", state_dim=16),
    "hybrid: SSD n=4 + attention": dict(mixer="ssd", state_dim=4, global_every=2),
}
SHIPPED = {"attention": "attention", "window 16": "window", "linear d'=2": "linear", "SSD n=4": "ssd",
           "hybrid: SSD n=4 + attention": "hybrid"}     # the ones the lecture and notebook load
LATENCY_VARIANTS = ("attention", "window 16", "linear d'=8", "SSD n=16", "hybrid: SSD n=4 + attention")


def variant_config(overrides: dict, budget: int | None = None) -> ModelConfig:
    """BASE with a variant's knobs, d_ff set to meet `budget` parameters (as `bench kv_variants` does)."""
    return budgeted_config(overrides, BASE, budget)


def memory_bytes(config: ModelConfig, context: int) -> int:
    """Bytes one sequence's cache holds after `context` tokens, as allocated (fp32)."""
    model = TransformerLM(config.replace(context_length=context), device="meta")
    return model.new_cache(1, context, dtype=torch.float32).nbytes


def decode_latency(configs: dict[str, ModelConfig], contexts: list[int], batch_size: int, steps: int,
                   rounds: int, device) -> dict:
    """Median ms of one decode step per variant and context, alternated round by round. The context is
    prefilled in chunks of 512 tokens (a whole prompt at once would need T x T scores); a KV cache is
    rolled back after each step, so every step sees the same context (a state cannot roll back, and its
    steps do not depend on the context; the hybrid's attention layer drifts by the few steps timed)."""
    def timer(config, context):
        capacity = context + rounds * (steps + 1) + 4
        model = TransformerLM(config.replace(context_length=capacity), device=device).eval()
        cache = model.new_cache(batch_size, capacity)
        with torch.inference_mode():
            for start in range(0, context, 512):
                model(torch.randint(0, config.vocab_size, (batch_size, min(512, context - start)), device=device),
                      cache=cache)
        token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)

        def step():
            with torch.inference_mode():
                model(token, cache=cache)
            if config.mixer == "attention":
                cache.truncate(context)
        return lambda: median_seconds(step, device, steps, warmup=1)
    timers = {f"{name}|{T}": timer(configs[name], T) for name in LATENCY_VARIANTS for T in contexts}
    times = alternate(timers, rounds)
    return {name: {str(T): 1e3 * statistics.median(times[f"{name}|{T}"]) for T in contexts}
            for name in LATENCY_VARIANTS}


def measure(run) -> dict:
    """Train every variant on MQAR with one budget; recall per pairs, bytes and decode latency per context.
    A full run replaces the shipped assets/mqar-*.pt, so the lecture loads the very models measured here."""
    quick, device = run.quick, run.device
    training = MQARTraining(steps=30 if quick else 1500, batch_size=32, lr=3e-3, warmup_steps=100 if not quick else 5,
                            pairs=(2, 4, 8, 16))
    names = ["attention", "SSD n=4"] if quick else list(VARIANTS)
    budget = TransformerLM(variant_config(VARIANTS["attention"])).num_parameters()
    contexts = [256, 1024] if quick else [256, 1024, 4096, 8192]
    results, configs = {}, {}

    def shape(config) -> dict:
        return {"config": config.to_dict(), "fixed_state": config.mixer != "attention",
                "bytes": {str(T): memory_bytes(config, T) for T in [TASK.seq_len, *contexts]}}

    for name in names:
        configs[name] = config = variant_config(VARIANTS[name], budget)
        torch.manual_seed(training.seed)
        model = TransformerLM(config, device=device)
        history = train_mqar(model, TASK, training)
        recall = {str(p): mqar_recall(model, TASK, p, num_sequences=64 if quick else 512) for p in PAIRS}
        results[name] = {**shape(config), "params": model.num_parameters(), "train_seconds": history["seconds"],
                         "final_loss": statistics.mean(history["loss"][-50:]), "recall": recall}
        print(f"  {name:<30} params {results[name]['params']:>6,}  recall {[round(r, 2) for r in recall.values()]}",
              flush=True)
        if name in SHIPPED and not quick:
            from ...model.checkpoints import ASSETS, save
            save(ASSETS / f"mqar-{SHIPPED[name]}.pt", model.cpu(), extra={
                "task": TASK.__dict__, "training": training.__dict__, "recall": recall, "bench": "alternatives"})
    configs.update({n: variant_config(VARIANTS[n], budget) for n in LATENCY_VARIANTS if n not in configs})
    latency = dict(batch_size=4, steps=8 if quick else 16, rounds=1 if quick else 3, contexts=contexts)
    ms = decode_latency(configs, contexts, latency["batch_size"], latency["steps"], latency["rounds"], device)
    for name, per_context in ms.items():
        results.setdefault(name, shape(configs[name]))
        results[name]["decode_ms"] = per_context
    return {"device": str(device), "task": TASK.__dict__, "training": training.__dict__, "base": BASE,
            "budget_params": budget, "pairs": list(PAIRS), "latency": latency, "variants": results,
            "variant_order": [n for n in VARIANTS if n in results], "finished": time.strftime("%Y-%m-%d %H:%M")}


def plot(data: dict):
    """Left: recall against pairs; middle: recall at the most pairs against bytes kept at T = seq_len;
    right: decode latency against context. Solid lines: fixed-state models; dashed: attention (a KV cache)."""
    pairs, order = data["pairs"], data["variant_order"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    seq_len, most = data["task"]["seq_len"], str(max(pairs))
    for name in order:
        r, color = data["variants"][name], f"C{list(VARIANTS).index(name) % 10}"
        style = "-" if r["fixed_state"] else "--"
        if "recall" in r:
            axes[0].plot(pairs, [r["recall"][str(p)] for p in pairs], style, marker="o", color=color, label=name)
            kib = r["bytes"][str(seq_len)] / 1024
            axes[1].scatter(kib, r["recall"][most], s=60, color=color)
            below = list(VARIANTS).index(name) % 2          # alternate above / below: close points stay legible
            axes[1].annotate(name, (kib, r["recall"][most]), fontsize=7, xytext=(4, -10 if below else 4),
                             textcoords="offset points")
        if "decode_ms" in r:
            contexts = [int(T) for T in r["decode_ms"]]
            axes[2].plot(contexts, list(r["decode_ms"].values()), style, marker="o", color=color, label=name)
    axes[0].set(xlabel="key-value pairs in the sequence", ylabel="recall (fraction of queries answered)",
                ylim=(-0.03, 1.05), title=f"MQAR recall ({data['training']['steps']} steps, ~{data['budget_params']:,} "
                                          f"params each)")
    axes[0].legend(fontsize=7)
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel=f"bytes one sequence keeps at T = {seq_len} (KiB, fp32)", ylabel=f"recall at {most} pairs",
                ylim=(-0.03, 1.05), title=f"recall at {most} pairs vs bytes kept")
    axes[2].set_xscale("log", base=2)
    axes[2].set(xlabel="context T (tokens in the cache)",
                ylabel=f"decode ms / step (B={data['latency']['batch_size']})",
                title="decode latency vs context (untrained copies)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


BENCHMARK = bench_alternatives = Benchmark("alternatives", measure, lambda data: print(alternatives_table(data)),
                                            plots={"{name}": plot})
