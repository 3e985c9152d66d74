"""`bench serving`, part 5: chunked prefill on a trace with long prompts (Sarathi-Serve, Agrawal et al. 2024).

Without chunking a step runs every admitted prompt whole, so the decodes sharing that step wait for
it: their inter-token latency spikes to a prefill's cost. With `chunked_prefill` a step holds at
most `max_num_batched_tokens` tokens: decodes first, then pieces of the prompts, so no step is much
longer than another. The trace: 24 requests at 30 per second (`--quick`: 8 at 8 per second),
prompts of 256 to 384 tokens from the validation text (no shared prefix, so nothing is skipped), 64
new tokens each. The same engine (16 sequences at once) serves it whole (token budget 2048) and in
chunks of 64, 128 and 256 tokens, alternated `repeats` times.
"""

from __future__ import annotations

import statistics

from ..data.corpus import load_corpus
from ..serving import Engine, TraceConfig, make_trace

BUDGETS = (64, 128, 256)
WHOLE = "whole prompts"
KEYS = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "throughput_tok_per_s")


def chunking_trace(quick: bool = False):
    config = TraceConfig(num_requests=8 if quick else 24, rate=8.0 if quick else 30.0, prompt_len=(256, 384),
                         max_new_tokens=64, system_prompt_fraction=0.0, sampled_fraction=0.0, seed=1)
    return make_trace(load_corpus("val")[1000:], config), config


def compare_chunking(model, quick: bool = False) -> dict:
    """p50/p99 ITL and TTFT, throughput and the longest step, whole vs chunked (median of the
    alternated repeats), the p99 ITL ratio of each side-by-side pair, and one run's step durations."""
    requests, config = chunking_trace(quick)
    budgets, repeats = ((128,), 1) if quick else (BUDGETS, 3)
    configs = {WHOLE: dict(max_num_batched_tokens=2048)}
    configs.update({f"chunks of {b}": dict(chunked_prefill=True, max_num_batched_tokens=b) for b in budgets})
    runs = {name: [] for name in configs}
    for _ in range(repeats):
        for name, options in configs.items():
            runs[name].append(Engine(model, max_num_seqs=16, **options).run(requests))
    chunked = f"chunks of {budgets[min(1, len(budgets) - 1)]}"
    assert all(a.tokens == b.tokens for a, b in zip(runs[WHOLE][0].outputs, runs[chunked][0].outputs)), \
        "chunked prefill changed a greedy output"
    out = {"trace": {**config.__dict__, "prompt_len": list(config.prompt_len), "stop_tokens": []},
           "repeats": repeats, "max_num_seqs": 16, "compared": chunked, "configs": {}}
    for name, results in runs.items():
        summaries = [r.summary() for r in results]
        row = {key: statistics.median(s[key] for s in summaries) for key in KEYS}
        row["steps"] = summaries[0]["steps"]
        row["longest_step_tokens"] = max(s.num_tokens for s in results[0].steps)
        out["configs"][name] = row
    ratios = [w.summary()["itl_p99_s"] / c.summary()["itl_p99_s"] for w, c in zip(runs[WHOLE], runs[chunked])]
    out["itl_p99_ratio"] = statistics.median(ratios)
    out["itl_p99_ratio_range"] = [min(ratios), max(ratios)]
    out["timeline"] = {name: {"end_s": [r.end for r in runs[name][0].steps],
                              "duration_ms": [1e3 * (r.end - r.start) for r in runs[name][0].steps]}
                       for name in (WHOLE, chunked)}
    return out


def chunking_rows(c: dict) -> list[dict]:
    return [{"config": name, **row} for name, row in c["configs"].items()]


CHUNKING_COLUMNS = [("config", "prefill", None), ("itl_p50_s", "ITL p50 (s)", "{:.4f}"),
                    ("itl_p99_s", "ITL p99 (s)", "{:.4f}"), ("ttft_p50_s", "TTFT p50 (s)", "{:.2f}"),
                    ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"), ("throughput_tok_per_s", "tok/s", "{:,.0f}"),
                    ("longest_step_tokens", "longest step (tokens)", None)]


def plot_chunking(result: dict):
    """Step durations over time (whole vs chunked) and p50/p99 ITL per configuration."""
    import matplotlib.pyplot as plt

    c = result.get("chunked_prefill")
    if not c:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for (name, series), color in zip(c["timeline"].items(), ("C3", "C0")):
        ax1.plot(series["end_s"], series["duration_ms"], ".-", ms=3, lw=0.8, color=color, label=name)
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("step duration (ms)")
    ax1.set_title("every step: a whole prompt stalls the decodes beside it")
    ax1.legend()
    names = list(c["configs"])
    x = range(len(names))
    for offset, key, label in ((-0.2, "itl_p50_s", "ITL p50"), (0.2, "itl_p99_s", "ITL p99")):
        ax2.bar([i + offset for i in x], [1e3 * c["configs"][n][key] for n in names], width=0.4, label=label)
    ax2.set_xticks(list(x), names, fontsize=8)
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.set_title(f"p99 ITL {c['itl_p99_ratio']:.1f}x lower with {c['compared']} (median of {c['repeats']})")
    ax2.legend()
    fig.suptitle(f"{result['model']}: {c['trace']['num_requests']} requests with prompts of "
                 f"{c['trace']['prompt_len'][0]}-{c['trace']['prompt_len'][1]} tokens, chunked prefill")
    fig.tight_layout()
    return fig


__all__ = ["CHUNKING_COLUMNS", "chunking_rows", "chunking_trace", "compare_chunking", "plot_chunking"]
