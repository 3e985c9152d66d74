"""`bench roofline`: this machine's roofline, measured (`measure_hardware`, `roofline_sweep` of
Y = X @ W), and the bench-90m model's prefill and decode on it next to `accounting`'s prediction.
"""

from __future__ import annotations

import torch

from ...accounting.model_roofline import matvec_bandwidth, measure_decode, measure_prefill
from ...accounting.plots import plot_model, plot_roofline
from ...accounting.roofline import RooflineSweep, measure_hardware, roofline_sweep
from ..cpu_tuning import tune_for_cpu
from ...device import default_dtype
from ...model.config import ModelConfig
from ...model.transformer import TransformerLM
from ...tables import print_table
from .. import huge_pages
from .base import Benchmark


def measure(run) -> dict:
    device, quick = run.device, run.quick
    run.name = f"roofline_{device.type}"
    hw = measure_hardware(device, quick=quick, empty=huge_pages.empty)
    sweep = roofline_sweep(device, batch_sizes=[2**i for i in range(9 if quick else 11)],
                           repeats=2 if quick else 5, hardware=hw)
    dtype = default_dtype(device)
    model = tune_for_cpu(TransformerLM(ModelConfig.from_name("bench-90m"), device=device, dtype=dtype).eval())
    # Re-measure the roofs right before the model runs: on a shared machine the load drifts, and the
    # prediction should use the bandwidth of the same minute.
    hw = measure_hardware(device, quick=quick, empty=huge_pages.empty)
    gemv_bw = matvec_bandwidth(roofline_sweep(device, batch_sizes=[1], repeats=5, hardware=hw))
    context = 128 if quick else 256
    prefill = measure_prefill(model, context, hw, repeats=2 if quick else 3)
    decode = [measure_decode(model, b, context, hw, repeats=3 if quick else 7)
              for b in ([1, 4, 16] if quick else [1, 2, 4, 8, 16, 32, 64])]
    for d in decode:
        d["matvec_bandwidth_s"] = d["bytes"] / gemv_bw
    return dict(device=device.type, hardware_sweep=sweep.to_dict()["hardware"], hardware_model=dict(
        device=hw.device, dtype=hw.dtype, peak_flops=hw.peak_flops, memory_bandwidth=hw.memory_bandwidth,
        accelerator_intensity=hw.accelerator_intensity, units=[hw.flops_unit, hw.bandwidth_unit, hw.intensity_unit]),
        sweep=sweep.to_dict(), matvec_bandwidth_model=gemv_bw,
        model=dict(name="bench-90m", parameters=model.num_parameters(), dtype=str(dtype), prefill=prefill,
                   decode=decode),
        threads=torch.get_num_threads(), note="medians of repeats on a shared machine (see machine.load_avg)")


def print_tables(data: dict) -> None:
    sweep, hw = RooflineSweep.from_dict(data["sweep"]), data["hardware_model"]
    print_table([dict(B=b, ms=t * 1e3, intensity=ai, achieved=a / 1e9, roof=p / 1e9, pct=100 * a / p)
                 for b, t, ai, a, p in zip(sweep.batch_sizes, sweep.seconds, sweep.intensity, sweep.achieved_flops,
                                           sweep.predicted_flops)],
                [("B", "B", "{:d}"), ("ms", "ms", "{:.2f}"), ("intensity", "FLOP/B", "{:.1f}"),
                 ("achieved", "GFLOP/s", "{:.1f}"), ("roof", "roofline", "{:.1f}"), ("pct", "% of roof", "{:.0f}%")],
                title=f"{sweep.hardware.summary()}\nY = X @ W, W {sweep.d_in}x{sweep.d_out} {sweep.dtype}")
    print(f"ridge (predicted) at B = {sweep.ridge_batch_size:.1f}; measured knee (80% of best) at "
          f"B = {sweep.knee_batch_size()}")
    m, gemv_bw = data["model"], data["matvec_bandwidth_model"]
    prefill, decode = m["prefill"], m["decode"]
    print(f"\nbench-90m, {m['parameters'] / 1e6:.1f}M parameters, {m['dtype']}; roofs re-measured before the model: "
          f"peak {hw['peak_flops'] / 1e9:.1f} GFLOP/s, bandwidth {hw['memory_bandwidth'] / 1e9:.1f} GB/s, "
          f"matrix-vector (B=1) bandwidth {gemv_bw / 1e9:.1f} GB/s")
    print(f"prefill {prefill['seconds_per_token'] * 1e3:.2f} ms/token ({prefill['achieved_flops'] / 1e9:.1f} "
          f"GFLOP/s; predicted {prefill['predicted_seconds'] * 1e3:.1f} ms for the prompt)")
    print_table([dict(B=d["batch_size"], ms=d["seconds"] * 1e3, matmuls=d["matmul_only_seconds"] * 1e3,
                      tok=d["tokens_per_second"], mb=d["bytes"] / 1e6, gbps=d["achieved_bandwidth"] / 1e9,
                      pred=d["predicted_seconds"] * 1e3, ratio=d["seconds"] / d["predicted_seconds"],
                      gemv=d["seconds"] / d["matvec_bandwidth_s"]) for d in decode],
                [("B", "B", "{:d}"), ("ms", "ms/step", "{:.2f}"), ("matmuls", "matmuls", "{:.2f}"),
                 ("tok", "tok/s", "{:.1f}"), ("mb", "MB read", "{:.1f}"), ("gbps", "GB/s", "{:.1f}"),
                 ("pred", "pred ms", "{:.2f}"), ("ratio", "meas/pred", "{:.2f}"),
                 ("gemv", "meas/(bytes/matvec bw)", "{:.2f}")],
                title=f"decode at S = {decode[0]['context_len']}:")


BENCHMARK = bench_roofline = Benchmark(
    "roofline", measure, print_tables, parallel=True, results=("roofline_cpu",),
    plots={"roofline_matmul_{device}": lambda d: plot_roofline(RooflineSweep.from_dict(d["sweep"])),
           "roofline_model_{device}": lambda d: plot_model(d["model"]["prefill"], d["model"]["decode"])})
