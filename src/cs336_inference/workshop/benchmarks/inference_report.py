"""`bench inference`'s tables and figures: latency per axis with the time split and memory, the
operating points, and TTFT; drawn from a result alone (in process or --endpoint)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from ...tables import print_table


def _ms(key: str, header: str):
    return (key, header, lambda v: f"{1e3 * v:.1f}")


LATENCY = [_ms("ttft_median_s", "TTFT p50 ms"), _ms("ttft_p99_s", "TTFT p99 ms"), _ms("tpot_median_s", "TPOT p50 ms"),
           _ms("itl_median_s", "ITL p50 ms"), _ms("itl_p99_s", "ITL p99 ms"), ("e2el_median_s", "E2E p50 s", "{:.2f}"),
           ("output_throughput", "out tok/s", "{:,.0f}"), ("total_token_throughput", "total tok/s", "{:,.0f}")]
# one request at a time: throughput means nothing, the TTFT and its parts do
PROMPT = [_ms("ttft_median_s", "TTFT p50 ms"), _ms("ttft_p99_s", "TTFT p99 ms"),
          _ms("prefill_median_s", "prefill p50 ms"), _ms("queueing_median_s", "queueing p50 ms"),
          _ms("tpot_median_s", "TPOT p50 ms")]
SPLIT = ("split", "queue/prefill/decode %", None)
FAILED = ("failed", "failed", None)
AXES = {"concurrency": ("concurrency", "C", "concurrency (all requests at t = 0: TTFT includes queueing)"),
        "prompt_len": ("prompt_len_lo", "prompt", "prompt length (one request at a time: TTFT = prefill)"),
        "output_len": ("output_len", "output", "output length")}


def _rows(result: dict, axis: str) -> list[dict]:
    """The rows of one axis, with the time split and memory as cells (where the run measured them)."""
    out = []
    for r in (r for r in result["rows"] if r["axis"] == axis):
        total, parts = r["e2el_mean_s"], [r.get(f"{k}_mean_s") for k in ("queueing", "prefill", "decode")]
        memory = f"{r.get('weight_bytes', 0) / 1e6:,.1f} + {r.get('kv_pool_bytes', 0) / 1e6:,.1f}"
        rss, start = r.get("rss_peak_bytes"), r.get("rss_start_bytes")
        if rss and start:
            memory += f" (RSS {rss / 1e6:,.0f}, run +{max(rss - start, 0) / 1e6:,.0f})"
        if r.get("cuda_peak_bytes") is not None:
            memory = f"{r['cuda_peak_bytes'] / 1e6:,.0f} (CUDA)"
        split = " / ".join(f"{100 * p / total:.0f}" for p in parts) if total and None not in parts else "-"
        load = f"{r['num_requests']}x{r['samples']}" if r["samples"] > 1 else str(r["num_requests"])
        out.append({**r, "memory": memory, "split": split, "load": load})
    return out


def _print_axes(result: dict, extra) -> None:
    for axis, (key, header, title) in AXES.items():
        if rows := _rows(result, axis):
            print_table(rows, [("precision", "precision", None), (key, header, None),
                               *(PROMPT if axis == "prompt_len" else LATENCY), extra], title=f"\nSweep over {title}")


def print_inference(result: dict) -> None:
    m, base = result["machine"], result["base_precision"]
    print(f"\nbench inference: {result['model']} on {result['device']} ({m['cpu']}, {m['torch_threads']} thread(s), "
          f"torch {m['torch']}); load average {result['load_avg_before']} -> {result['load_avg_after']}")
    memory = "MB weights + KV pool (peak RSS, run's own)" if result["device"] == "cpu" else "peak MB"
    print_table(_rows(result, "preset"), [("workload", "operating point", None), ("precision", "precision", None),
                                          ("load", "requests", None), ("concurrency", "C", None), *LATENCY,
                                          ("memory", memory, None), SPLIT],
                title="\nOperating points (median/p99 over requests; C = sequences at once; split = mean queueing / "
                      "prefill / decode share of the mean end-to-end latency)")
    q, fp32 = result["quality"], result["quality"].get("fp32", {}).get("bits_per_byte")
    print_table([{"precision": p, **v, "weight_mb": result["weight_bytes"][p] / 1e6,
                  "delta": v["bits_per_byte"] - fp32 if fp32 is not None else None} for p, v in q.items()],
                [("precision", "precision", None), ("weight_mb", "weights MB", "{:,.1f}"),
                 ("bits_per_byte", "bits/byte", "{:.4f}"), ("delta", "vs fp32", "{:+.4f}"),
                 ("kl_to_fp32", "KL(fp32||p) nats/tok", lambda v: f"{max(v, 0.0):.5f}"),
                 ("top1_agreement", "top-1 agree", "{:.3f}")],
                title=f"\nQuality against fp32 ({result['quality_tokens']:,} held-out tokens)")
    if layouts := _rows(result, "kv_layout"):
        chat = [r for r in _rows(result, "preset") if r["workload"] == "chat" and r["precision"] == base]
        print_table(chat + layouts, [
            ("kv_layout", "KV layout", None),
            ("kv_peak_reserved_bytes", "peak reserved KV MB", lambda b: f"{b / 1e6:.2f}"),
            ("kv_waste_fraction", "waste % of reserved", lambda f: f"{100 * f:.1f}"),
            ("max_running", "most running", None), ("output_throughput", "out tok/s", "{:,.0f}"), LATENCY[1]],
            title="\nKV layout on the chat workload (paged blocks of 16 vs contiguous prompt + max_new_tokens)")
    _print_axes(result, SPLIT)
    if spec := _rows(result, "speculative"):
        plain = next((r for r in spec if r["speculative"] == "off"), {})
        for r in spec:
            if plain.get("tpot_median_s") and r["tpot_median_s"]:
                r["speedup"] = plain["tpot_median_s"] / r["tpot_median_s"]
        print_table(spec, [("speculative", "drafter", None), LATENCY[0], LATENCY[2],
                           ("speedup", "decode speed-up", "{:.2f}x"), LATENCY[3], LATENCY[4], LATENCY[5],
                           ("spec_tokens_per_pass", "tokens / target pass", "{:.2f}"),
                           ("spec_draft_acceptance_rate", "drafts accepted", "{:.2f}"),
                           ("same_tokens_as_plain", "same tokens as plain", "{:.2f}")],
                    title=f"\nSpeculative decoding on the chat workload, one request at a time (batch 1, contiguous "
                          f"cache, {base}, gamma {result['speculative']['gamma']})")


def print_endpoint(result: dict) -> None:
    print(f"\nbench inference --endpoint {result['endpoint']} --model {result['model']} (tokens counted by the "
          f"server's usage; prompts cut with the {result['tokenizer']} tokenizer; {result['arrivals']} arrivals)")
    print_table(_rows(result, "preset"), [("workload", "operating point", None), ("load", "requests", None),
                                          ("concurrency", "C", None), *LATENCY, FAILED])
    _print_axes(result, FAILED)


def plot_operating_points(result: dict):
    """Left: output throughput (all users) against the time per output token one user sees, as
    concurrency grows, one curve per precision (the lecture's throughput/latency trade-off). Right:
    where each operating point's requests spend their time (an endpoint's client sees only E2E)."""
    rows, points = _rows(result, "concurrency"), _rows(result, "preset")
    if not rows and not points:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    _plot_tradeoff(ax1, rows)
    base = result.get("base_precision", "server")
    _plot_time_split(ax2, [r for r in points if r["precision"] == base], base)
    fig.suptitle(f"bench inference: {result['model']} on {result['device']}")
    fig.tight_layout()
    return fig


def _plot_tradeoff(ax, rows: list[dict]) -> None:
    """Throughput against TPOT, one curve per precision (min..max bars where runs were repeated), C labels."""
    repeated = any(r.get("repeats", 1) > 1 for r in rows)
    for i, precision in enumerate(dict.fromkeys(r["precision"] for r in rows)):
        pts = sorted((r for r in rows if r["precision"] == precision and r["tpot_median_s"] is not None),
                     key=lambda r: r["concurrency"])
        xs, ys = [1e3 * r["tpot_median_s"] for r in pts], [r["output_throughput"] for r in pts]
        ax.plot(xs, ys, "o-", color=f"C{i}", label=precision)
        if repeated and all(r.get("output_throughput_min") is not None for r in pts):
            ax.errorbar(xs, ys, yerr=[[y - r["output_throughput_min"] for y, r in zip(ys, pts)],
                                      [r["output_throughput_max"] - y for y, r in zip(ys, pts)]],
                        fmt="none", ecolor=f"C{i}", alpha=0.4, capsize=2)
    _label_concurrency(ax, [r for r in rows if r["tpot_median_s"] is not None])
    ax.set(xlabel="time per output token, median (ms): the latency one user sees",
           ylabel="output tokens / s (all users" + ("; bars: min..max of repeats)" if repeated else ")"),
           title="concurrency buys throughput with latency (C = sequences at once)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(title="precision", fontsize=8)


def _label_concurrency(ax, labelled: list[dict]) -> None:
    """C labels: a point whose label would sit on the same label of a nearby point gets none."""
    if not labelled:
        return
    placed = []
    xs, ys = [1e3 * r["tpot_median_s"] for r in labelled], [r["output_throughput"] for r in labelled]
    span_x, span_y = (max(xs) - min(xs)) or 1, (max(ys) - min(ys)) or 1
    for x, y, r in zip(xs, ys, labelled):
        if not any(c == r["concurrency"] and abs(x - px) < 0.06 * span_x and abs(y - py) < 0.06 * span_y
                   for c, px, py in placed):
            placed.append((r["concurrency"], x, y))
            ax.annotate(f"C={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)


def _plot_time_split(ax, points: list[dict], base: str) -> None:
    """Each operating point's mean request time, stacked queueing/prefill/decode where measured (else E2E)."""
    split = all(r.get("queueing_mean_s") is not None for r in points)
    bottom = [0.0] * len(points)
    for key, color in (("queueing", "C7"), ("prefill", "C1"), ("decode", "C0")) if split else (("e2el", "C0"),):
        values = [r[f"{key}_mean_s"] for r in points]
        ax.bar([r["workload"] for r in points], values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    for j, r in enumerate(points):
        ax.annotate(f"{r['output_throughput']:,.0f} tok/s", (j, bottom[j]), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set(ylabel="mean seconds per request", title=f"operating points ({base}): where a request's time goes")
    ax.legend(fontsize=8)


def plot_ttft(result: dict):
    """TTFT against prompt length (one request at a time: the prefill, plus a server's overhead)."""
    rows = _rows(result, "prompt_len")
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, precision in enumerate(dict.fromkeys(r["precision"] for r in rows)):
        pts = sorted((r for r in rows if r["precision"] == precision), key=lambda r: r["prompt_len_lo"])
        ax.plot([r["prompt_len_lo"] for r in pts], [1e3 * r["ttft_median_s"] for r in pts], "o-", color=f"C{i}",
                label=precision)
    ax.set(xlabel="prompt length (tokens)", ylabel="TTFT, median (ms)",
           title=f"{result['model']} on {result['device']}: time to first token = prefill")
    ax.grid(alpha=0.3)
    ax.legend(title="precision")
    fig.tight_layout()
    return fig
