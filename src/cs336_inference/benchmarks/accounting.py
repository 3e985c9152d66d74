"""`python -m cs336_inference bench accounting`: the lecture's latency/throughput/memory trade-offs.

No measurement: every number comes from `accounting` (the formulas of CS336 lecture 10) for the
named real models on the datasheet accelerators. Writes figures/accounting.json and two PNGs:
accounting_latency_throughput (Llama 2 13B on an H100, with the 80 GB line) and
accounting_kv_memory (memory vs batch size, MHA K = 40 against GQA K = 8).
"""

from __future__ import annotations

from ..accounting.formulas import (HARDWARE, REAL_MODELS, batch_sweep, kv_cache_bytes_per_token, max_batch_size,
                                   num_parameters, transformer_performance_stats, with_kv_heads)
from ..accounting.plots import plot_kv_memory, plot_latency_throughput
from ..figures import save_figure, save_json
from ..tables import print_table


def bench_accounting(quick: bool = False, device: str | None = None) -> dict:
    """Print the tables, write figures/accounting.json and the two figures (formulas only: --quick computes
    the same numbers but writes them to the scratch folder; device is unused)."""
    seq_len = 1024
    rows = []
    for name in REAL_MODELS:
        for hw in ("H100", "B200"):
            for b in (1, 64, 256):
                s = transformer_performance_stats(name, hw, b, seq_len)
                row = dict(s.to_dict(), active_parameters=num_parameters(name, active_only=True),
                           kv_bytes_per_token=kv_cache_bytes_per_token(REAL_MODELS[name]),
                           max_batch_size=max_batch_size(name, hw, seq_len))
                rows.append(row)
    print_table(rows, [("model", "model", None), ("num_parameters", "params", lambda v: f"{v / 1e9:.1f}B"),
                       ("active_parameters", "active", lambda v: f"{v / 1e9:.1f}B"),
                       ("kv_bytes_per_token", "KV B/token", "{:,}"), ("hardware", "hw", None),
                       ("batch_size", "B", "{:d}"), ("total_memory_bytes", "mem GB", lambda v: f"{v / 1e9:.1f}"),
                       ("fits_in_memory", "fits", None), ("latency_per_token_s", "ms/tok", lambda v: f"{v * 1e3:.1f}"),
                       ("throughput_tokens_per_s", "tok/s", "{:,.0f}"),
                       ("ttft_s", "TTFT ms", lambda v: f"{v * 1e3:.1f}"),
                       ("max_batch_size", "maxB", "{:d}")])
    sweep = batch_sweep("llama2-13b", "H100", seq_len)
    gqa = {k: [s.to_dict() for s in batch_sweep(with_kv_heads("llama2-13b", k), "H100", seq_len)] for k in (40, 8, 1)}
    print_table([s.to_dict() for s in sweep],
                [("batch_size", "B", "{:d}"), ("total_memory_bytes", "memory GB", lambda v: f"{v / 1e9:.1f}"),
                 ("latency_per_token_s", "latency ms", lambda v: f"{v * 1e3:.1f}"),
                 ("throughput_tokens_per_s", "tokens/s", "{:,.0f}"),
                 ("fits_in_memory", "fits", lambda v: "fits" if v else "does NOT fit")],
                title="\nLlama 2 13B on H100, S=1024")
    paths = [save_figure(plot_latency_throughput(sweep), "accounting_latency_throughput", result=True, quick=quick),
             save_figure(plot_kv_memory("llama2-13b", "H100", seq_len), "accounting_kv_memory", result=True,
                         quick=quick)]
    data = {"seq_len": seq_len, "models": rows, "llama2_13b_h100_sweep": [s.to_dict() for s in sweep],
            "llama2_13b_kv_heads_sweep": gqa,
            "hardware": {k: dict(peak_flops=v.peak_flops, memory_bandwidth=v.memory_bandwidth,
                                 memory_bytes=v.memory_bytes, source=v.source,
                                 accelerator_intensity=v.accelerator_intensity) for k, v in HARDWARE.items()},
            "model_sources": {k: v.source for k, v in REAL_MODELS.items()}}
    paths.append(save_json(data, "accounting", result=True, quick=quick))
    for p in paths:
        print("wrote", p)
    return data
