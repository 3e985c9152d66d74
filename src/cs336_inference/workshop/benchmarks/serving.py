"""`bench serving`: continuous vs static batching, and paged vs contiguous KV memory, on one trace.

One Poisson trace (`serving.make_trace`, the shipped target, prompts cut from the validation text,
half behind a shared system prompt, some requests asking for several samples) served: 1. static
(request-level) vs continuous (iteration-level) batching, alternated; 2. paged (blocks of 16 and 8) vs
contiguous KV reservation in a tight budget; 3. prefix caching and forked samples (the share of tokens
stored once); 4. the same on SmolLM2-135M-Instruct chat requests (full runs, where installed); 5.
chunked prefill (Sarathi-Serve, Agrawal et al. 2024): long prompts whole vs in chunks, so the decodes
sharing a step stop waiting for a whole prefill. One CPU thread throughout.
"""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
import torch

from ...data.corpus import load_corpus
from ...data.real_text import pydoc_documents, token_stream
from ...model.checkpoints import load_pretrained
from ...model.tokenizer import load_tokenizer
from ...serving import Engine, TraceConfig, make_chat_trace, make_trace
from ...serving.plots import plot_batch_size, plot_memory, plot_timeline
from ...serving.workload import INSTRUCTION
from ...tables import print_table
from ...device import load_avg
from .base import Benchmark, alternate, grouped_bars

NEWLINE = 10  # byte tokenizer: an answer ends with its line
REAL_MODEL = "smollm2-135m"
REAL_SYSTEM_PROMPT = ("You are a concise assistant for a course on language-model inference. Answer in one short "
                      "sentence of plain English, without lists, code or follow-up questions. When the text is "
                      "about Python, say what the feature does and when a programmer would use it.")
METRICS = [("throughput_tok_per_s", "throughput (tok/s)", "{:,.0f}"), ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
           ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"), ("itl_p50_s", "ITL p50 (s)", "{:.4f}"),
           ("itl_p99_s", "ITL p99 (s)", "{:.4f}"), ("queueing_mean_s", "queueing mean (s)", "{:.3f}"),
           ("queueing_p99_s", "queueing p99 (s)", "{:.3f}"), ("makespan_s", "makespan (s)", "{:.2f}")]
LAYOUTS = {"paged, block 16": dict(kv_layout="paged", block_size=16),
           "paged, block 8": dict(kv_layout="paged", block_size=8),
           "contiguous": dict(kv_layout="contiguous", block_size=16)}
WHOLE, CHUNK_BUDGETS = "whole prompts", (64, 128, 256)
CHUNKING_KEYS = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "throughput_tok_per_s")


def serving_trace(quick: bool = False, system=None, **overrides):
    """The benchmark's trace (and its config): prompts from the validation text, byte tokens."""
    text = load_corpus("val")
    system = text[:64].tolist() if system is None else system  # a fixed preamble shared by many prompts
    config = TraceConfig(**{**dict(num_requests=16 if quick else 64, rate=60.0, prompt_len=(64, 256),
                                   max_new_tokens=64 if quick else 192, stop_tokens=(NEWLINE,),
                                   system_prompt_fraction=0.5, sampled_fraction=0.1, n_samples=4, seed=0), **overrides})
    return make_trace(text[1000:], config, system_prompt=system), config


def describe_trace(config: TraceConfig, **extra) -> dict:
    return {**config.__dict__, "prompt_len": list(config.prompt_len), "stop_tokens": list(config.stop_tokens), **extra}


def _median_range(values: list[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def compare_schedulers(model, requests, repeats: int, max_num_seqs: int = 16,
                       num_blocks: int | None = None) -> tuple[dict, dict]:
    """Static and continuous batching alternated `repeats` times on the same trace: per policy the
    median of each metric with its [min, max], and the throughput ratio of side-by-side pairs."""
    runs = alternate({policy: lambda policy=policy: Engine(model, scheduler=policy, max_num_seqs=max_num_seqs,
                                                           num_blocks=num_blocks).run(requests)
                      for policy in ("static", "continuous")}, repeats)
    greedy = [i for i, r in enumerate(requests) if r.sampling.temperature == 0]
    a, b = runs["static"][0].outputs, runs["continuous"][0].outputs
    assert all(a[i].tokens == b[i].tokens for i in greedy), "static and continuous greedy outputs differ"
    out = {"max_num_seqs": max_num_seqs, "repeats": repeats}
    for policy, results in runs.items():
        summaries = [r.summary() for r in results]
        out[policy] = {"generated_tokens": summaries[0]["generated_tokens"], "steps": summaries[0]["steps"]}
        for key, _, _ in METRICS:
            out[policy][key], out[policy][f"{key}_range"] = _median_range([s[key] for s in summaries])
    out["throughput_ratio"], out["throughput_ratio_range"] = _median_range(
        [c.summary()["throughput_tok_per_s"] / s.summary()["throughput_tok_per_s"]
         for s, c in zip(runs["static"], runs["continuous"])])
    return out, {policy: results[0] for policy, results in runs.items()}


def compare_layouts(model, requests, budget_tokens: int, layouts: dict = LAYOUTS) -> tuple[dict, dict]:
    """Continuous batching in one KV budget: paged (block 16, block 8) vs contiguous reservation."""
    results = {name: Engine(model, max_num_seqs=64, num_blocks=budget_tokens // layout["block_size"],
                            watermark_blocks=0, **layout).run(requests) for name, layout in layouts.items()}
    out = {}
    for name, result in results.items():
        s = result.summary()
        out[name] = {"waste_pct": 100 * s["kv_waste_fraction"], "reserved_pct_of_pool":
                     100 * s["kv_reserved_fraction_of_pool"], **{k: s[k] for k in (
                         "max_running", "throughput_tok_per_s", "ttft_p99_s", "preemptions")}}
    return {"budget_tokens": budget_tokens, "layouts": out}, results


def sharing_savings(model, quick: bool) -> dict:
    """Share of the sequences' tokens stored once for several sequences: a 128-token system prompt in
    front of every request (prefix caching on vs off), and 4 forked samples per request."""
    system = load_corpus("val")[5000:5128].tolist()
    shared, _ = serving_trace(quick, system=system, system_prompt_fraction=1.0, sampled_fraction=0.0,
                              prompt_len=(32, 128))  # 128 + 128 + 192 new tokens fit the context of 512
    forked, _ = serving_trace(quick, sampled_fraction=1.0, system_prompt_fraction=0.0)
    cases = {"system prompt, prefix cache on": (shared, True), "system prompt, prefix cache off": (shared, False),
             "4 samples per request (fork)": (forked, True)}
    out = {}
    for name, (requests, caching) in cases.items():
        s = Engine(model, prefix_caching=caching).run(requests).summary()
        out[name] = {"shared_pct": 100 * s["kv_shared_fraction"], "cached_prompt_tokens": s["cached_prompt_tokens"]}
    return out


def compare_chunking(model, quick: bool = False) -> dict:
    """p50/p99 ITL and TTFT, throughput and the longest step, whole vs chunked (median of the
    alternated repeats), the p99 ITL ratio of each side-by-side pair, and one run's step durations."""
    config = TraceConfig(num_requests=8 if quick else 24, rate=8.0 if quick else 30.0, prompt_len=(256, 384),
                         max_new_tokens=64, system_prompt_fraction=0.0, sampled_fraction=0.0, seed=1)
    requests = make_trace(load_corpus("val")[1000:], config)
    budgets, repeats = ((128,), 1) if quick else (CHUNK_BUDGETS, 3)
    configs = {WHOLE: dict(max_num_batched_tokens=2048)}
    configs |= {f"chunks of {b}": dict(chunked_prefill=True, max_num_batched_tokens=b) for b in budgets}
    runs = alternate({name: lambda o=o: Engine(model, max_num_seqs=16, **o).run(requests)
                      for name, o in configs.items()}, repeats)
    chunked = f"chunks of {budgets[min(1, len(budgets) - 1)]}"
    assert all(a.tokens == b.tokens for a, b in zip(runs[WHOLE][0].outputs, runs[chunked][0].outputs)), \
        "chunked prefill changed a greedy output"
    out = {"trace": describe_trace(config), "repeats": repeats, "max_num_seqs": 16, "compared": chunked,
           "configs": {name: {**{key: statistics.median(r.summary()[key] for r in results) for key in CHUNKING_KEYS},
                              "steps": results[0].summary()["steps"],
                              "longest_step_tokens": max(s.num_tokens for s in results[0].steps)}
                       for name, results in runs.items()}}
    out["itl_p99_ratio"], out["itl_p99_ratio_range"] = _median_range(
        [w.summary()["itl_p99_s"] / c.summary()["itl_p99_s"] for w, c in zip(runs[WHOLE], runs[chunked])])
    out["timeline"] = {name: {"end_s": [r.end for r in runs[name][0].steps],
                              "duration_ms": [1e3 * (r.end - r.start) for r in runs[name][0].steps]}
                       for name in (WHOLE, chunked)}
    return out


def real_model_results(device) -> tuple[dict, tuple | None]:
    """Static vs continuous batching (2 alternated pairs) and paged vs contiguous memory (1536 token
    slots: 4 samples of the longest request must fit side by side contiguously) on SmolLM2-135M;
    {"skipped": why} when its package is not installed."""
    try:
        model = load_pretrained(REAL_MODEL, device=device).eval().set_attention_kernel("sdpa")
        tokenizer = load_tokenizer(REAL_MODEL)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"\n{REAL_MODEL} skipped: {e}")
        return {"skipped": str(e)}, None
    config = TraceConfig(num_requests=24, rate=8.0, prompt_len=(16, 64), max_new_tokens=128,
                         system_prompt_fraction=0.5, sampled_fraction=0.125, n_samples=4, seed=0)
    requests = make_chat_trace(tokenizer, token_stream(tokenizer, pydoc_documents("eval")), config,
                               REAL_SYSTEM_PROMPT, instruction=INSTRUCTION)
    scheduling, sched_runs = compare_schedulers(model, requests, repeats=2, num_blocks=512)  # 8192 slots
    memory, layout_runs = compare_layouts(model, requests, 1536, {k: LAYOUTS[k] for k in ("paged, block 16",
                                                                                          "contiguous")})
    prompts = [len(r.prompt) for r in requests]
    return {"trace": describe_trace(config, stop_tokens=list(tokenizer.stop_ids),
                                    prompt_tokens=[min(prompts), max(prompts)]),
            "kv_bytes_per_token": sched_runs["continuous"].bytes_per_token, "scheduling": scheduling,
            "memory": memory}, (sched_runs, layout_runs)


def measure(run, model_name: str = "target") -> dict:
    quick, device, load_before = run.quick, run.device, load_avg()
    model = load_pretrained(model_name, device=device).eval()
    requests, config = serving_trace(quick)
    scheduling, sched_runs = compare_schedulers(model, requests, repeats=1 if quick else 3)
    memory, layout_runs = compare_layouts(model, requests, budget_tokens=2048)
    chunking = compare_chunking(model, quick)
    real, real_runs = ({"skipped": "full runs only"}, None) if quick else real_model_results(device)
    results = {"device": str(device), "model": model_name, "threads": torch.get_num_threads(),
               "load_avg_before": load_before, "load_avg_after": load_avg(), "trace": describe_trace(config),
               "scheduling": scheduling, "memory": memory, "sharing": sharing_savings(model, quick),
               "chunked_prefill": chunking, REAL_MODEL: real}
    waste = {b: memory["layouts"][f"paged, block {b}"]["waste_pct"] for b in (16, 8)}
    results["goals"] = {"continuous >= 2x static throughput": scheduling["throughput_ratio"] >= 2,
                        "continuous has the lower p99 TTFT":
                            scheduling["continuous"]["ttft_p99_s"] < scheduling["static"]["ttft_p99_s"],
                        "paged waste < 4% (block 16)": waste[16] < 4, "paged waste < 4% (block 8)": waste[8] < 4,
                        "chunked prefill lowers p99 ITL": chunking["itl_p99_ratio"] > 1}
    # drawn from the runs' step records, which the JSON does not keep: `figures` cannot redraw these
    _plot_runs(run, "serving", results["model"], sched_runs, layout_runs, scheduling, memory)
    if real_runs is not None:
        _plot_runs(run, "serving_smollm2", REAL_MODEL, *real_runs, real["scheduling"], real["memory"])
    return results


def print_results(results: dict) -> None:
    """The tables of a `bench serving` result."""
    load = f"load average {results['load_avg_before'][0]:.1f} -> {results['load_avg_after'][0]:.1f}"
    _print_part(results, f"\n{results['model']} on {results['device']}, {results['trace']['num_requests']} "
                         "requests", load)
    print_table([{"case": k, **v} for k, v in results["sharing"].items()],
                [("case", "sharing", None), ("shared_pct", "% of tokens stored once for several", "{:.1f}"),
                 ("cached_prompt_tokens", "prompt tokens from the prefix cache", None)], title="\nKV sharing")
    c, (lo, hi) = results["chunked_prefill"], results["chunked_prefill"]["itl_p99_ratio_range"]
    print_table([{"config": name, **row} for name, row in c["configs"].items()],
                [("config", "prefill", None), ("itl_p50_s", "ITL p50 (s)", "{:.4f}"),
                 ("itl_p99_s", "ITL p99 (s)", "{:.4f}"), ("ttft_p50_s", "TTFT p50 (s)", "{:.2f}"),
                 ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"), ("throughput_tok_per_s", "tok/s", "{:,.0f}"),
                 ("longest_step_tokens", "longest step (tokens)", None)],
                title=f"\nchunked prefill, prompts of {c['trace']['prompt_len'][0]}-{c['trace']['prompt_len'][1]} "
                      f"tokens: p99 ITL {c['itl_p99_ratio']:.1f}x lower with {c['compared']} "
                      f"({lo:.1f}..{hi:.1f}x), median of {c['repeats']} alternated runs")
    if "skipped" not in (real := results[REAL_MODEL]):
        _print_part(real, f"\n{REAL_MODEL}, {real['trace']['num_requests']} chat requests", load)
    print("\ngoals: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in results["goals"].items()))


def _print_part(part: dict, title: str, load: str) -> None:
    """One model's scheduling and memory tables."""
    s, m = part["scheduling"], part["memory"]

    def cell(policy, key, fmt):
        lo, hi = s[policy][f"{key}_range"]
        return f"{fmt.format(s[policy][key])} ({fmt.format(lo)}..{fmt.format(hi)})"

    lo, hi = s["throughput_ratio_range"]
    print_table([{"metric": header, **{p: cell(p, key, fmt) for p in ("static", "continuous")}}
                 for key, header, fmt in METRICS],
                [("metric", "metric", None), ("static", "static batching", None),
                 ("continuous", "continuous batching", None)],
                title=f"{title}, batch limit {s['max_num_seqs']}, median (min..max) of {s['repeats']} alternated "
                      f"runs; continuous / static throughput {s['throughput_ratio']:.2f}x ({lo:.2f}..{hi:.2f}); "
                      f"{load}")
    print_table([{"layout": k, **v} for k, v in m["layouts"].items()],
                [("layout", "KV layout", None), ("waste_pct", "waste % of reserved", "{:.1f}"),
                 ("reserved_pct_of_pool", "reserved % of pool", "{:.0f}"), ("max_running", "most running", None),
                 ("throughput_tok_per_s", "tok/s", "{:,.0f}"), ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"),
                 ("preemptions", "preemptions", None)],
                title=f"\ncontinuous batching in {m['budget_tokens']} KV token slots")


def _plot_runs(run, name: str, model: str, sched_runs: dict, layout_runs: dict, scheduling: dict,
               memory: dict) -> None:
    """Each policy's request timeline on one time axis, and (the shipped target) the batch sizes per
    step and the KV memory over time of every layout, or (the real model) just the KV memory."""
    real = name != "serving"
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, policy in zip(axes[:2], ("static", "continuous")):
        s = sched_runs[policy].summary()
        plot_timeline(ax, sched_runs[policy], f"{policy} batching: {s['throughput_tok_per_s']:.{int(real)}f} tok/s, "
                                              f"p99 TTFT {s['ttft_p99_s']:.{2 - int(real)}f} s")
        ax.set_xlim(0, max(r.steps[-1].end for r in sched_runs.values()))
    colors = ("C0", "C3") if real else ("C0", "C2", "C3")
    if real:
        for (label, result), color in zip(layout_runs.items(), colors):
            plot_memory(axes[2], result, label, color)
        axes[2].set_title(f"KV memory, continuous batching ({memory['budget_tokens']} token slots)")
        axes[2].legend(fontsize=7)
    else:
        for policy, result in sched_runs.items():
            plot_batch_size(axes[2], result, policy)
        axes[2].set_title("sequences producing a token in each step")
        axes[2].legend()
    fig.suptitle(f"{model}: {'chat requests' if real else 'one Poisson trace'}, static vs continuous batching "
                 f"({scheduling['throughput_ratio']:.1f}x throughput, median of {scheduling['repeats']})")
    fig.tight_layout()
    run.save_figure(fig, name)
    plt.close(fig)
    if real:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for (label, result), color in zip(layout_runs.items(), colors):
        plot_memory(ax1, result, label, color)
        plot_batch_size(ax2, result, label, color=color)
    ax1.set_title(f"KV memory over time ({memory['budget_tokens']} token slots)")
    ax1.legend(fontsize=7)
    ax2.set_title("running sequences in the same budget")
    ax2.legend()
    fig.tight_layout()
    run.save_figure(fig, "serving_memory")
    plt.close(fig)


def plot_chunking(result: dict):
    """Step durations over time (whole vs chunked) and p50/p99 ITL per configuration."""
    c = result.get("chunked_prefill")
    if not c:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for (name, series), color in zip(c["timeline"].items(), ("C3", "C0")):
        ax1.plot(series["end_s"], series["duration_ms"], ".-", ms=3, lw=0.8, color=color, label=name)
    ax1.set(xlabel="time (s)", ylabel="step duration (ms)", title="every step: a whole prompt stalls the decodes "
                                                                   "beside it")
    ax1.legend()
    grouped_bars(ax2, list(c["configs"]), {label: [1e3 * v[key] for v in c["configs"].values()]
                                           for key, label in (("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99"))})
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set(ylabel="inter-token latency (ms)",
            title=f"p99 ITL {c['itl_p99_ratio']:.1f}x lower with {c['compared']} (median of {c['repeats']})")
    ax2.legend()
    fig.suptitle(f"{result['model']}: {c['trace']['num_requests']} requests with prompts of "
                 f"{c['trace']['prompt_len'][0]}-{c['trace']['prompt_len'][1]} tokens, chunked prefill")
    fig.tight_layout()
    return fig


BENCHMARK = bench_serving = Benchmark("serving", measure, print_results,
                                      plots={"{name}_chunked_prefill": plot_chunking})

__all__ = ["bench_serving", "compare_chunking", "compare_layouts", "compare_schedulers", "print_results",
           "real_model_results", "serving_trace", "sharing_savings"]
