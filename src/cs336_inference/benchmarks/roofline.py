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
from matplotlib.ticker import FuncFormatter
import torch

from ..accounting.formulas import decode_step_bytes, forward_flops
from ..model.config import ModelConfig
from ..device import apply_thread_policy, default_dtype, get_device, seed_everything
from ..figures import save_figure, save_json
from ..model.transformer import TransformerLM
from ..accounting.roofline import HardwareMeasurement, RooflineSweep, _element_size, measure_hardware, roofline_sweep
from ..timing import median_seconds

PRECISION_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@torch.inference_mode()
def measure_prefill(model: TransformerLM, prompt_len: int, hardware: HardwareMeasurement, repeats: int = 3) -> dict:
    """Time one prefill of a random prompt (B = 1) and predict it: max(FLOPs / peak, bytes / bandwidth)."""
    cfg, precision = model.config, PRECISION_OF[model.dtype]
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=model.device)
    caches = [model.new_cache(1, prompt_len) for _ in range(repeats + 2)]
    seconds = median_seconds(lambda: model(ids, cache=caches.pop(), last_only=True), model.device, repeats)
    flops = forward_flops(cfg, 1, prompt_len, 0, last_only=True)
    nbytes = decode_step_bytes(cfg, 1, prompt_len, precision)
    predicted = max(flops / hardware.peak_flops, nbytes / hardware.memory_bandwidth)
    return dict(prompt_len=prompt_len, seconds=seconds, seconds_per_token=seconds / prompt_len, flops=flops,
                achieved_flops=flops / seconds, predicted_seconds=predicted)


@torch.inference_mode()
def measure_decode(model: TransformerLM, batch_size: int, context_len: int, hardware: HardwareMeasurement,
                   repeats: int = 5) -> dict:
    """Time one decode step of B sequences at context S and predict it from bytes and FLOPs.

    The cache is marked as holding S tokens without running a prefill (its contents do not change
    the time, and a B = 64 prefill would cost minutes on a CPU); after each timed step it is
    truncated back to S so every repeat reads the same S + 1 positions.
    """
    cfg, precision = model.config, PRECISION_OF[model.dtype]
    cache = model.new_cache(batch_size, context_len + 1)
    cache.length = context_len  # pretend S tokens are cached (global attention: nothing else to set)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, 1), device=model.device)

    def step():
        model(ids, cache=cache)
        cache.truncate(context_len)

    seconds = median_seconds(step, model.device, repeats)
    # The same step's weight matmuls alone (B rows through every nn.Linear): splits the gap to the
    # prediction into "BLAS does not stream weights at full bandwidth" and "everything else".
    # The model's own Linear modules, so the matmuls run the same kernel path as inside the step.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch_size, m.in_features, device=model.device, dtype=model.dtype)
              for m in linears}
    with torch.inference_mode():
        matmul_seconds = median_seconds(lambda: [m(inputs[m.in_features]) for m in linears], model.device, repeats)
    nbytes = decode_step_bytes(cfg, batch_size, context_len + 1, precision)
    flops = forward_flops(cfg, batch_size, 1, context_len)
    t_mem, t_compute = nbytes / hardware.memory_bandwidth, flops / hardware.peak_flops
    return dict(batch_size=batch_size, context_len=context_len, seconds=seconds, matmul_only_seconds=matmul_seconds,
                tokens_per_second=batch_size / seconds, bytes=nbytes, flops=flops,
                predicted_memory_s=t_mem, predicted_compute_s=t_compute, predicted_seconds=max(t_mem, t_compute),
                achieved_bandwidth=nbytes / seconds)


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
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set(xlabel="batch size B (rows of X)", ylabel="GFLOP/s",
           title=f"Roofline of {hw.device}\nW = {sweep.d_in}x{sweep.d_out} {sweep.dtype}, "
                 f"peak {hw.peak_flops / 1e9:,.0f} GFLOP/s, bandwidth {hw.memory_bandwidth / 1e9:,.1f} GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def matvec_bandwidth(sweep: RooflineSweep) -> float | None:
    """Bytes/s the B = 1 point of the sweep (a matrix-vector product) actually streamed: the bandwidth
    a decode step's matmuls can hope for, which BLAS often leaves below the streaming measurement."""
    if 1 not in sweep.batch_sizes:
        return None
    i = sweep.batch_sizes.index(1)
    e = _element_size(sweep.dtype)
    return e * (sweep.d_in + sweep.d_in * sweep.d_out + sweep.d_out) / sweep.seconds[i]


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
    ax_tp.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_tp.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_tp.legend(fontsize=8)
    for ax in (ax_lat, ax_tp):
        ax.set_xticks(bs, [str(b) for b in bs])
    fig.tight_layout()
    return fig


def bench_roofline(quick: bool = False, device: str | None = None) -> dict:
    """Measure, sweep, time the model; print tables; write JSON and two figures."""
    device = get_device(device)
    threads_before = torch.get_num_threads()
    apply_thread_policy(parallel=True)   # big matmuls: every core, idle OpenMP workers sleep (device.py)
    try:
        return _bench_roofline(quick, device)
    finally:
        torch.set_num_threads(threads_before)


def _bench_roofline(quick: bool, device: torch.device) -> dict:
    dtype = default_dtype(device)
    seed_everything(0)
    hw = measure_hardware(device, quick=quick)
    print(f"{hw.summary()} (load average {os.getloadavg()[0]:.1f})")
    sweep = roofline_sweep(device, batch_sizes=[2**i for i in range(9 if quick else 11)],
                           repeats=2 if quick else 5, hardware=hw)
    print(f"\nY = X @ W, W {sweep.d_in}x{sweep.d_out} {sweep.dtype}")
    print(f"{'B':>5s} {'ms':>8s} {'FLOP/B':>7s} {'GFLOP/s':>9s} {'roofline':>9s} {'% of roof':>9s}")
    for b, t, ai, a, p in zip(sweep.batch_sizes, sweep.seconds, sweep.intensity, sweep.achieved_flops,
                              sweep.predicted_flops):
        print(f"{b:5d} {t * 1e3:8.2f} {ai:7.1f} {a / 1e9:9.1f} {p / 1e9:9.1f} {100 * a / p:8.0f}%")
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
    print(f"prefill {context} tokens: {prefill['seconds'] * 1e3:.1f} ms = {prefill['seconds_per_token'] * 1e3:.2f} ms/token "
          f"({prefill['achieved_flops'] / 1e9:.1f} GFLOP/s); predicted {prefill['predicted_seconds'] * 1e3:.1f} ms")
    print(f"decode at S = {context}:")
    print(f"{'B':>4s} {'ms/step':>8s} {'matmuls':>8s} {'tok/s':>8s} {'MB read':>8s} {'GB/s':>6s} {'pred ms':>8s} "
          f"{'meas/pred':>9s}")
    for d in decode:
        print(f"{d['batch_size']:4d} {d['seconds'] * 1e3:8.2f} {d['matmul_only_seconds'] * 1e3:8.2f} "
              f"{d['tokens_per_second']:8.1f} {d['bytes'] / 1e6:8.1f} "
              f"{d['achieved_bandwidth'] / 1e9:6.1f} {d['predicted_seconds'] * 1e3:8.2f} "
              f"{d['seconds'] / d['predicted_seconds']:9.2f}")
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
        sweep=sweep.to_dict(), matvec_bandwidth_model=gemv_bw, model=dict(name="bench-90m", parameters=model.num_parameters(), dtype=str(dtype),
                                          prefill=prefill, decode=decode),
        load_average_at_end=list(os.getloadavg()), threads=torch.get_num_threads(),
        note="medians of repeats; on a shared machine other processes compete (see load_average_at_end)")
    paths = [save_figure(plot_roofline(sweep), f"roofline_matmul_{suffix}"),
             save_figure(plot_model(prefill, decode), f"roofline_model_{suffix}"),
             save_json(data, f"roofline_{suffix}")]
    for p in paths:
        print("wrote", p)
    plt.close("all")
    return data
