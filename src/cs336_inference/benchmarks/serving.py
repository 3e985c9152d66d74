"""`bench serving`: continuous vs static batching, and paged vs contiguous KV memory, on one trace.

The trace (`serving.make_trace`): Poisson arrivals (30 per second), user prompts of 64 to 256 tokens
cut from the validation text, half of them behind a shared 64-token system prompt, answers that end
with their line (or after max_new_tokens = 192), one request in ten asking for 4 samples. Every run
serves the whole trace with the real model (the shipped target: 2M parameters, context 512).

1. Scheduling: the same engine, KV pool and batch limit, static (request-level: a batch runs until
   its longest answer is done) vs continuous (iteration-level) batching, alternated `repeats` times:
   throughput, TTFT / ITL / queueing percentiles (medians over repeats, min..max in the table).
2. Memory: continuous batching in a tight KV budget (2048 token slots), paged (blocks of 16 and 8)
   vs contiguous (prompt + max_new_tokens reserved per sequence): waste of the reserved bytes, most
   sequences at once, throughput.
3. Sharing: the same trace with every prompt behind a long system prompt, prefix caching on vs off;
   and every request asking for 4 samples: KV slots saved by sharing blocks.
"""

from __future__ import annotations

import os
import statistics

import torch

from ..data.corpus import load_corpus
from ..device import get_device, seed_everything
from ..figures import save_figure, save_json
from ..model.checkpoints import load_pretrained
from ..serving import Engine, TraceConfig, make_trace
from ..serving.plots import plot_batch_size, plot_memory, plot_timeline
from ..timing import num_threads

NEWLINE = 10  # byte tokenizer: an answer ends with its line


def _trace(quick: bool, **overrides):
    text = load_corpus("val")
    system = overrides.pop("system", text[:64].tolist())  # a fixed preamble shared by many prompts
    config = TraceConfig(num_requests=16 if quick else 64, rate=30.0, prompt_len=(64, 256),
                         max_new_tokens=64 if quick else 192, stop_tokens=(NEWLINE,),
                         system_prompt_fraction=0.5, sampled_fraction=0.1, n_samples=4, seed=0)
    config = TraceConfig(**{**config.__dict__, **overrides})
    return make_trace(text[1000:], config, system_prompt=system), config


def _load(name: str, device) -> torch.nn.Module:
    return load_pretrained(name, device=device).eval()


def compare_schedulers(model, requests, repeats: int, max_num_seqs: int = 16) -> tuple[dict, dict]:
    """Static and continuous batching alternated `repeats` times on the same trace."""
    runs = {"static": [], "continuous": []}
    for _ in range(repeats):
        for policy in runs:
            runs[policy].append(Engine(model, scheduler=policy, max_num_seqs=max_num_seqs).run(requests))
    greedy = [i for i, r in enumerate(requests) if r.sampling.temperature == 0]
    a, b = runs["static"][0].outputs, runs["continuous"][0].outputs
    assert all(a[i].tokens == b[i].tokens for i in greedy), "static and continuous greedy outputs differ"
    rows = {}
    for policy, results in runs.items():
        summaries = [r.summary() for r in results]
        for key in ("throughput_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                    "queueing_mean_s", "queueing_p99_s", "makespan_s"):
            values = [s[key] for s in summaries]
            rows[f"{policy}_{key}"] = statistics.median(values)
            rows[f"{policy}_{key}_range"] = [min(values), max(values)]
        rows[f"{policy}_generated_tokens"] = summaries[0]["generated_tokens"]
    ratios = [c.summary()["throughput_tok_per_s"] / s.summary()["throughput_tok_per_s"]
              for s, c in zip(runs["static"], runs["continuous"])]  # pairs measured side by side
    rows["continuous_over_static_throughput"] = statistics.median(ratios)
    rows["continuous_over_static_throughput_range"] = [min(ratios), max(ratios)]
    return rows, {policy: results[0] for policy, results in runs.items()}


def compare_layouts(model, requests, budget_tokens: int) -> tuple[dict, dict]:
    """Continuous batching in one KV budget: paged (block 16, block 8) vs contiguous reservation."""
    layouts = {"paged_b16": dict(kv_layout="paged", block_size=16),
               "paged_b8": dict(kv_layout="paged", block_size=8),
               "contiguous": dict(kv_layout="contiguous", block_size=16)}
    rows, results = {"kv_budget_tokens": budget_tokens}, {}
    for name, layout in layouts.items():
        result = Engine(model, max_num_seqs=64, num_blocks=budget_tokens // layout["block_size"],
                        watermark_blocks=0, **layout).run(requests)
        s = result.summary()
        rows[f"{name}_kv_waste_pct"] = 100 * s["kv_waste_fraction"]
        rows[f"{name}_kv_reserved_pct_of_pool"] = 100 * s["kv_reserved_fraction_of_pool"]
        rows[f"{name}_max_running"] = s["max_running"]
        rows[f"{name}_throughput_tok_per_s"] = s["throughput_tok_per_s"]
        rows[f"{name}_ttft_p99_s"] = s["ttft_p99_s"]
        rows[f"{name}_preemptions"] = s["preemptions"]
        results[name] = result
    return rows, results


def sharing_savings(model, quick: bool) -> dict:
    """KV slots saved by a shared system prompt (prefix caching on vs off) and by forked samples."""
    text = load_corpus("val")
    rows = {}
    system = text[5000:5128].tolist()  # a 128-token system prompt in front of every request
    requests, _ = _trace(quick, system_prompt_fraction=1.0, sampled_fraction=0.0, system=system,
                         prompt_len=(32, 128))  # 128 + 128 + 192 new tokens fit the context of 512
    for caching in (True, False):
        s = Engine(model, prefix_caching=caching).run(requests).summary()
        tag = "on" if caching else "off"
        rows[f"system_prompt_prefix_cache_{tag}_kv_shared_pct"] = 100 * s["kv_shared_fraction"]
        rows[f"system_prompt_prefix_cache_{tag}_cached_prompt_tokens"] = s["cached_prompt_tokens"]
    requests, _ = _trace(quick, sampled_fraction=1.0, system_prompt_fraction=0.0)
    s = Engine(model).run(requests).summary()
    rows["n4_samples_kv_shared_pct"] = 100 * s["kv_shared_fraction"]
    return rows


def bench_serving(quick: bool = False, device: str | None = None, model_name: str = "target") -> dict:
    device = get_device(device)
    seed_everything(0)
    load_before = os.getloadavg()
    model = _load(model_name, device)
    requests, config = _trace(quick)
    rows = {"device": str(device), "model": model_name, "threads": 1, "load_avg_before": list(load_before),
            "trace": {**config.__dict__, "prompt_len": list(config.prompt_len),
                      "stop_tokens": list(config.stop_tokens)}}
    with num_threads(1):  # spinning OpenMP threads stall on a shared CPU; one thread is steady
        sched_rows, sched_runs = compare_schedulers(model, requests, repeats=1 if quick else 3)
        budget = 2048  # tight: memory, not the batch limit, decides who runs
        layout_rows, layout_runs = compare_layouts(model, requests, budget)
        share_rows = sharing_savings(model, quick)
    rows.update(sched_rows)
    rows.update(layout_rows)
    rows.update(share_rows)
    rows["load_avg_after"] = list(os.getloadavg())
    rows["goal_continuous_2x_static"] = rows["continuous_over_static_throughput"] >= 2
    rows["goal_lower_p99_ttft"] = rows["continuous_ttft_p99_s"] < rows["static_ttft_p99_s"]
    rows["goal_paged_waste_below_4pct"] = rows["paged_b16_kv_waste_pct"] < 4

    _print_table(rows)
    name = "serving_quick" if quick else "serving"
    save_json(rows, name)
    _plot(sched_runs, layout_runs, rows, name)
    return rows


def _print_table(rows: dict) -> None:
    """One line per quantity; a median measured over repeats shows its range as (min..max)."""
    keys = [k for k in rows if k != "trace" and not k.endswith("_range")]
    width = max(map(len, keys))
    print(f"\n{'quantity':<{width}}  value")
    for key in keys:
        value = rows[key]
        if isinstance(value, float):
            shown = f"{value:,.3f}"
            if f"{key}_range" in rows:
                lo, hi = rows[f"{key}_range"]
                shown += f"  ({lo:,.3f}..{hi:,.3f})"
        elif isinstance(value, list):
            shown = ", ".join(f"{v:.2f}" for v in value)
        else:
            shown = str(value)
        print(f"{key:<{width}}  {shown}")


def _plot(sched_runs: dict, layout_runs: dict, rows: dict, name: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, policy in zip(axes[:2], ("static", "continuous")):
        s = sched_runs[policy].summary()
        plot_timeline(ax, sched_runs[policy], f"{policy} batching: {s['throughput_tok_per_s']:.0f} tok/s, "
                                              f"p99 TTFT {s['ttft_p99_s']:.2f} s")
    end = max(r.steps[-1].end for r in sched_runs.values())
    for ax in axes[:2]:
        ax.set_xlim(0, end)
    for policy, result in sched_runs.items():
        plot_batch_size(axes[2], result, policy)
    axes[2].set_title("sequences producing a token in each step")
    axes[2].legend()
    fig.suptitle(f"{rows['model']}: one Poisson trace, static vs continuous batching "
                 f"({rows['continuous_over_static_throughput']:.1f}x throughput)")
    fig.tight_layout()
    save_figure(fig, name)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for (label, result), color in zip(layout_runs.items(), ("C0", "C2", "C3")):
        plot_memory(ax1, result, label, color)
        plot_batch_size(ax2, result, label)
    ax1.set_title(f"KV memory over time ({rows['kv_budget_tokens']} token slots)")
    ax1.legend(fontsize=7)
    ax2.set_title("running sequences in the same budget")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, f"{name}_memory")
    plt.close(fig)


__all__ = ["bench_serving", "compare_layouts", "compare_schedulers", "sharing_savings"]
