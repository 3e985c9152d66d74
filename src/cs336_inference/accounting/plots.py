"""Plots of the accounting: memory and latency/throughput of real models on datasheet accelerators,
this machine's measured roofline, and a real model's prefill/decode on it. Each returns a figure
(save it with `figures.save_figure`); benchmarks, notebooks and the lecture share them.
"""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from .formulas import REAL_MODELS, get_hardware, max_batch_size, transformer_performance_stats, with_kv_heads
from .roofline import RooflineSweep


def _plain_log_labels(axis) -> None:
    """Plain numbers on a log axis, labelling only the minor ticks at 2x and 5x a power of ten (all
    eight crowd into each other)."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))


def plot_latency_throughput(stats: list, title: str | None = None):
    """Memory vs B (with the accelerator's capacity) and latency vs throughput, one point per B.
    `stats`: `TransformerPerformanceStats`, or their `to_dict()` (a benchmark's JSON)."""
    stats = [SimpleNamespace(**s) if isinstance(s, dict) else s for s in stats]
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
    # log throughput: doubling B nearly doubles it at small B, so the points (and labels) spread evenly
    ax_lt.set(xscale="log", xlabel="throughput (tokens/s, log scale)", ylabel="latency per token (ms)",
              title="bigger batches: more throughput, worse latency (red: does not fit)")
    _plain_log_labels(ax_lt.xaxis)
    ax_lt.margins(x=0.1, y=0.1)   # room for the last point's label inside the frame
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
        most = max_batch_size(variant, hw, seq_len, precision)
        ax.plot(batch_sizes, mem, "o-", label=f"{kind} K={k}: max B = {most}")
    ax.axhline(hw.memory_bytes / 1e9, color="red", label=f"{hw.name} {hw.memory_bytes / 1e9:.0f} GB")
    ax.set_xscale("log")
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set(yscale="log", xlabel="batch size B", ylabel="weights + KV cache (GB)",
           title=f"{model}, S={seq_len}: fewer KV heads, more sequences fit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_cache_vs_context(lengths, curves: dict):
    """KV-cache bytes of one sequence against context, one panel per model ({model: {variant: bytes}},
    `kv_variants.cache_bytes_vs_context`). MHA is drawn wide underneath and windows dashed on top: a
    window equals MHA until it fills, and either would otherwise hide the other."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.8), squeeze=False)
    for ax, (model, by_variant) in zip(axes[0], curves.items()):
        for i, (name, values) in enumerate(by_variant.items()):
            style = dict(lw=4, alpha=0.6, zorder=1) if name == "MHA" else dict(lw=1.6, zorder=2)
            ax.plot(lengths, [v / 1e9 for v in values], marker=".", color=f"C{i}",
                    ls="--" if name.startswith("window") else "-", label=name, **style)
        ax.set(yscale="log", xlabel="context length (tokens)", ylabel="KV cache of one sequence (GB, bf16)",
               title=f"{model} attention shape (accounting only)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_roofline(sweep: RooflineSweep):
    """Achieved FLOP/s vs B (log-log) under the two roofs, with the ridge and the measured knee."""
    hw = sweep.hardware
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sweep.batch_sizes, [f / 1e9 for f in sweep.achieved_flops], "o-", label="measured X @ W")
    ax.plot(sweep.batch_sizes, [f / 1e9 for f in sweep.predicted_flops], "k--",
            label="roofline min(peak, intensity x bandwidth)")
    ax.axvline(sweep.ridge_batch_size, color="gray", ls=":",
               label=f"ridge B = {sweep.ridge_batch_size:.1f} (intensity {hw.accelerator_intensity:.1f} FLOP/B)")
    knee = sweep.knee_batch_size()
    if knee is not None:
        ax.axvline(knee, color="C3", ls=":", label=f"measured knee (80% of best) B = {knee}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sweep.batch_sizes, [str(b) for b in sweep.batch_sizes])
    _plain_log_labels(ax.yaxis)
    ax.set(xlabel="batch size B (rows of X)", ylabel="GFLOP/s",
           title=f"Roofline of {hw.device}\nW = {sweep.d_in}x{sweep.d_out} {sweep.dtype}, "
                 f"peak {hw.peak_flops / 1e9:,.0f} GFLOP/s, bandwidth {hw.memory_bandwidth / 1e9:,.1f} GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_model(prefill: dict, decode: list[dict], name: str = "bench-90m"):
    """Prefill vs decode time per token; decode latency and throughput vs B, measured and predicted."""
    fig, (ax_pd, ax_lat, ax_tp) = plt.subplots(1, 3, figsize=(14, 4))
    d1 = decode[0]
    ax_pd.bar(["prefill\n(per prompt token)", f"decode\n(B={d1['batch_size']})"],
              [prefill["seconds_per_token"] * 1e3, d1["seconds"] * 1e3], color=["C2", "C0"])
    ax_pd.set(ylabel="ms per token", title=f"{name}: prefill vs decode")
    bs = [d["batch_size"] for d in decode]
    ax_lat.plot(bs, [d["seconds"] * 1e3 for d in decode], "o-", label="measured step")
    ax_lat.plot(bs, [d["matmul_only_seconds"] * 1e3 for d in decode], "s-", color="C2", ms=4,
                label="measured: its weight matmuls alone")
    ax_lat.plot(bs, [d["predicted_seconds"] * 1e3 for d in decode], "k--", label="predicted max(bytes/bw, FLOPs/peak)")
    ax_lat.plot(bs, [d["predicted_memory_s"] * 1e3 for d in decode], ":", color="gray", label="bytes / bandwidth")
    if "matvec_bandwidth_s" in d1:
        ax_lat.plot(bs, [d["matvec_bandwidth_s"] * 1e3 for d in decode], "-.", color="C1",
                    label="bytes / matrix-vector bandwidth")
    ax_lat.set(xscale="log", xlabel="batch size B", ylabel="ms per decode step",
               title=f"decode latency (S = {d1['context_len']})")
    ax_lat.legend(fontsize=8)
    ax_tp.plot(bs, [d["tokens_per_second"] for d in decode], "o-", label="measured")
    ax_tp.plot(bs, [d["batch_size"] / d["predicted_seconds"] for d in decode], "k--", label="predicted")
    ax_tp.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="tokens / s", title="decode throughput")
    _plain_log_labels(ax_tp.yaxis)
    ax_tp.legend(fontsize=8)
    for ax in (ax_lat, ax_tp):
        ax.set_xticks(bs, [str(b) for b in bs])
    fig.tight_layout()
    return fig
