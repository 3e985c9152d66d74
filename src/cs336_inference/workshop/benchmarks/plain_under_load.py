"""`bench plain_under_load`: the plain core's `generate` when other work shares the cores.

A plain fp32 `TransformerLM` (no `tune_for_cpu`, no compile, no fused projections) generates greedily
with the hand-written reference attention (`generate(..., attention_kernel="reference")`: matmul,
softmax and matmul as separate ops, each its own multi-threaded region) and with `generate`'s default
(torch's fused `sdpa`, one op per layer), idle and while one busy loop holds a core. Idle and busy
alternate round by round, and the kernels within each, so a drifting load on a shared machine hits
every cell alike. Reported: decode tokens per second (the prefill's first token excluded), the
default's speed over the reference's in each state, and the share of its idle speed each keeps when busy.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ...device import omp_spin_count, omp_wait_policy
from ...generation.generate import generate
from ...model.checkpoints import load_pretrained
from ...model.config import ModelConfig
from ...model.transformer import TransformerLM
from ...tables import print_table
from ...timing import busy_cpu, load_average
from .base import Benchmark, grouped_bars, spread

KERNELS = {"reference": "reference", "default (sdpa)": None}   # label -> generate's attention_kernel
STATES = ("idle", "busy")


def plain_model(model: str | None, quick: bool, device: torch.device) -> tuple[TransformerLM, str]:
    """The plain fp32 model and its name: a real one by name (`load_pretrained`), else random-init
    bench-90m (quick: a smaller model of its kind)."""
    if model is not None:
        return load_pretrained(model, device=device, dtype=torch.float32).eval(), model
    config = ModelConfig.from_name("bench-90m")
    if quick:
        config = config.replace(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=768)
    return TransformerLM(config, device=device).eval(), "bench-90m" + (" (quick: smaller)" if quick else "")


def measure(run, model: str | None = None) -> dict:
    """model: None times a random-init bench-90m; a real model's name (smollm2-135m) times that model."""
    lm, name = plain_model(model, run.quick, run.device)
    new_tokens, rounds = (8, 1) if run.quick else (16, 3)
    prompt = torch.randint(0, lm.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = {}

    def decode_tokens_per_second(label: str) -> float:
        result = generate(lm, prompt, new_tokens, attention_kernel=KERNELS[label])
        tokens[label] = result.tokens
        return (new_tokens - 1) / (result.token_times[-1] - result.token_times[0])

    for label in KERNELS:   # warm up: first calls allocate and pick kernels
        generate(lm, prompt, 2, attention_kernel=KERNELS[label])
    speeds = {(state, label): [] for state in STATES for label in KERNELS}
    loads = {state: [] for state in STATES}
    for _ in range(rounds):
        for state in STATES:
            with busy_cpu(1) if state == "busy" else contextlib.nullcontext():
                time.sleep(0.5)
                loads[state].append(load_average())
                for label in KERNELS:
                    speeds[(state, label)].append(decode_tokens_per_second(label))
    return {"model": name, "device": str(run.device), "threads": torch.get_num_threads(),
            "omp_wait_policy": omp_wait_policy(),
            "gomp_spincount": omp_spin_count(), "prompt_tokens": 32,
            "new_tokens": new_tokens, "rounds": rounds, "busy_processes": 1,
            "load_average": {state: statistics.median(v) for state, v in loads.items() if None not in v},
            "same_greedy_tokens": tokens["reference"] == tokens["default (sdpa)"], "rows": rows(speeds)}


def rows(speeds: dict) -> list[dict]:
    """{(state, kernel): [tok/s per round]} -> one row per cell: median, min, max, the ratio to the
    reference in the same state, and busy over idle for the same kernel (both of medians)."""
    out = [dict(zip(("state", "kernel", "tok_per_s", "tok_per_s_min", "tok_per_s_max"), (*cell, *spread(values))))
           for cell, values in speeds.items()]
    by = {(r["state"], r["kernel"]): r["tok_per_s"] for r in out}
    for r in out:
        r["vs_reference"] = r["tok_per_s"] / by[(r["state"], "reference")]
        r["busy_over_idle"] = by[("busy", r["kernel"])] / by[("idle", r["kernel"])]
    return out


def print_result(result: dict) -> None:
    r = result
    print_table(r["rows"], [
        ("state", "state", None), ("kernel", "attention", None), ("tok_per_s", "tok/s", "{:.1f}"),
        ("tok_per_s_min", "min", "{:.1f}"), ("tok_per_s_max", "max", "{:.1f}"),
        ("vs_reference", "vs reference", "{:.2f}x"), ("busy_over_idle", "busy / idle", "{:.2f}")],
        title=f"\nplain fp32 generate, {r['model']} on {r['device']}, {r['threads']} threads, "
              f"OMP_WAIT_POLICY={r['omp_wait_policy']} (GOMP_SPINCOUNT={r['gomp_spincount']}); decode tok/s, median "
              f"of {r['rounds']} rounds of {r['new_tokens']} tokens (min-max); busy: {r['busy_processes']} busy loop; "
              f"load average {', '.join(f'{k} {v:.1f}' for k, v in r['load_average'].items())}; "
              f"same greedy tokens: {r['same_greedy_tokens']}")


def plot(result: dict):
    import matplotlib.pyplot as plt

    rows = {(r["state"], r["kernel"]): r for r in result["rows"]}
    labels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
    groups = {"idle": "no busy loop", "busy": f"{result['busy_processes']} busy loop"}   # the machine as found, or +1
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bars = grouped_bars(ax, list(groups.values()), {k: [rows[(s, k)]["tok_per_s"] for s in groups] for k in labels})
    for container, label in zip(bars, labels):
        ax.bar_label(container, [f"{rows[(s, label)]['tok_per_s']:.1f}" for s in groups], fontsize=8)
    ax.set(ylabel="decode tokens/s (higher is better)",
           title=f"plain fp32 generate, {result['model']}, {result['threads']} threads")
    ax.legend(title="attention", fontsize=8)
    fig.tight_layout()
    return fig


BENCHMARK = bench_plain_under_load = Benchmark("plain_under_load", measure, print_result, parallel=True,
                                               plots={"plain_under_load": plot})
