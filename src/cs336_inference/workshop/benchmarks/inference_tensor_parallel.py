"""`bench inference --tensor-parallel-size N`: the operating points served on one device and over N ranks.

The same workloads (fp32, paged KV) go to the serving `Engine` in this process and to the tensor-parallel
engine (`parallel.engine`: rank 0 schedules and broadcasts each step, every rank runs its shard) over N
local ranks (gloo on 127.0.0.1, the cores divided among the ranks; started once for every workload). Beside
vLLM's serving metrics and each request's queueing / prefill / decode split, a row of N ranks carries the
seconds rank 0 spent in collectives, split by the kind of step (steps with a prefill chunk, decode-only
steps) and by collective (the all-reduces of the row-parallel layers, the broadcast of each step's inputs),
and the share of the decode steps' time that was communication. No collective runs while a request
only waits, so its queueing time has no communication of its own.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from ...accounting.communication import tensor_parallel_step_seconds
from ...device import load_avg
from ...model.checkpoints import load_pretrained
from ...model.real_models import REAL_MODELS
from ...model.tokenizer import load_tokenizer
from ...parallel import check_tensor_parallel
from ...parallel.engine import serve_tensor_parallel_runs
from ...parallel.generate import named_config
from ...serving import Engine, benchmark_metrics, flat_metrics
from ...tables import print_table
from .base import Benchmark
from ...parallel.decode_split import probe_allreduce
from .tensor_parallel import PROBE_BYTES
from .inference_sweep import RunSpec, engine_options, source_and_stop, sweep_config, workload_row


PROBE_REPS = 50   # tiny all-reduces timed for the latency (a tenth as many large ones for the bandwidth)


def engine_row(result, seconds: float | None = None) -> dict:
    """A served run's metrics, and its steps' time by kind (simulated clock = measured step time)."""
    prefill = [s for s in result.steps if s.num_prefills]
    decode = [s for s in result.steps if not s.num_prefills]
    return {**flat_metrics(benchmark_metrics(result.outputs)), "steps": len(result.steps),
            "prefill_steps": len(prefill), "decode_steps": len(decode),
            "prefill_step_s": sum(s.end - s.start for s in prefill),
            "decode_step_s": sum(s.end - s.start for s in decode),
            "kv_pool_bytes": result.capacity_tokens * result.bytes_per_token}


def communication_row(communication: dict, decode_step_s: float) -> dict:
    """Rank 0's seconds in collectives per kind of step, and their share of the decode steps' time."""
    row = {}
    for phase in ("prefill", "decode"):
        c = communication[phase]
        row |= {f"{phase}_all_reduce_s": c["all_reduce_s"], f"{phase}_broadcast_s": c["broadcast_s"],
                f"communication_{phase}_s": c["all_reduce_s"] + c["broadcast_s"]}
    row["communication_s"] = row["communication_prefill_s"] + row["communication_decode_s"]
    row["decode_communication_share"] = row["communication_decode_s"] / decode_step_s if decode_step_s else None
    return row


def loopback_probe() -> tuple[float, float]:
    """(latency per ring step, bandwidth) of all-reduces among the ranks, probed on every rank."""
    return probe_allreduce(PROBE_REPS, PROBE_BYTES)


def ring_prediction(steps: list[dict], config, p: int, latency: float, bandwidth: float) -> dict:
    """The ring formula's all-reduce seconds for the steps served (each step: 2L all-reduces of its
    tokens' fp32 activations), per kind of step, beside the measured all-reduce seconds."""
    out = {"loopback_latency_s": latency, "loopback_bandwidth_Bps": bandwidth}
    for phase in ("prefill", "decode"):
        out[f"predicted_{phase}_all_reduce_s"] = sum(
            tensor_parallel_step_seconds(config.num_layers, config.d_model, p, bandwidth, latency,
                                         num_tokens=s["num_tokens"], bytes_per_element=4)
            for s in steps if s["phase"] == phase)
    return out


def measure_tensor_parallel(run, model: str, tensor_parallel_size: int, preset: str | None = None,
                            changes: dict | None = None, sweep=None, progress: bool = True) -> dict:
    """Every operating point (or `preset`; `changes` such as {"concurrency": 4}) served in process on one
    device and over `tensor_parallel_size` ranks; one row of each per workload."""
    p = tensor_parallel_size
    if isinstance(p, bool) or not isinstance(p, int) or p < 2:
        raise ValueError(f"tensor_parallel_size must be an int >= 2 (ranks to shard over), got {p!r}")
    if run.device.type != "cpu":
        raise ValueError(f"bench inference --tensor-parallel-size runs its ranks on the CPU (gloo); "
                         f"device {run.device} was asked")
    check_tensor_parallel(named_config(model), p)   # before anything loads or starts
    real = model in REAL_MODELS
    config = sweep or sweep_config(real, run.quick)
    points = config.presets
    if preset is not None:
        points = {preset: points[preset]}
    specs = [RunSpec("preset", w.replace(**(changes or {})), "fp32") for w in points.values()]
    run.name = f"inference_tp{p}" + ("" if model == "target" else f"_{model.replace('-', '_')}") + \
        (f"_{preset}" if preset else "")
    run.committed = preset is None and sweep is None and not changes

    load_before, tok = load_avg(), load_tokenizer(model)
    text, stop = source_and_stop(tok, real)
    source = text.tolist()
    warm = config.warmup.requests(source, tok, stop)
    traces = [s.workload.requests(source, tok, stop) for s in specs]
    options = [engine_options(t, s.workload.concurrency) for s, t in zip(specs, traces)]

    reference = load_pretrained(model).eval()   # fp32, unfused: the weights every rank shards
    Engine(reference, **engine_options(warm, config.warmup.concurrency)).run(warm)
    rows = []
    for spec, trace, opts in tqdm(list(zip(specs, traces, options)), desc="bench inference (1 device)",
                                  disable=not progress, unit="run"):
        result = Engine(reference, **opts).run(trace)
        row = engine_row(result)
        rows.append({**workload_row(spec), "ranks": 1, "threads": torch.get_num_threads(), **row,
                     **communication_row({k: {"all_reduce_s": 0.0, "broadcast_s": 0.0} for k in ("prefill", "decode")},
                                         row["decode_step_s"])})
    del reference
    served = serve_tensor_parallel_runs(model, [(warm, engine_options(warm, config.warmup.concurrency))]
                                        + list(zip(traces, options)), p, before=loopback_probe)
    latency, bandwidth = served["before"]
    model_config = named_config(model)
    for spec, out in zip(specs, served["runs"][1:]):
        row = engine_row(out["result"])
        rows.append({**workload_row(spec), "ranks": p, **row,
                     **communication_row(out["communication"], row["decode_step_s"]),
                     **ring_prediction(out["steps"], model_config, p, latency, bandwidth)})
    return {"benchmark": "inference", "mode": "tensor_parallel", "model": model, "device": "cpu",
            "backend": "gloo", "tensor_parallel_size": p, "dtype": "fp32", "kv_layout": "paged",
            "threads_one_device": torch.get_num_threads(), "load_avg_before": load_before,
            "load_avg_after": load_avg(), "preset": preset,
            "workloads": [dataclasses.asdict(s.workload) for s in specs], "rows": rows}


def print_tensor_parallel_inference(result: dict) -> None:
    p = result["tensor_parallel_size"]
    print(f"\nbench inference --tensor-parallel-size {p}: {result['model']} fp32, paged KV, gloo on 127.0.0.1; "
          f"load average {result['load_avg_before']} -> {result['load_avg_after']}")

    def ms(key, header):
        return (key, header, lambda v: "-" if v is None else f"{1e3 * v:.1f}")
    print_table(result["rows"], [
        ("workload", "operating point", None), ("ranks", "ranks", None), ("num_requests", "requests", None),
        ("output_throughput", "out tok/s", "{:,.0f}"), ms("ttft_median_s", "TTFT p50 ms"),
        ms("tpot_median_s", "TPOT p50 ms"), ms("queueing_mean_s", "queueing ms"), ms("prefill_mean_s", "prefill ms"),
        ms("decode_mean_s", "decode ms"), ms("communication_prefill_s", "comm in prefill steps ms"),
        ms("communication_decode_s", "comm in decode steps ms"), ms("decode_broadcast_s", "of it broadcast ms"),
        ms("decode_all_reduce_s", "all-reduce ms"), ms("predicted_decode_all_reduce_s", "ring formula ms"),
        ("decode_communication_share", "comm % of decode steps", lambda v: "-" if v is None else f"{100 * v:.0f}")],
        title="\nOne device vs tensor-parallel ranks (per request: mean queueing / prefill / decode; rank 0's "
              "seconds in collectives over the whole run, by kind of step)")


def plot_tensor_parallel_inference(result: dict):
    """Per operating point: the decode steps' mean time on one device and on N ranks, communication shaded."""
    rows = [r for r in result["rows"] if r["decode_steps"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['workload']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in rows]
    total = [1e3 * r["decode_step_s"] / r["decode_steps"] for r in rows]
    comm = [1e3 * r["communication_decode_s"] / r["decode_steps"] for r in rows]
    ax.bar(labels, [t - c for t, c in zip(total, comm)], label="compute (and the rest)")
    ax.bar(labels, comm, bottom=[t - c for t, c in zip(total, comm)], hatch="//", label="collectives (rank 0)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['model']}: one device vs {result['tensor_parallel_size']} ranks (gloo, fp32)")
    ax.legend()
    fig.tight_layout()
    return fig


def csv_rows(result: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if not isinstance(v, (dict, list))} for r in result["rows"]]


# the Benchmark whose table, CSV and plot present a --tensor-parallel-size result (`bench inference` measures it)
TENSOR_PARALLEL = Benchmark("inference_tensor_parallel", measure_tensor_parallel, print_tensor_parallel_inference,
                            csv=csv_rows, plots={"{name}_decode": plot_tensor_parallel_inference})
