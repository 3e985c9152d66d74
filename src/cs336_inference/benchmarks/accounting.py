"""`python -m cs336_inference bench accounting`: the lecture's latency/throughput/memory trade-offs.

No measurement: every number comes from `accounting` (the formulas of CS336 lecture 10) for the
named real models on the datasheet accelerators. Writes figures/accounting.json and two PNGs:
accounting_latency_throughput (Llama 2 13B on an H100, with the 80 GB line) and
accounting_kv_memory (memory vs batch size, MHA K = 40 against GQA K = 8).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from ..accounting.formulas import (HARDWARE, REAL_MODELS, get_hardware, kv_cache_bytes_per_token, max_batch_size,
                         num_parameters, transformer_performance_stats, with_kv_heads)
from ..figures import save_figure, save_json


def batch_sweep(model="llama2-13b", hardware="H100", seq_len: int = 1024, batch_sizes=None,
                precision: str = "bf16") -> list:
    """`TransformerPerformanceStats` for each batch size (default 1, 2, 4, ..., 512)."""
    batch_sizes = batch_sizes or [2**i for i in range(10)]
    return [transformer_performance_stats(model, hardware, b, seq_len, precision) for b in batch_sizes]


def plot_latency_throughput(stats: list, title: str | None = None):
    """Memory vs B (with the accelerator's capacity) and latency vs throughput, one point per B."""
    fig, (ax_mem, ax_lt) = plt.subplots(1, 2, figsize=(11, 4))
    bs = [s.batch_size for s in stats]
    ax_mem.plot(bs, [s.total_memory_bytes / 1e9 for s in stats], "o-", label="weights + KV cache")
    ax_mem.plot(bs, [s.weight_bytes / 1e9 for s in stats], "--", color="gray", label="weights")
    cap = stats[0].memory_capacity_bytes
    if cap is not None:
        ax_mem.axhline(cap / 1e9, color="red", label=f"{stats[0].hardware} memory ({cap / 1e9:.0f} GB)")
    ax_mem.set(xscale="log", xlabel="batch size B", ylabel="GB", title="memory needed")
    ax_mem.set_xticks(bs, [str(b) for b in bs])
    ax_mem.legend(fontsize=8)
    for s in stats:
        fits = s.fits_in_memory is not False
        ax_lt.plot(s.throughput_tokens_per_s, s.latency_per_token_s * 1e3, "o",
                   color="C0" if fits else "red", mfc="C0" if fits else "none")
        ax_lt.annotate(f"B={s.batch_size}", (s.throughput_tokens_per_s, s.latency_per_token_s * 1e3),
                       textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_lt.plot([s.throughput_tokens_per_s for s in stats], [s.latency_per_token_s * 1e3 for s in stats],
               "-", color="C0", alpha=0.4)
    ax_lt.set(xlabel="throughput (tokens/s)", ylabel="latency per token (ms)",
              title="bigger batches: more throughput, worse latency (red: does not fit)")
    fig.suptitle(title or f"{stats[0].model} on {stats[0].hardware}, S={stats[0].seq_len}, {stats[0].precision} "
                 "(memory-bound decode: latency = bytes / bandwidth)")
    fig.tight_layout()
    return fig


def plot_kv_memory(model="llama2-13b", hardware="H100", seq_len: int = 1024, kv_heads=(40, 8, 1),
                   batch_sizes=None, precision: str = "bf16"):
    """Total memory vs batch size for several numbers of KV heads (MHA, GQA, MQA) of one model."""
    batch_sizes = batch_sizes or [2**i for i in range(11)]
    hw = get_hardware(hardware)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k in kv_heads:
        variant = with_kv_heads(model, k)
        mem = [transformer_performance_stats(variant, hw, b, seq_len, precision).total_memory_bytes / 1e9
               for b in batch_sizes]
        kind = "MHA" if k == REAL_MODELS[model].num_heads else ("MQA" if k == 1 else "GQA")
        ax.plot(batch_sizes, mem, "o-", label=f"{kind} K={k}: max B = {max_batch_size(variant, hw, seq_len, precision)}")
    ax.axhline(hw.memory_bytes / 1e9, color="red", label=f"{hw.name} {hw.memory_bytes / 1e9:.0f} GB")
    ax.set_xscale("log")
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set(yscale="log", xlabel="batch size B", ylabel="weights + KV cache (GB)",
           title=f"{model}, S={seq_len}: fewer KV heads, more sequences fit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bench_accounting(quick: bool = False, device: str | None = None) -> dict:
    """Print the tables, write figures/accounting.json and the two figures. (quick/device unused.)"""
    seq_len = 1024
    print(f"{'model':12s} {'params':>9s} {'active':>8s} {'KV B/token':>10s} {'hw':>5s} "
          f"{'B':>4s} {'mem GB':>8s} {'fits':>5s} {'ms/tok':>7s} {'tok/s':>9s} {'TTFT ms':>9s} {'maxB':>5s}")
    rows = []
    for name in REAL_MODELS:
        for hw in ("H100", "B200"):
            for b in (1, 64, 256):
                s = transformer_performance_stats(name, hw, b, seq_len)
                row = dict(s.to_dict(), active_parameters=num_parameters(name, active_only=True),
                           kv_bytes_per_token=kv_cache_bytes_per_token(REAL_MODELS[name]),
                           max_batch_size=max_batch_size(name, hw, seq_len))
                rows.append(row)
                print(f"{name:12s} {s.num_parameters / 1e9:8.1f}B {row['active_parameters'] / 1e9:7.1f}B "
                      f"{row['kv_bytes_per_token']:10,d} {hw:>5s} {b:4d} {s.total_memory_bytes / 1e9:8.1f} "
                      f"{str(s.fits_in_memory):>5s} {s.latency_per_token_s * 1e3:7.1f} "
                      f"{s.throughput_tokens_per_s:9,.0f} {s.ttft_s * 1e3:9.1f} {row['max_batch_size']:5d}")
    sweep = batch_sweep("llama2-13b", "H100", seq_len)
    gqa = {k: [s.to_dict() for s in batch_sweep(with_kv_heads("llama2-13b", k), "H100", seq_len)] for k in (40, 8, 1)}
    print("\nLlama 2 13B on H100, S=1024: B, memory (GB), latency (ms), throughput (tokens/s)")
    for s in sweep:
        print(f"  B={s.batch_size:4d}  {s.total_memory_bytes / 1e9:7.1f} GB  {s.latency_per_token_s * 1e3:6.1f} ms  "
              f"{s.throughput_tokens_per_s:8,.0f} tok/s  {'fits' if s.fits_in_memory else 'does NOT fit'}")
    paths = [save_figure(plot_latency_throughput(sweep), "accounting_latency_throughput"),
             save_figure(plot_kv_memory("llama2-13b", "H100", seq_len), "accounting_kv_memory")]
    data = {"seq_len": seq_len, "models": rows, "llama2_13b_h100_sweep": [s.to_dict() for s in sweep],
            "llama2_13b_kv_heads_sweep": gqa,
            "hardware": {k: dict(peak_flops=v.peak_flops, memory_bandwidth=v.memory_bandwidth,
                                 memory_bytes=v.memory_bytes, source=v.source,
                                 accelerator_intensity=v.accelerator_intensity) for k, v in HARDWARE.items()},
            "model_sources": {k: v.source for k, v in REAL_MODELS.items()}}
    paths.append(save_json(data, "accounting"))
    for p in paths:
        print("wrote", p)
    return data
