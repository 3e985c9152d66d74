"""`/metrics` in Prometheus' text format: the engine's gauges and the server's counters.

Gauges are the engine's `stats()` after its latest step (requests running and waiting, KV blocks
used and in the pool); counters are what this server has done since it started; histograms are
latencies as the server saw them (time to first token from the request's arrival, and the time
between a choice's tokens), in Prometheus' cumulative `_bucket{le=...}`/`_sum`/`_count` form. The names follow
vLLM's (`vllm:num_requests_running` becomes `cs336:num_requests_running`), so a dashboard made
for vLLM needs only the prefix changed.
"""

from __future__ import annotations

PREFIX = "cs336"

# engine stats() key -> (metric name, help); any other numeric key is exported under its own name
GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests."),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool."),
    "kv_usage": ("kv_cache_usage_perc", "Share of the KV cache blocks in use (1 = full)."),
    "kv_block_size": ("kv_block_size", "Tokens per KV cache block."),
    "running_sequences": ("num_sequences_running", "Sequences in the running batch (n > 1 requests have several)."),
    "waiting_sequences": ("num_sequences_waiting", "Sequences waiting to be scheduled."),
    "open_streams": ("num_open_streams", "Request streams open in the server."),
}
COUNTERS = {
    "requests_ok": ("request_success_total", "Requests that returned every token they generated."),
    "requests_refused": ("request_refused_total", "Requests refused with a 4xx/5xx error."),
    "requests_aborted": ("request_aborted_total", "Requests whose client disconnected before the end."),
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens of finished requests."),
    "generation_tokens": ("generation_tokens_total", "Tokens generated for finished requests."),
}


# vLLM's bucket bounds (seconds), with finer ones below 10 ms, where a small model's steps on a CPU fall
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    """Counts of observations at or below each bound (cumulative, as Prometheus reads them), their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"buckets must be increasing and non-empty, got {buckets}")
        self.name, self.help_text, self.buckets = name, help_text, tuple(float(b) for b in buckets)
        self.counts = [0] * len(self.buckets)    # observations in (bucket[i-1], bucket[i]]; above the last: count only
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` (seconds) `times` times."""
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def lines(self, labels: str) -> list[str]:
        full = f"{PREFIX}:{self.name}"
        out, cumulative = [f"# HELP {full} {self.help_text}", f"# TYPE {full} histogram"], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{full}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out.append(f'{full}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{full}_sum{{{labels}}} {self.sum}", f"{full}_count{{{labels}}} {self.count}"]


def latency_histograms() -> dict[str, Histogram]:
    """The server's histograms, empty: "ttft" and "itl"."""
    return {"ttft": Histogram("time_to_first_token_seconds", "Time from a request's arrival to each choice's "
                              "first token.", TTFT_BUCKETS),
            "itl": Histogram("inter_token_latency_seconds", "Time between consecutive tokens of a choice (tokens "
                             "that arrive together share the interval since the previous ones).", ITL_BUCKETS)}


def _lines(kind: str, name: str, help_text: str, value, labels: str) -> list[str]:
    full = f"{PREFIX}:{name}"
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full}{{{labels}}} {value}"]


def prometheus_text(server) -> str:
    labels = f'model_name="{server.model_name}"'
    lines = []
    stats = server.engine.stats()
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name, help_text = GAUGES.get(key, (key, f"engine stats()[{key!r}]."))
        lines += _lines("gauge", name, help_text, value, labels)
    for key, (name, help_text) in COUNTERS.items():
        lines += _lines("counter", name, help_text, server.counters[key], labels)
    for histogram in server.histograms.values():
        lines += histogram.lines(labels)
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """{name: value} of a Prometheus text page: what the tests and clients read. Labels are dropped,
    but a histogram bucket keeps its bound: `NAME_bucket{le="0.1"}`."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            bound = [part for part in labels.rstrip("}").split(",") if part.startswith("le=")]
            out[base + (f"{{{bound[0]}}}" if bound else "")] = float(value)
    return out


__all__ = ["Histogram", "latency_histograms", "parse_metrics", "prometheus_text"]
