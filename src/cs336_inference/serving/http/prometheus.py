"""`/metrics` in Prometheus' text format: the engine's gauges and the server's counters.

Gauges are the engine's `stats()` after its latest step (requests running and waiting, KV blocks
used and in the pool); counters are what this server has done since it started. The names follow
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
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """{name: value} of a Prometheus text page (labels dropped): what the tests and clients read."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


__all__ = ["parse_metrics", "prometheus_text"]
