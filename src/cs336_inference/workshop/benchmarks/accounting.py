"""`bench accounting`: the lecture's latency / throughput / memory trade-offs of real models on datasheet
accelerators. Nothing is measured: every number comes from the `accounting` formulas.
"""

from __future__ import annotations

from ...accounting.formulas import (HARDWARE, REAL_MODELS, batch_sweep, kv_cache_bytes_per_token, max_batch_size,
                                   num_parameters, transformer_performance_stats, with_kv_heads)
from ...accounting.plots import plot_kv_memory, plot_latency_throughput
from ...tables import print_table
from .base import Benchmark

MODEL, HW, SEQ_LEN = "llama2-13b", "H100", 1024


def measure(run) -> dict:
    """Every real model on H100 and B200 at B = 1, 64, 256; Llama 2 13B's batch sweep, and with K = 40/8/1."""
    rows, seq_len = [], SEQ_LEN
    for name in REAL_MODELS:
        for hw in ("H100", "B200"):
            for b in (1, 64, 256):
                rows.append(dict(transformer_performance_stats(name, hw, b, seq_len).to_dict(),
                                 active_parameters=num_parameters(name, active_only=True),
                                 kv_bytes_per_token=kv_cache_bytes_per_token(REAL_MODELS[name]),
                                 max_batch_size=max_batch_size(name, hw, seq_len)))
    return {"seq_len": seq_len, "models": rows,
            "llama2_13b_h100_sweep": [s.to_dict() for s in batch_sweep(MODEL, HW, seq_len)],
            "llama2_13b_kv_heads_sweep": {k: [s.to_dict() for s in batch_sweep(with_kv_heads(MODEL, k), HW, seq_len)]
                                          for k in (40, 8, 1)},
            "hardware": {k: dict(peak_flops=v.peak_flops, memory_bandwidth=v.memory_bandwidth,
                                 memory_bytes=v.memory_bytes, source=v.source,
                                 accelerator_intensity=v.accelerator_intensity) for k, v in HARDWARE.items()},
            "model_sources": {k: v.source for k, v in REAL_MODELS.items()}}


def print_tables(data: dict) -> None:
    print_table(data["models"], [
        ("model", "model", None), ("num_parameters", "params", lambda v: f"{v / 1e9:.1f}B"),
        ("active_parameters", "active", lambda v: f"{v / 1e9:.1f}B"), ("kv_bytes_per_token", "KV B/token", "{:,}"),
        ("hardware", "hw", None), ("batch_size", "B", "{:d}"),
        ("total_memory_bytes", "mem GB", lambda v: f"{v / 1e9:.1f}"), ("fits_in_memory", "fits", None),
        ("latency_per_token_s", "ms/tok", lambda v: f"{v * 1e3:.1f}"), ("throughput_tokens_per_s", "tok/s", "{:,.0f}"),
        ("ttft_s", "TTFT ms", lambda v: f"{v * 1e3:.1f}"), ("max_batch_size", "maxB", "{:d}")])
    print_table(data["llama2_13b_h100_sweep"], [
        ("batch_size", "B", "{:d}"), ("total_memory_bytes", "memory GB", lambda v: f"{v / 1e9:.1f}"),
        ("latency_per_token_s", "latency ms", lambda v: f"{v * 1e3:.1f}"),
        ("throughput_tokens_per_s", "tokens/s", "{:,.0f}"),
        ("fits_in_memory", "fits", lambda v: "fits" if v else "does NOT fit")],
        title=f"\nLlama 2 13B on {HW}, S={data['seq_len']}")


BENCHMARK = bench_accounting = Benchmark(
    "accounting", measure, print_tables,
    plots={"accounting_latency_throughput": lambda d: plot_latency_throughput(d["llama2_13b_h100_sweep"]),
           "accounting_kv_memory": lambda d: plot_kv_memory(MODEL, HW, d["seq_len"])})
