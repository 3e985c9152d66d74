"""`python -m cs336_inference bench roofline`: this machine's roofline, measured, and a real model on it.

1. `measure_hardware`: peak matmul FLOP/s and streaming bandwidth -> accelerator intensity.
2. `roofline_sweep`: Y = X @ W (W larger than the caches) for B = 1 ... 1024: achieved FLOP/s
   against min(peak, intensity * bandwidth); where the knee falls.
3. The "bench-90m" TransformerLM (~88M parameters): prefill vs decode time per token, and decode
   latency/throughput vs batch size against `accounting`'s prediction on the measured numbers.
Writes figures/roofline_<device>.json, roofline_matmul_<device>.png, roofline_model_<device>.png.
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import torch

from ..accounting.model_roofline import matvec_bandwidth, measure_decode, measure_prefill
from ..accounting.plots import plot_model, plot_roofline
from ..accounting.roofline import measure_hardware, roofline_sweep
from ..device import default_dtype, get_device, seed_everything, thread_policy
from ..figures import save_figure, save_json
from ..model.config import ModelConfig
from ..model.transformer import TransformerLM
from ..tables import print_table
from ..timing import num_threads


def threads_for_timing(device: torch.device) -> int:
    """Threads a benchmark times large work with: `device.thread_policy(parallel=True)` (kept for the
    benchmarks written against this name; new code calls `apply_thread_policy(parallel=True)`)."""
    return thread_policy(parallel=True) if torch.device(device).type == "cpu" else torch.get_num_threads()


def bench_roofline(quick: bool = False, device: str | None = None) -> dict:
    """Measure, sweep, time the model; print tables; write JSON and two figures."""
    device = get_device(device)
    with num_threads(thread_policy(parallel=True)):  # large work: every core (device.py)
        return _bench_roofline(quick, device)


def _bench_roofline(quick: bool, device: torch.device) -> dict:
    dtype = default_dtype(device)
    seed_everything(0)
    hw = measure_hardware(device, quick=quick)
    print(f"{hw.summary()} (load average {os.getloadavg()[0]:.1f})")
    sweep = roofline_sweep(device, batch_sizes=[2**i for i in range(9 if quick else 11)],
                           repeats=2 if quick else 5, hardware=hw)
    rows = [dict(B=b, ms=t * 1e3, intensity=ai, achieved=a / 1e9, roof=p / 1e9, pct=100 * a / p)
            for b, t, ai, a, p in zip(sweep.batch_sizes, sweep.seconds, sweep.intensity, sweep.achieved_flops,
                                      sweep.predicted_flops)]
    print_table(rows, [("B", "B", "{:d}"), ("ms", "ms", "{:.2f}"), ("intensity", "FLOP/B", "{:.1f}"),
                       ("achieved", "GFLOP/s", "{:.1f}"), ("roof", "roofline", "{:.1f}"),
                       ("pct", "% of roof", "{:.0f}%")],
                title=f"\nY = X @ W, W {sweep.d_in}x{sweep.d_out} {sweep.dtype}")
    knee = sweep.knee_batch_size()
    print(f"ridge (predicted) at B = {sweep.ridge_batch_size:.1f}; measured knee (80% of best) at B = {knee}")

    config = ModelConfig.from_name("bench-90m")
    model = TransformerLM(config, device=device, dtype=dtype).eval()
    print(f"\nbench-90m: {model.num_parameters() / 1e6:.1f}M parameters, {dtype}, "
          f"{model.num_parameters() * model.lm_head.weight.element_size() / 1e6:.0f} MB of weights")
    # Re-measure the roofs right before the model runs: on a shared machine the load drifts, and the
    # prediction should use the bandwidth of the same minute (side by side, as the numbers compare).
    hw = measure_hardware(device, quick=quick)
    gemv_bw = matvec_bandwidth(roofline_sweep(device, batch_sizes=[1], repeats=5, hardware=hw))
    print(f"re-measured before the model: {hw.summary()}; matrix-vector (B=1) bandwidth {gemv_bw / 1e9:.1f} GB/s")
    context = 128 if quick else 256
    prefill = measure_prefill(model, context, hw, repeats=2 if quick else 3)
    batch_sizes = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    decode = [measure_decode(model, b, context, hw, repeats=3 if quick else 7) for b in batch_sizes]
    for d in decode:
        d["matvec_bandwidth_s"] = d["bytes"] / gemv_bw
    print(f"prefill {context} tokens: {prefill['seconds'] * 1e3:.1f} ms = "
          f"{prefill['seconds_per_token'] * 1e3:.2f} ms/token ({prefill['achieved_flops'] / 1e9:.1f} GFLOP/s); "
          f"predicted {prefill['predicted_seconds'] * 1e3:.1f} ms")
    print_table([dict(B=d["batch_size"], ms=d["seconds"] * 1e3, matmuls=d["matmul_only_seconds"] * 1e3,
                      tok=d["tokens_per_second"], mb=d["bytes"] / 1e6, gbps=d["achieved_bandwidth"] / 1e9,
                      pred=d["predicted_seconds"] * 1e3, ratio=d["seconds"] / d["predicted_seconds"])
                 for d in decode],
                [("B", "B", "{:d}"), ("ms", "ms/step", "{:.2f}"), ("matmuls", "matmuls", "{:.2f}"),
                 ("tok", "tok/s", "{:.1f}"), ("mb", "MB read", "{:.1f}"), ("gbps", "GB/s", "{:.1f}"),
                 ("pred", "pred ms", "{:.2f}"), ("ratio", "meas/pred", "{:.2f}")],
                title=f"decode at S = {context}:")
    d1 = decode[0]
    print(f"decode B=1: {d1['seconds'] * 1e3:.2f} ms/token vs bytes/bandwidth {d1['predicted_memory_s'] * 1e3:.2f} ms "
          f"(ratio {d1['seconds'] / d1['predicted_memory_s']:.2f}); vs bytes / matrix-vector bandwidth "
          f"({gemv_bw / 1e9:.1f} GB/s, a B=1 matmul re-measured) {d1['matvec_bandwidth_s'] * 1e3:.2f} ms "
          f"(ratio {d1['seconds'] / d1['matvec_bandwidth_s']:.2f}); prefill is "
          f"{d1['seconds'] / prefill['seconds_per_token']:.0f}x cheaper per token than B=1 decode")

    suffix = device.type
    data = dict(device=device.type, quick=quick, hardware_sweep=sweep.to_dict()["hardware"], hardware_model=dict(
        device=hw.device, dtype=hw.dtype, peak_flops=hw.peak_flops, memory_bandwidth=hw.memory_bandwidth,
        accelerator_intensity=hw.accelerator_intensity, units=[hw.flops_unit, hw.bandwidth_unit, hw.intensity_unit]),
        sweep=sweep.to_dict(), matvec_bandwidth_model=gemv_bw,
        model=dict(name="bench-90m", parameters=model.num_parameters(), dtype=str(dtype), prefill=prefill,
                   decode=decode),
        load_average_at_end=list(os.getloadavg()), threads=torch.get_num_threads(),
        note="medians of repeats; on a shared machine other processes compete (see load_average_at_end)")
    paths = [save_figure(plot_roofline(sweep), f"roofline_matmul_{suffix}", result=True, quick=quick),
             save_figure(plot_model(prefill, decode), f"roofline_model_{suffix}", result=True, quick=quick),
             save_json(data, f"roofline_{suffix}", result=True, quick=quick)]
    for p in paths:
        print("wrote", p)
    plt.close("all")
    return data
