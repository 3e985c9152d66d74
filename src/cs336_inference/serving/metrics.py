"""What a serving run delivered, per request and in aggregate.

Throughput alone hides waiting users and latency alone hides idle hardware, so we report both:
generated tokens per second over the run, and for users the time to first token (TTFT: queueing +
prefill), the inter-token latency (ITL: the gap between a sample's consecutive tokens) and the
queueing time, each at the median and the 99th percentile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import RequestRecord


def percentile(values, q: float) -> float:
    """q-th percentile (linear interpolation); nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(records: list[RequestRecord]) -> dict[str, float]:
    """Throughput, TTFT / ITL / queueing percentiles (seconds) and totals over a finished run's
    completed requests (`failed`: how many were refused or aborted)."""
    outputs = [o for o in records if o.completed]
    if not outputs:
        raise ValueError(f"outputs hold no completed request ({len(records)} given): nothing to summarize")
    start = min(o.arrival_time for o in outputs)
    end = max(o.finish_time for o in outputs)
    generated = sum(o.num_generated for o in outputs)
    ttft = [o.ttft for o in outputs]
    itl = [x for o in outputs for x in o.inter_token_latencies]
    queue = [o.queueing_time for o in outputs]
    latency = [o.latency for o in outputs]
    return {
        "requests": len(outputs),
        "failed": len(records) - len(outputs),
        "generated_tokens": generated,
        "makespan_s": end - start,
        "throughput_tok_per_s": generated / (end - start),
        "requests_per_s": len(outputs) / (end - start),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "queueing_mean_s": float(np.mean(queue)), "queueing_p50_s": percentile(queue, 50),
        "queueing_p99_s": percentile(queue, 99),
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
        "preemptions": sum(o.num_preemptions for o in outputs),
        "cached_prompt_tokens": sum(o.cached_prompt_tokens for o in outputs),
    }




# --- serving-benchmark metrics, defined as vLLM's benchmark defines them ---------------------------
#
# vLLM (`vllm bench serve`, benchmarks/benchmark_serving.py) times each request on the client:
#   TTFT  = first streamed chunk - request sent;   E2EL = last chunk - request sent;
#   TPOT  = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token;
#   ITL   = the gaps between consecutive chunks of every request, pooled over all requests;
#   throughput = output tokens / duration (and input + output tokens / duration, requests / duration);
#   each latency reported as mean, median and p99 (np.percentile, linear interpolation).
# Where ours differ (see `request_metrics` / `benchmark_metrics`):
#   - the clock is the engine's (compute time; idle gaps between arrivals are skipped, see engine.py),
#     with no network, HTTP or detokenization in it; "sent" is the request's arrival in the trace;
#   - a request's time is split into queueing (arrival -> first scheduled), prefill (-> first token)
#     and decode (-> last token); vLLM's client cannot see that split;
#   - token counts are exact (vLLM re-tokenizes the text or trusts the server's count);
#   - a request with n > 1 samples: TTFT is its first token of any sample, E2EL its last token of
#     any sample, TPOT divides by the longest sample's tokens - 1 (the samples decode side by side),
#     and ITL pools every sample's gaps; vLLM's benchmark sends n = 1;
#   - tokens that arrive at the same instant (a speculative pass emits several) form one chunk, as a
#     stream would deliver them: ITL counts the gap between chunks, not the zero gaps inside one.

_DISTRIBUTIONS = ("ttft", "tpot", "itl", "e2el", "queueing", "prefill", "decode")


@dataclass(frozen=True)
class RequestMetrics:
    """One request's latencies in seconds (engine clock) and token counts."""

    request_id: object
    prompt_tokens: int
    output_tokens: int          # over all samples
    ttft: float                 # arrival -> first token
    e2el: float                 # arrival -> last token
    tpot: float | None          # (e2el - ttft) / (longest sample - 1); None for a single output token
    itls: tuple[float, ...]     # gaps between consecutive chunks of each sample
    queueing: float             # arrival -> first scheduled
    prefill: float              # first scheduled -> first token
    decode: float               # first token -> last token (includes any recompute after a preemption)


def _chunk_gaps(times: list[float]) -> list[float]:
    """Gaps between distinct consecutive arrival times (tokens arriving together are one chunk)."""
    chunks = [t for i, t in enumerate(times) if i == 0 or t != times[i - 1]]
    return [b - a for a, b in zip(chunks, chunks[1:])]


def request_metrics(output: RequestRecord) -> RequestMetrics:
    """vLLM's per-request metrics (TTFT, TPOT, ITL, E2EL) plus the queueing/prefill/decode split."""
    samples = [times for times in output.token_times if times]
    if not samples:
        raise ValueError(f"request {output.request_id!r} has no output token: nothing to time")
    first = min(times[0] for times in samples)
    last = max(times[-1] for times in samples)
    longest = max(len(times) for times in samples)
    ttft, e2el = first - output.arrival_time, last - output.arrival_time
    scheduled = output.first_scheduled_time if output.first_scheduled_time is not None else output.arrival_time
    return RequestMetrics(
        request_id=output.request_id, prompt_tokens=output.prompt_len,
        output_tokens=sum(len(times) for times in samples), ttft=ttft, e2el=e2el,
        tpot=(e2el - ttft) / (longest - 1) if longest > 1 else None,
        itls=tuple(gap for times in samples for gap in _chunk_gaps(times)),
        queueing=scheduled - output.arrival_time, prefill=first - scheduled, decode=last - first)


def distribution(values) -> dict[str, float]:
    """mean, median and p99 of `values` (nan for none), as vLLM reports each latency."""
    values = list(values)
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": float(np.mean(values)), "median": float(np.median(values)), "p99": percentile(values, 99)}


def benchmark_metrics(records: list[RequestRecord], duration: float | None = None) -> dict:
    """Aggregate a finished run the way vLLM's serving benchmark does (see the notes above).

    duration: seconds the run took (default: first arrival -> last token on the engine clock).
    Returns counts, throughputs (requests/s, output tok/s, total = input + output tok/s) and for each
    of ttft, tpot, itl, e2el, queueing, prefill, decode a {mean, median, p99} dict in seconds; TPOT
    leaves out requests with a single output token, as vLLM does. Requests refused or aborted count
    as `failed` and are left out of every measure.
    """
    outputs = [o for o in records if o.completed]
    if not outputs:
        raise ValueError(f"outputs hold no completed request ({len(records)} given): nothing to measure")
    per_request = [request_metrics(o) for o in outputs]
    if duration is None:
        duration = max(o.arrival_time + m.e2el for o, m in zip(outputs, per_request)) - min(
            o.arrival_time for o in outputs)
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    input_tokens = sum(m.prompt_tokens for m in per_request)
    output_tokens = sum(m.output_tokens for m in per_request)
    values = _latencies(per_request)
    return {"completed": len(per_request), "failed": len(records) - len(outputs), "duration_s": duration,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens, "request_throughput": len(per_request) / duration,
            "output_throughput": output_tokens / duration,
            "total_token_throughput": (input_tokens + output_tokens) / duration,
            **{name: distribution(values[name]) for name in _DISTRIBUTIONS}}


def _latencies(per_request: list[RequestMetrics]) -> dict[str, list[float]]:
    """Each latency's values over the requests (TPOT: those with more than one token; ITL: every gap)."""
    return {
        "ttft": [m.ttft for m in per_request], "tpot": [m.tpot for m in per_request if m.tpot is not None],
        "itl": [gap for m in per_request for gap in m.itls], "e2el": [m.e2el for m in per_request],
        "queueing": [m.queueing for m in per_request], "prefill": [m.prefill for m in per_request],
        "decode": [m.decode for m in per_request]}


def flat_metrics(metrics: dict) -> dict:
    """`benchmark_metrics` (or the client's `stream_metrics`) as one flat row of a table or CSV:
    {"ttft": {"mean": .., "median": .., "p99": ..}} -> {"ttft_mean_s": .., "ttft_median_s": .., ...}."""
    out = {}
    for key, value in metrics.items():
        out.update({f"{key}_{stat}_s": v for stat, v in value.items()} if isinstance(value, dict) else {key: value})
    return out


__all__ = ["RequestMetrics", "benchmark_metrics", "distribution", "flat_metrics", "percentile", "request_metrics",
           "summarize"]
