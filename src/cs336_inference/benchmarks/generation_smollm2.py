"""`bench generation_smollm2`: loading, prefill and decode of a real model on this machine's roofline.

Loading: converting the GGUF (parse + dequantize, no cache) and loading the converted weights from the
disk cache (memory-mapped), in fp32 and bf16. Then SmolLM2-135M in fp32 and bf16, in alternating
rounds: prefill tokens/s, decode tokens/s at B = 1 and 8, the bytes a step reads (every weight once,
the tied embedding as the lm_head, plus the KV cache) against the bandwidth measured in the same run,
where the step sits on the roofline (FLOPs / byte against peak / bandwidth), naive vs cached generation.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch

from ..accounting import decode_step_bytes, forward_flops
from ..accounting.roofline import measure_matmul_flops, measure_memory_bandwidth
from ..generation.generate import generate
from ..cpu_tuning import describe, tune_for_cpu
from ..model import load_pretrained
from ..model.real_models import gguf_path, load_gguf_weights
from ..tables import print_table
from ..timing import rss_bytes
from .base import Benchmark
from ..accounting.model_roofline import decode_step_seconds, prefill_tokens_per_second, weight_bytes_per_step

MODEL = "smollm2-135m"
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_loading(device: torch.device) -> dict:
    """Seconds to convert the GGUF without the cache, and to load each dtype through it (warm)."""
    t0 = time.perf_counter()
    load_gguf_weights(gguf_path(MODEL), torch.float32)          # parse + dequantize, nothing cached
    out = dict(convert_gguf_s=time.perf_counter() - t0)
    for p, dt in PRECISIONS.items():
        load_pretrained(MODEL, device=device, dtype=dt)          # make sure this dtype's cache file exists
        rss0, t0 = rss_bytes(), time.perf_counter()
        model = load_pretrained(MODEL, device=device, dtype=dt)
        out[f"load_{p}_s"] = time.perf_counter() - t0
        out[f"parameters_{p}_MB"] = sum(t.nbytes for t in model.parameters()) / 1e6
        rss1 = rss_bytes()
        out[f"rss_growth_{p}_MB"] = None if rss0 is None or rss1 is None else (rss1 - rss0) / 2**20
        del model
    return out


def measure(run) -> dict:
    quick, device = run.quick, run.device
    loading = measure_loading(device)
    models = {p: tune_for_cpu(load_pretrained(MODEL, device=device, dtype=dt)) for p, dt in PRECISIONS.items()}
    print(describe(models["fp32"]))   # the CPU decode speed-ups, opted in
    config = models["fp32"].config
    rounds, steps, context, prompt = (1, 4, 64, 128) if quick else (3, 16, 128, 512)
    print(f"{MODEL} on {device}, {torch.get_num_threads()} threads")
    bandwidth = statistics.median(measure_memory_bandwidth(device, repeats=5) for _ in range(3))
    peaks = {p: measure_matmul_flops(device, dtype=dt, repeats=3) for p, dt in PRECISIONS.items()}
    times = {(p, b): [] for p in PRECISIONS for b in (1, 8)}
    prefill = {p: [] for p in PRECISIONS}
    for _ in range(rounds):                      # alternate precisions, round after round
        for p, model in models.items():
            prefill[p].append(prefill_tokens_per_second(model, prompt, repeats=1))
            for b in (1, 8):
                times[(p, b)].append(decode_step_seconds(model, b, context=context, steps=steps))
    rows = []
    for p, model in models.items():
        for b in (1, 8):
            seconds = statistics.median(times[(p, b)])
            weights = weight_bytes_per_step(model)
            kv = b * (context + 1) * model.new_cache(1, 1).bytes_per_token
            flops = forward_flops(config, b, 1, context)
            rows.append(dict(
                precision=p, batch_size=b, context=context, ms_per_step=1e3 * seconds,
                ms_per_step_min=1e3 * min(times[(p, b)]), ms_per_step_max=1e3 * max(times[(p, b)]),
                tokens_per_second=b / seconds, weight_bytes=weights, kv_bytes=kv, bytes_per_step=weights + kv,
                accounting_bytes=decode_step_bytes(config, b, context + 1, p),
                achieved_GBps=(weights + kv) / seconds / 1e9,
                fraction_of_bandwidth=(weights + kv) / seconds / bandwidth, flops_per_step=flops,
                intensity_flops_per_byte=flops / (weights + kv),
                machine_balance_flops_per_byte=peaks[p] / bandwidth, memory_bound_ms=1e3 * (weights + kv) / bandwidth,
                prefill_tokens_per_second=statistics.median(prefill[p])))
    new_tokens = 16 if quick else 64
    ids = torch.randint(0, config.vocab_size, (1, 32)).tolist()
    cached = generate(models["fp32"], ids, new_tokens, use_cache=True)
    naive = generate(models["fp32"], ids, new_tokens, use_cache=False)
    assert cached.tokens == naive.tokens, "cached and naive greedy generation disagree"
    return dict(model=MODEL, device=str(device), threads=torch.get_num_threads(), loading=loading,
                measured_bandwidth_GBps=bandwidth / 1e9, peak_GFLOPs={p: v / 1e9 for p, v in peaks.items()},
                prompt_len=prompt, rounds=rounds, steps=steps, rows=rows,
                generation=dict(precision="fp32", prompt_len=32, new_tokens=new_tokens, cached_s=cached.total_time,
                                naive_s=naive.total_time, naive_over_cached=naive.total_time / cached.total_time,
                                cached_step_ms=[1e3 * t for t in cached.inter_token_latencies],
                                naive_step_ms=[1e3 * t for t in naive.inter_token_latencies]),
                note=("medians over alternating rounds on a shared CPU; bytes per step = every weight + the KV "
                      "cache read"))


def _print(data: dict) -> None:
    ld = data["loading"]
    print(f"loading: convert the GGUF {ld['convert_gguf_s']:.1f} s; from the cache fp32 {ld['load_fp32_s']:.2f} s "
          f"({ld['parameters_fp32_MB']:.0f} MB of parameters), bf16 {ld['load_bf16_s']:.2f} s "
          f"({ld['parameters_bf16_MB']:.0f} MB)")
    print(f"streaming bandwidth {data['measured_bandwidth_GBps']:.1f} GB/s; matmul peak "
          + ", ".join(f"{p} {v:.0f} GFLOP/s" for p, v in data["peak_GFLOPs"].items()))
    print_table(data["rows"], [
        ("precision", "prec", None), ("batch_size", "B", "{:d}"), ("ms_per_step", "ms/step", "{:.1f}"),
        ("tokens_per_second", "tok/s", "{:.1f}"), ("bytes_per_step", "MB/step", lambda b: f"{b / 1e6:.1f}"),
        ("achieved_GBps", "GB/s", "{:.1f}"), ("fraction_of_bandwidth", "% of bw", lambda f: f"{100 * f:.0f}%"),
        ("intensity_flops_per_byte", "FLOP/byte", "{:.2f}"), ("machine_balance_flops_per_byte", "balance", "{:.1f}"),
        ("prefill_tokens_per_second", "prefill tok/s", "{:.0f}")])
    g = data["generation"]
    print(f"{g['new_tokens']} new tokens (fp32, greedy): cached {g['cached_s']:.2f} s, naive {g['naive_s']:.2f} s "
          f"({g['naive_over_cached']:.1f}x)")


def plot(data: dict):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = data["rows"]
    labels = [f"{r['precision']}\nB={r['batch_size']}" for r in rows]
    ax1.bar(labels, [r["achieved_GBps"] for r in rows], color=["tab:blue", "tab:cyan", "tab:orange", "tab:red"])
    ax1.axhline(data["measured_bandwidth_GBps"], color="k", ls="--", label="streaming bandwidth (measured)")
    for i, r in enumerate(rows):
        ax1.text(i, r["achieved_GBps"], f"{r['tokens_per_second']:.0f} tok/s\n{r['bytes_per_step'] / 1e6:.0f} MB/step",
                 ha="center", va="bottom", fontsize=8)
    ax1.set(ylabel="bytes per step / time per step (GB/s)", title=f"{data['model']} decode on {data['device']}")
    ax1.legend(fontsize=8)
    g = data["generation"]
    ax2.plot(g["cached_step_ms"], label="KV cache")
    ax2.plot(g["naive_step_ms"], label="naive (re-run the prefix)")
    ax2.set(xlabel="generated token", ylabel="ms per step", title="per-step latency, batch 1, fp32")
    ax2.legend()
    fig.tight_layout()
    return fig


BENCHMARK = bench_generation_smollm2 = Benchmark("generation_smollm2", measure, _print, parallel=True,
                                                 plots={"generation_smollm2": plot})
