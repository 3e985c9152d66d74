"""Tables and figures of a `bench inference` result (the dict `bench_inference` saves as JSON)."""

from __future__ import annotations

from ..tables import format_table

MS = "{:.1f}"


def _ms(value) -> float | None:
    return None if value is None else 1e3 * value


def _rows(result: dict, axis: str) -> list[dict]:
    return [r for r in result["rows"] if r["axis"] == axis]


def _memory_cell(r: dict) -> str:
    if r.get("cuda_peak_bytes") is not None:
        return f"{r['cuda_peak_bytes'] / 1e6:,.0f} (CUDA)"
    rss, start = r.get("rss_peak_bytes"), r.get("rss_start_bytes")
    cell = f"{r['weight_bytes'] / 1e6:,.1f} + {r.get('kv_pool_bytes', 0) / 1e6:,.1f}"
    if rss and start:
        cell += f" (RSS {rss / 1e6:,.0f}, run +{max(rss - start, 0) / 1e6:,.0f})"
    return cell


def _split_cell(r: dict) -> str:
    """Mean queueing / prefill / decode shares of the mean end-to-end latency, in %."""
    total = r["e2el_mean_s"]
    parts = [r["queueing_mean_s"], r["prefill_mean_s"], r["decode_mean_s"]]
    return " / ".join(f"{100 * p / total:.0f}" for p in parts) if total > 0 else "-"


LATENCY_COLUMNS = [
    ("ttft_median_s", "TTFT p50 ms", lambda v: MS.format(_ms(v))),
    ("ttft_p99_s", "TTFT p99 ms", lambda v: MS.format(_ms(v))),
    ("tpot_median_s", "TPOT p50 ms", lambda v: MS.format(_ms(v))),
    ("itl_median_s", "ITL p50 ms", lambda v: MS.format(_ms(v))),
    ("itl_p99_s", "ITL p99 ms", lambda v: MS.format(_ms(v))),
    ("e2el_median_s", "E2E p50 s", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:,.0f}"),
    ("total_token_throughput", "total tok/s", "{:,.0f}"),
]


def operating_point_rows(result: dict) -> list[dict]:
    return [{**r, "memory": _memory_cell(r), "split": _split_cell(r),
             "load": f"{r['num_requests']}x{r['samples']}" if r["samples"] > 1 else str(r["num_requests"])}
            for r in _rows(result, "preset")]


def operating_point_table(result: dict) -> str:
    memory = "MB weights + KV pool (peak RSS, run's own)" if result["device"] == "cpu" else "peak MB"
    columns = [("workload", "operating point", None), ("precision", "precision", None),
               ("load", "requests", None), ("concurrency", "C", None), *LATENCY_COLUMNS,
               ("memory", memory, None), ("split", "queue/prefill/decode %", None)]
    return format_table(operating_point_rows(result), columns)


def quality_table(result: dict) -> str:
    q = result["quality"]
    fp32 = q.get("fp32", {}).get("bits_per_byte")
    rows = [{"precision": p, **v, "weight_mb": result["weight_bytes"][p] / 1e6,
             "delta": (v["bits_per_byte"] - fp32) if fp32 is not None else None} for p, v in q.items()]
    return format_table(rows, [("precision", "precision", None), ("weight_mb", "weights MB", "{:,.1f}"),
                               ("bits_per_byte", "bits/byte", "{:.4f}"), ("delta", "vs fp32", "{:+.4f}"),
                               ("kl_to_fp32", "KL(fp32||p) nats/tok", lambda v: f"{max(v, 0.0):.5f}"),
                               ("top1_agreement", "top-1 agree", "{:.3f}")])


def kv_layout_table(result: dict) -> str:
    chat = [r for r in _rows(result, "preset")
            if r["workload"] == "chat" and r["precision"] == result["base_precision"]]
    rows = chat + _rows(result, "kv_layout")
    return format_table(rows, [("kv_layout", "KV layout", None),
                               ("kv_peak_reserved_bytes", "peak reserved KV MB", lambda b: f"{b / 1e6:.2f}"),
                               ("kv_waste_fraction", "waste % of reserved", lambda f: f"{100 * f:.1f}"),
                               ("max_running", "most running", None),
                               ("output_throughput", "out tok/s", "{:,.0f}"),
                               ("ttft_p99_s", "TTFT p99 ms", lambda v: MS.format(_ms(v)))])


PROMPT_COLUMNS = [
    ("ttft_median_s", "TTFT p50 ms", lambda v: MS.format(_ms(v))),
    ("ttft_p99_s", "TTFT p99 ms", lambda v: MS.format(_ms(v))),
    ("prefill_median_s", "prefill p50 ms", lambda v: MS.format(_ms(v))),
    ("queueing_median_s", "queueing p50 ms", lambda v: MS.format(_ms(v))),
    ("tpot_median_s", "TPOT p50 ms", lambda v: MS.format(_ms(v))),
]


def axis_table(result: dict, axis: str, key: str, header: str) -> str:
    """One sweep axis: a row per (precision, value). The prompt-length axis serves one request at a time,
    so its throughput means nothing and its table shows the TTFT and its parts instead."""
    latency = PROMPT_COLUMNS if axis == "prompt_len" else LATENCY_COLUMNS
    columns = [("precision", "precision", None), (key, header, None), *latency,
               ("split", "queue/prefill/decode %", None)]
    rows = [{**r, key: r["prompt_len_lo"] if key == "prompt_len" else r[key], "split": _split_cell(r)}
            for r in _rows(result, axis)]
    return format_table(rows, columns)


def print_inference(result: dict) -> None:
    m = result["machine"]
    print(f"\nbench inference: {result['model']} on {result['device']} ({m['cpu']}, {m['torch_threads']} thread(s), "
          f"torch {m['torch']}); load average {result['load_avg_before']} -> {result['load_avg_after']}")
    print("\nOperating points (median/p99 over requests; C = sequences at once; split = mean queueing / prefill / "
          "decode share of the mean end-to-end latency)")
    print(operating_point_table(result))
    print(f"\nQuality against fp32 ({result['quality_tokens']:,} held-out tokens)")
    print(quality_table(result))
    if _rows(result, "kv_layout"):
        print("\nKV layout on the chat workload (paged blocks of 16 vs contiguous prompt + max_new_tokens)")
        print(kv_layout_table(result))
    for axis, key, header in (("concurrency", "concurrency", "C"), ("prompt_len", "prompt_len", "prompt"),
                              ("output_len", "output_len", "output")):
        if _rows(result, axis):
            print(f"\nSweep over {AXIS_TITLES[axis]}")
            print(axis_table(result, axis, key, header))
    if _rows(result, "speculative"):
        s = result["speculative"]
        print(f"\nSpeculative decoding on the chat workload, one request at a time (batch 1, contiguous cache, "
              f"{result['base_precision']}, gamma {s['gamma']})")
        print(speculative_table(result))


def speculative_table(result: dict) -> str:
    rows = [{**r, "tpot_ms": _ms(r["tpot_median_s"])} for r in _rows(result, "speculative")]
    plain = next((r for r in rows if r["speculative"] == "off"), None)
    for r in rows:
        if plain is not None and r["tpot_median_s"] and plain["tpot_median_s"]:
            r["speedup"] = plain["tpot_median_s"] / r["tpot_median_s"]
    return format_table(rows, [
        ("speculative", "drafter", None), ("ttft_median_s", "TTFT p50 ms", lambda v: MS.format(_ms(v))),
        ("tpot_ms", "TPOT p50 ms", MS), ("speedup", "decode speed-up", "{:.2f}x"),
        ("itl_median_s", "ITL p50 ms", lambda v: MS.format(_ms(v))),
        ("itl_p99_s", "ITL p99 ms", lambda v: MS.format(_ms(v))), ("e2el_median_s", "E2E p50 s", "{:.2f}"),
        ("spec_tokens_per_pass", "tokens / target pass", "{:.2f}"),
        ("spec_draft_acceptance_rate", "drafts accepted", "{:.2f}"),
        ("same_tokens_as_plain", "same tokens as plain", "{:.2f}")])


AXIS_TITLES = {"concurrency": "concurrency (all requests at t = 0: TTFT includes queueing)",
               "prompt_len": "prompt length (one request at a time: TTFT = prefill)",
               "output_len": "output length"}


def plot_operating_points(result: dict):
    """Left: output throughput (all users) against the time per output token one user sees, as
    concurrency grows, one curve per precision: the throughput/latency trade-off of the lecture,
    measured. Right: where each operating point's requests spend their time (queueing, prefill,
    decode; mean seconds, base precision)."""
    import matplotlib.pyplot as plt

    if not _rows(result, "concurrency") and not _rows(result, "preset"):
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    rows = _rows(result, "concurrency")
    repeated = any(r.get("repeats", 1) > 1 for r in rows)
    for i, precision in enumerate(dict.fromkeys(r["precision"] for r in rows)):
        pts = sorted((r for r in rows if r["precision"] == precision), key=lambda r: r["concurrency"])
        pts = [r for r in pts if r["tpot_median_s"] is not None]
        xs, ys = [1e3 * r["tpot_median_s"] for r in pts], [r["output_throughput"] for r in pts]
        ax1.plot(xs, ys, "o-", color=f"C{i}", label=precision)
        if repeated and all(r.get("output_throughput_min") is not None for r in pts):
            low = [y - r["output_throughput_min"] for y, r in zip(ys, pts)]   # min..max over the repeats
            high = [r["output_throughput_max"] - y for y, r in zip(ys, pts)]
            ax1.errorbar(xs, ys, yerr=[low, high], fmt="none", ecolor=f"C{i}", alpha=0.4, capsize=2)
        for x, y, r in zip(xs, ys, pts):
            ax1.annotate(f"C={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax1.set_xlabel("time per output token, median (ms): the latency one user sees")
    ax1.set_ylabel("output tokens / s (all users" + ("; bars: min..max of repeats)" if repeated else ")"))
    ax1.set_title("concurrency buys throughput with latency")
    ax1.grid(alpha=0.3)
    if rows:
        ax1.legend(title="precision", fontsize=8)

    points = [r for r in _rows(result, "preset") if r["precision"] == result["base_precision"]]
    names = [r["workload"] for r in points]
    bottom = [0.0] * len(points)
    for key, color in (("queueing", "C7"), ("prefill", "C1"), ("decode", "C0")):
        values = [r[f"{key}_mean_s"] for r in points]
        ax2.bar(names, values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    for j, r in enumerate(points):
        ax2.annotate(f"{r['output_throughput']:,.0f} tok/s", (j, bottom[j]), textcoords="offset points",
                     xytext=(0, 3), ha="center", fontsize=8)
    ax2.set_ylabel("mean seconds per request")
    ax2.set_title(f"operating points ({result['base_precision']}): where a request's time goes")
    ax2.legend(fontsize=8)
    fig.suptitle(f"bench inference: {result['model']} on {result['device']}")
    fig.tight_layout()
    return fig


def plot_ttft(result: dict):
    """TTFT against prompt length (one request at a time: TTFT is the prefill), one curve per precision."""
    import matplotlib.pyplot as plt

    rows = _rows(result, "prompt_len")
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, precision in enumerate(dict.fromkeys(r["precision"] for r in rows)):
        pts = sorted((r for r in rows if r["precision"] == precision), key=lambda r: r["workload_spec"]["prompt_len"])
        ax.plot([r["workload_spec"]["prompt_len"][0] for r in pts], [1e3 * r["ttft_median_s"] for r in pts], "o-",
                color=f"C{i}", label=precision)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(f"{result['model']} on {result['device']}: time to first token = prefill")
    ax.grid(alpha=0.3)
    ax.legend(title="precision")
    fig.tight_layout()
    return fig


__all__ = ["axis_table", "kv_layout_table", "operating_point_table", "plot_operating_points", "plot_ttft",
           "print_inference", "quality_table", "speculative_table"]
