"""`bench serving`: continuous vs static batching, and paged vs contiguous KV memory, on one trace.

The trace (`serving.make_trace`): 64 requests with Poisson arrivals at 60 per second (faster than
either scheduler serves them on this CPU, so throughput measures capacity, not the arrival rate),
user prompts of 64 to 256 tokens cut from the validation text, half of them behind a shared 64-token
system prompt, answers that end with their line (or after max_new_tokens = 192), one request in ten
asking for 4 samples. Every run serves the whole trace with a real model (the shipped target: 2M
parameters, context 512).

1. Scheduling: the same engine, KV pool and batch limit (16 sequences), static (request-level: a
   batch runs until its longest answer is done) vs continuous (iteration-level) batching, alternated
   `repeats` times: throughput, TTFT / ITL / queueing percentiles (median over repeats, min..max).
2. Memory: continuous batching in a tight KV budget (2048 token slots), paged (blocks of 16 and 8)
   vs contiguous (prompt + max_new_tokens reserved per sequence): waste of the reserved bytes, most
   sequences at once, throughput.
3. Sharing: the trace with every prompt behind a 128-token system prompt, prefix caching on vs off;
   and with every request asking for 4 samples: the share of the sequences' tokens that need no KV
   slot of their own.
4. The real model (full runs only, when its package is installed): SmolLM2-135M-Instruct serving
   24 chat requests at 8 per second (explain a 16-64-token slice of CPython's documentation in a
   short paragraph; half behind a shared system prompt, the others behind the template's default
   one; answers end at <|im_end|> or after 128 tokens): static vs continuous batching, and paged vs
   contiguous memory in a tight budget (1536 token slots).
5. Chunked prefill on a trace with long prompts (`serving_chunked`): p99 ITL whole vs chunked.
One CPU thread throughout (a shared machine stalls spinning OpenMP threads); the load average
before and after is recorded.
"""

from __future__ import annotations

import os
import statistics

import torch

from ..data.corpus import load_corpus
from ..data.real_text import pydoc_documents, token_stream
from ..model.checkpoints import load_pretrained
from ..model.tokenizer import load_tokenizer
from ..serving import Engine, TraceConfig, make_chat_trace, make_trace
from ..serving.plots import plot_batch_size, plot_memory, plot_timeline
from ..tables import print_table
from .base import Benchmark
from .serving_chunked import CHUNKING_COLUMNS, chunking_rows, compare_chunking, plot_chunking

NEWLINE = 10  # byte tokenizer: an answer ends with its line
METRICS = [("throughput_tok_per_s", "throughput (tok/s)", "{:,.0f}"), ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
           ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"), ("itl_p50_s", "ITL p50 (s)", "{:.4f}"),
           ("itl_p99_s", "ITL p99 (s)", "{:.4f}"), ("queueing_mean_s", "queueing mean (s)", "{:.3f}"),
           ("queueing_p99_s", "queueing p99 (s)", "{:.3f}"), ("makespan_s", "makespan (s)", "{:.2f}")]


def serving_trace(quick: bool = False, system=None, **overrides):
    """The benchmark's trace (and its config): prompts from the validation text, byte tokens."""
    text = load_corpus("val")
    system = text[:64].tolist() if system is None else system  # a fixed preamble shared by many prompts
    config = TraceConfig(num_requests=16 if quick else 64, rate=60.0, prompt_len=(64, 256),
                         max_new_tokens=64 if quick else 192, stop_tokens=(NEWLINE,),
                         system_prompt_fraction=0.5, sampled_fraction=0.1, n_samples=4, seed=0)
    config = TraceConfig(**{**config.__dict__, **overrides})
    return make_trace(text[1000:], config, system_prompt=system), config


REAL_MODEL = "smollm2-135m"
REAL_SYSTEM_PROMPT = ("You are a concise assistant for a course on language-model inference. Answer in one short "
                      "sentence of plain English, without lists, code or follow-up questions. When the text is "
                      "about Python, say what the feature does and when a programmer would use it.")


def real_model_trace(tokenizer, quick: bool = False):
    """Chat requests for the real model (see the module docstring), and their config."""
    config = TraceConfig(num_requests=8 if quick else 24, rate=8.0, prompt_len=(16, 64), max_new_tokens=128,
                         system_prompt_fraction=0.5, sampled_fraction=0.125, n_samples=4, seed=0)
    source = token_stream(tokenizer, pydoc_documents("eval"))
    return make_chat_trace(tokenizer, source, config, REAL_SYSTEM_PROMPT,
                           instruction="Explain what this text is about in a short paragraph."), config


def compare_schedulers(model, requests, repeats: int, max_num_seqs: int = 16,
                       num_blocks: int | None = None) -> tuple[dict, dict]:
    """Static and continuous batching alternated `repeats` times on the same trace: per policy the
    median of each metric with its (min, max), and the throughput ratio of side-by-side pairs."""
    runs = {"static": [], "continuous": []}
    for _ in range(repeats):
        for policy in runs:
            engine = Engine(model, scheduler=policy, max_num_seqs=max_num_seqs, num_blocks=num_blocks)
            runs[policy].append(engine.run(requests))
    greedy = [i for i, r in enumerate(requests) if r.sampling.temperature == 0]
    a, b = runs["static"][0].outputs, runs["continuous"][0].outputs
    assert all(a[i].tokens == b[i].tokens for i in greedy), "static and continuous greedy outputs differ"
    out = {"max_num_seqs": max_num_seqs, "repeats": repeats}
    for policy, results in runs.items():
        summaries = [r.summary() for r in results]
        out[policy] = {"generated_tokens": summaries[0]["generated_tokens"], "steps": summaries[0]["steps"]}
        for key, _, _ in METRICS:
            values = [s[key] for s in summaries]
            out[policy][key] = statistics.median(values)
            out[policy][f"{key}_range"] = [min(values), max(values)]
    ratios = [c.summary()["throughput_tok_per_s"] / s.summary()["throughput_tok_per_s"]
              for s, c in zip(runs["static"], runs["continuous"])]
    out["throughput_ratio"] = statistics.median(ratios)
    out["throughput_ratio_range"] = [min(ratios), max(ratios)]
    return out, {policy: results[0] for policy, results in runs.items()}


LAYOUTS = {"paged, block 16": dict(kv_layout="paged", block_size=16),
           "paged, block 8": dict(kv_layout="paged", block_size=8),
           "contiguous": dict(kv_layout="contiguous", block_size=16)}


def compare_layouts(model, requests, budget_tokens: int, layouts: dict = LAYOUTS) -> tuple[dict, dict]:
    """Continuous batching in one KV budget: paged (block 16, block 8) vs contiguous reservation."""
    out, results = {"budget_tokens": budget_tokens, "layouts": {}}, {}
    for name, layout in layouts.items():
        result = Engine(model, max_num_seqs=64, num_blocks=budget_tokens // layout["block_size"],
                        watermark_blocks=0, **layout).run(requests)
        s = result.summary()
        out["layouts"][name] = {"waste_pct": 100 * s["kv_waste_fraction"],
                                "reserved_pct_of_pool": 100 * s["kv_reserved_fraction_of_pool"],
                                "max_running": s["max_running"], "throughput_tok_per_s": s["throughput_tok_per_s"],
                                "ttft_p99_s": s["ttft_p99_s"], "preemptions": s["preemptions"]}
        results[name] = result
    return out, results


def sharing_savings(model, quick: bool) -> dict:
    """Share of the sequences' tokens stored once for several sequences: a 128-token system prompt in
    front of every request (prefix caching on vs off), and 4 forked samples per request."""
    system = load_corpus("val")[5000:5128].tolist()
    requests, _ = serving_trace(quick, system=system, system_prompt_fraction=1.0, sampled_fraction=0.0,
                                prompt_len=(32, 128))  # 128 + 128 + 192 new tokens fit the context of 512
    out = {}
    for caching in (True, False):
        s = Engine(model, prefix_caching=caching).run(requests).summary()
        out[f"system prompt, prefix cache {'on' if caching else 'off'}"] = {
            "shared_pct": 100 * s["kv_shared_fraction"], "cached_prompt_tokens": s["cached_prompt_tokens"]}
    requests, _ = serving_trace(quick, sampled_fraction=1.0, system_prompt_fraction=0.0)
    s = Engine(model).run(requests).summary()
    out["4 samples per request (fork)"] = {"shared_pct": 100 * s["kv_shared_fraction"],
                                           "cached_prompt_tokens": s["cached_prompt_tokens"]}
    return out


def measure(run, model_name: str = "target") -> dict:
    quick, device = run.quick, run.device
    load_before = os.getloadavg()
    model = load_pretrained(model_name, device=device).eval()
    requests, config = serving_trace(quick)
    scheduling, sched_runs = compare_schedulers(model, requests, repeats=1 if quick else 3)
    memory, layout_runs = compare_layouts(model, requests, budget_tokens=2048)
    sharing = sharing_savings(model, quick)
    chunking = compare_chunking(model, quick)
    real, real_runs = ({"skipped": "full runs only"}, None) if quick else real_model_results(device)
    results = {"device": str(device), "model": model_name, "threads": torch.get_num_threads(),
               "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg()),
               "trace": {**config.__dict__, "prompt_len": list(config.prompt_len),
                         "stop_tokens": list(config.stop_tokens)},
               "scheduling": scheduling, "memory": memory, "sharing": sharing, "chunked_prefill": chunking,
               REAL_MODEL: real}
    paged16 = memory["layouts"]["paged, block 16"]["waste_pct"]
    results["goals"] = {"continuous >= 2x static throughput": scheduling["throughput_ratio"] >= 2,
                        "continuous has the lower p99 TTFT":
                            scheduling["continuous"]["ttft_p99_s"] < scheduling["static"]["ttft_p99_s"],
                        "paged waste < 4% (block 16)": paged16 < 4,
                        "paged waste < 4% (block 8)": memory["layouts"]["paged, block 8"]["waste_pct"] < 4,
                        "chunked prefill lowers p99 ITL": chunking["itl_p99_ratio"] > 1}
    # drawn from the runs' step records, which the JSON does not keep: `figures` cannot redraw these
    _plot(sched_runs, layout_runs, results, run)
    if real_runs is not None:
        _plot_real(*real_runs, real, run)
    return results


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
    requests, config = real_model_trace(tokenizer)
    scheduling, sched_runs = compare_schedulers(model, requests, repeats=2, num_blocks=512)  # 8192 slots
    layouts = {k: LAYOUTS[k] for k in ("paged, block 16", "contiguous")}
    memory, layout_runs = compare_layouts(model, requests, budget_tokens=1536, layouts=layouts)
    out = {"trace": {**config.__dict__, "prompt_len": list(config.prompt_len), "stop_tokens": list(tokenizer.stop_ids),
                     "prompt_tokens": [min(len(r.prompt) for r in requests), max(len(r.prompt) for r in requests)]},
           "kv_bytes_per_token": sched_runs["continuous"].bytes_per_token,
           "scheduling": scheduling, "memory": memory}
    return out, (sched_runs, layout_runs)


def print_results(results: dict) -> None:
    """The tables of a `bench serving` result."""
    load = f"load average {results['load_avg_before'][0]:.1f} -> {results['load_avg_after'][0]:.1f}"
    _print_scheduling(results["scheduling"], f"\n{results['model']} on {results['device']}, "
                      f"{results['trace']['num_requests']} requests", load)
    _print_memory(results["memory"])
    print_table([{"case": k, **v} for k, v in results["sharing"].items()],
                [("case", "sharing", None), ("shared_pct", "% of tokens stored once for several", "{:.1f}"),
                 ("cached_prompt_tokens", "prompt tokens from the prefix cache", None)], title="\nKV sharing")
    c = results.get("chunked_prefill")
    lo, hi = c["itl_p99_ratio_range"] if c else (0, 0)
    if c:
        print_table(chunking_rows(c), CHUNKING_COLUMNS,
                    title=f"\nchunked prefill, prompts of {c['trace']['prompt_len'][0]}-{c['trace']['prompt_len'][1]} "
                          f"tokens: p99 ITL {c['itl_p99_ratio']:.1f}x lower with {c['compared']} "
                          f"({lo:.1f}..{hi:.1f}x), median of {c['repeats']} alternated runs")
    real = results[REAL_MODEL]
    if "skipped" not in real:
        _print_scheduling(real["scheduling"], f"\n{REAL_MODEL}, {real['trace']['num_requests']} chat requests", load)
        _print_memory(real["memory"])
    print("\ngoals: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in results["goals"].items()))


def _print_scheduling(s: dict, title: str, load: str) -> None:
    def cell(policy, key, fmt):
        lo, hi = s[policy][f"{key}_range"]
        return f"{fmt.format(s[policy][key])} ({fmt.format(lo)}..{fmt.format(hi)})"

    rows = [{"metric": header, "static": cell("static", key, fmt), "continuous": cell("continuous", key, fmt)}
            for key, header, fmt in METRICS]
    lo, hi = s["throughput_ratio_range"]
    print_table(rows, [("metric", "metric", None), ("static", "static batching", None),
                       ("continuous", "continuous batching", None)],
                title=f"{title}, batch limit {s['max_num_seqs']}, median (min..max) of {s['repeats']} alternated "
                      f"runs; continuous / static throughput {s['throughput_ratio']:.2f}x ({lo:.2f}..{hi:.2f}); "
                      f"{load}")


def _print_memory(m: dict) -> None:
    print_table([{"layout": k, **v} for k, v in m["layouts"].items()],
                [("layout", "KV layout", None), ("waste_pct", "waste % of reserved", "{:.1f}"),
                 ("reserved_pct_of_pool", "reserved % of pool", "{:.0f}"), ("max_running", "most running", None),
                 ("throughput_tok_per_s", "tok/s", "{:,.0f}"), ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"),
                 ("preemptions", "preemptions", None)],
                title=f"\ncontinuous batching in {m['budget_tokens']} KV token slots")


def _scheduling_panels(sched_runs: dict, tok_digits: int, ttft_digits: int):
    """Three panels; the first two: each policy's request timeline on one time axis."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, policy in zip(axes[:2], ("static", "continuous")):
        s = sched_runs[policy].summary()
        plot_timeline(ax, sched_runs[policy], f"{policy} batching: {s['throughput_tok_per_s']:.{tok_digits}f} tok/s, "
                                              f"p99 TTFT {s['ttft_p99_s']:.{ttft_digits}f} s")
        ax.set_xlim(0, max(r.steps[-1].end for r in sched_runs.values()))
    return fig, axes


def _plot(sched_runs: dict, layout_runs: dict, results: dict, run) -> None:
    import matplotlib.pyplot as plt

    fig, axes = _scheduling_panels(sched_runs, 0, 2)
    for policy, result in sched_runs.items():
        plot_batch_size(axes[2], result, policy)
    axes[2].set_title("sequences producing a token in each step")
    axes[2].legend()
    fig.suptitle(f"{results['model']}: one Poisson trace, static vs continuous batching "
                 f"({results['scheduling']['throughput_ratio']:.1f}x throughput, median of "
                 f"{results['scheduling']['repeats']})")
    fig.tight_layout()
    run.save_figure(fig, "serving")
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for (label, result), color in zip(layout_runs.items(), ("C0", "C2", "C3")):
        plot_memory(ax1, result, label, color)
        plot_batch_size(ax2, result, label, color=color)
    ax1.set_title(f"KV memory over time ({results['memory']['budget_tokens']} token slots)")
    ax1.legend(fontsize=7)
    ax2.set_title("running sequences in the same budget")
    ax2.legend()
    fig.tight_layout()
    run.save_figure(fig, "serving_memory")
    plt.close(fig)


def _plot_real(sched_runs: dict, layout_runs: dict, real: dict, run) -> None:
    import matplotlib.pyplot as plt

    fig, axes = _scheduling_panels(sched_runs, 1, 1)
    for (label, result), color in zip(layout_runs.items(), ("C0", "C3")):
        plot_memory(axes[2], result, label, color)
    axes[2].set_title(f"KV memory, continuous batching ({real['memory']['budget_tokens']} token slots)")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{REAL_MODEL}: chat requests, static vs continuous batching "
                 f"({real['scheduling']['throughput_ratio']:.1f}x throughput)")
    fig.tight_layout()
    run.save_figure(fig, "serving_smollm2")  # full runs only
    plt.close(fig)


BENCHMARK = bench_serving = Benchmark("serving", measure, print_results,
                                      plots={"{name}_chunked_prefill": plot_chunking})

__all__ = ["bench_serving", "compare_layouts", "compare_schedulers", "print_results", "real_model_results",
           "real_model_trace", "serving_trace", "sharing_savings"]
