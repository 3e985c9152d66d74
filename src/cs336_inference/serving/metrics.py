"""What a serving run delivered, per request and in aggregate.

Throughput alone hides waiting users and latency alone hides idle hardware, so we report both:
generated tokens per second over the run, and for users the time to first token (TTFT: queueing +
prefill), the inter-token latency (ITL: the gap between a sample's consecutive tokens) and the
queueing time, each at the median and the 99th percentile.
"""

from __future__ import annotations

import numpy as np

from .request import RequestOutput


def percentile(values, q: float) -> float:
    """q-th percentile (linear interpolation); nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(outputs: list[RequestOutput]) -> dict[str, float]:
    """Throughput, TTFT / ITL / queueing percentiles (seconds) and totals over a finished run."""
    if not outputs:
        raise ValueError("outputs is empty: nothing to summarize")
    start = min(o.arrival_time for o in outputs)
    end = max(o.finish_time for o in outputs)
    generated = sum(o.num_generated for o in outputs)
    ttft = [o.ttft for o in outputs]
    itl = [x for o in outputs for x in o.inter_token_latencies]
    queue = [o.queueing_time for o in outputs]
    latency = [o.latency for o in outputs]
    return {
        "requests": len(outputs),
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


__all__ = ["percentile", "summarize"]
