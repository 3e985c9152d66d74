"""`bench tensor_parallel`: one workload on 1 rank and on N tensor-parallel ranks, communication measured.

The same model, prompt and greedy decode run in `launch`ed worker processes (gloo on a CPU): once on one
rank, unsharded, with every core, then on N ranks (`parallel.shard_model`), the cores split among them.
Each forward's time is split into the seconds spent inside all-reduces (`CollectiveTimer`, on rank 0: the
time includes waiting for the slowest rank) and the rest. Beside it, the ring all-reduce formula
(`accounting.communication`) predicts the communication from this machine's loopback latency and
bandwidth, probed with tiny and large all-reduces among the same ranks just before the workload.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from ...accounting.communication import allreduce_bytes_per_step, tensor_parallel_step_seconds
from ...model.checkpoints import load_pretrained
from ...model.real_models import real_model_missing
from ...parallel import check_tensor_parallel, launch, shard_model
from ...parallel.decode_split import probe_allreduce
from ...tables import print_table
from .base import Benchmark

MODELS = ("target", "smollm2-135m")
PROBE_BYTES = 4 << 20     # the large all-reduce of the bandwidth probe


def phase(timer, name: str):
    return timer.phase(name) if timer is not None else nullcontext()


def _timed(model, *args, **kwargs):
    """model(*args, **kwargs) and its seconds (a CPU forward has finished when it returns)."""
    t0 = time.perf_counter()
    out = model(*args, **kwargs)
    return out, time.perf_counter() - t0


def _rank_run(model_name: str, shard: bool, batch_sizes: tuple, prompt_len: int, new_tokens: int,
              probe_reps: int) -> dict:
    model = load_pretrained(model_name).eval()
    rank, p = dist.get_rank(), dist.get_world_size()
    timer = shard_model(model, rank, p).tp_timer if shard else None
    latency, bandwidth = probe_allreduce(probe_reps, PROBE_BYTES) if shard else (None, None)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for B in batch_sizes:
        prompt = torch.randint(0, model.config.vocab_size, (B, prompt_len), generator=generator)
        for _ in range(2):   # the first round warms up (allocations, gloo buffers); the second is kept
            cache = model.new_cache(B, prompt_len + new_tokens)
            if timer is not None:
                timer.reset()
            with torch.no_grad():
                with phase(timer, "prefill"):
                    logits, prefill_s = _timed(model, prompt, cache, last_only=True)
                token, steps = logits.argmax(-1), []
                with phase(timer, "decode"):
                    for _ in range(new_tokens):
                        logits, seconds = _timed(model, token, cache)
                        token = logits.argmax(-1)
                        steps.append(seconds)
        comm = timer.seconds() if timer is not None else {}
        comm_prefill, comm_decode = comm.get("prefill", 0.0), comm.get("decode", 0.0)
        rows.append(dict(batch=B, prefill_s=prefill_s, prefill_comm_s=comm_prefill,
                         decode_step_s=statistics.median(steps), decode_step_mean_s=sum(steps) / len(steps),
                         decode_comm_per_step_s=comm_decode / new_tokens))
    return dict(rows=rows, latency_s=latency, bandwidth_Bps=bandwidth, threads=torch.get_num_threads())


def measure(run, model: str = "target", tensor_parallel_size: int | None = None) -> dict | None:
    if model not in MODELS:
        raise ValueError(f"bench tensor_parallel runs one of {MODELS}, got model={model!r}")
    if model != "target" and (missing := real_model_missing(model)):
        print(f"bench tensor_parallel skipped: {missing}")
        return None
    if run.device.type != "cpu":
        print(f"bench tensor_parallel runs its ranks on the CPU (gloo); {run.device} was asked")
        return None
    if model != "target":
        run.name = f"tensor_parallel_{model.replace('-', '_')}"
    config = load_pretrained(model).config
    p = tensor_parallel_size or (2 if config.num_kv_heads % 2 == 0 else config.num_kv_heads)
    check_tensor_parallel(config, p)
    batch_sizes, prompt_len, new_tokens, reps = ((1, 4), 32, 8, 50) if run.quick else ((1, 4, 16), 64, 32, 200)
    args = (model, batch_sizes, prompt_len, new_tokens, reps)
    # the toy runs one thread per rank (as the other toy benchmarks); a real model splits the cores among the ranks
    cores = 1 if model == "target" else os.cpu_count() or 1
    one = launch(_rank_run, 1, model, False, *args[1:], threads_per_rank=cores, timeout_s=1200)
    tp = launch(_rank_run, p, model, True, *args[1:], threads_per_rank=max(1, cores // p), timeout_s=1200)
    rows = []
    for single, sharded in zip(one["rows"], tp["rows"]):
        B = single["batch"]
        predict = dict(world_size=p, bandwidth=tp["bandwidth_Bps"], latency=tp["latency_s"], batch_size=B,
                       bytes_per_element=4)
        rows.append(dict(batch=B, **{f"one_{k}": v for k, v in single.items() if k != "batch"},
                         **{f"tp_{k}": v for k, v in sharded.items() if k != "batch"},
                         bytes_per_decode_step=allreduce_bytes_per_step(config.num_layers, config.d_model, B,
                                                                        bytes_per_element=4),
                         predicted_decode_comm_s=tensor_parallel_step_seconds(config.num_layers, config.d_model,
                                                                              **predict),
                         predicted_prefill_comm_s=tensor_parallel_step_seconds(
                             config.num_layers, config.d_model, num_tokens=prompt_len, **predict)))
    for r in rows:
        r["tp_decode_comm_share"] = r["tp_decode_comm_per_step_s"] / r["tp_decode_step_mean_s"]   # both means
        r["measured_over_predicted"] = r["tp_decode_comm_per_step_s"] / r["predicted_decode_comm_s"]
    return dict(model=model, tensor_parallel_size=p, backend="gloo", dtype="fp32", prompt_len=prompt_len,
                new_tokens=new_tokens, num_layers=config.num_layers, d_model=config.d_model,
                loopback_latency_s=tp["latency_s"], loopback_bandwidth_Bps=tp["bandwidth_Bps"],
                threads_one_rank=one["threads"], threads_per_tp_rank=tp["threads"], rows=rows)


def print_tensor_parallel(result: dict) -> None:
    p = result["tensor_parallel_size"]
    print(f"\n{result['model']} ({result['dtype']}, {result['backend']}): 1 rank ({result['threads_one_rank']} "
          f"threads) vs TP={p} ({result['threads_per_tp_rank']} threads each); loopback all-reduce probe: "
          f"{result['loopback_latency_s'] * 1e6:.0f} us per ring step, "
          f"{result['loopback_bandwidth_Bps'] / 1e9:.2f} GB/s")

    def ms(digits: int):
        return lambda v: f"{1e3 * v:.{digits}f}"

    print_table(result["rows"], [
        ("batch", "B", None), ("one_decode_step_mean_s", "1 rank ms/step", ms(2)),
        ("tp_decode_step_mean_s", f"TP={p} ms/step", ms(2)),
        ("tp_decode_comm_per_step_s", "comm ms/step", ms(2)), ("predicted_decode_comm_s", "ring formula ms", ms(2)),
        ("tp_decode_comm_share", "comm share", "{:.0%}"), ("bytes_per_decode_step", "bytes/step", "{:.0f}"),
        ("one_prefill_s", "1 rank prefill ms", ms(1)), ("tp_prefill_s", f"TP={p} prefill ms", ms(1)),
        ("tp_prefill_comm_s", "prefill comm ms", ms(1)), ("predicted_prefill_comm_s", "formula ms", ms(1))])


def plot_tensor_parallel(result: dict):
    p, rows = result["tensor_parallel_size"], result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, phase, title in ((axes[0], "decode_step", "decode step"), (axes[1], "prefill", "prefill")):
        comm_key = "tp_decode_comm_per_step_s" if phase == "decode_step" else "tp_prefill_comm_s"
        pred_key = "predicted_decode_comm_s" if phase == "decode_step" else "predicted_prefill_comm_s"
        x = range(len(rows))
        key = "decode_step_mean" if phase == "decode_step" else phase
        one = [1e3 * r[f"one_{key}_s"] for r in rows]
        comm = [1e3 * r[comm_key] for r in rows]
        rest = [1e3 * r[f"tp_{key}_s"] - c for r, c in zip(rows, comm)]
        ax.bar([i - 0.2 for i in x], one, 0.4, label="1 rank", color="C0")
        ax.bar([i + 0.2 for i in x], rest, 0.4, label=f"TP={p}: compute", color="C1")
        ax.bar([i + 0.2 for i in x], comm, 0.4, bottom=rest, label=f"TP={p}: all-reduce", color="C3")
        ax.scatter([i + 0.2 for i in x], [r + 1e3 * row[pred_key] for r, row in zip(rest, rows)], marker="_",
                   s=400, color="k", label="compute + ring formula", zorder=3)
        ax.set_xticks(list(x), [f"B={r['batch']}" for r in rows])
        ax.set(ylabel="ms", title=f"{result['model']}: {title}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


BENCHMARK = Benchmark("tensor_parallel", measure, print_tensor_parallel,
                      parallel=lambda options: options.get("model", "target") != "target",
                      results=("tensor_parallel", "tensor_parallel_smollm2_135m"),
                      plots={"{name}": plot_tensor_parallel})
