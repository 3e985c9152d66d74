"""`bench inference --endpoint URL --model NAME`: the inference sweep, measured as a client of a server.

The same workloads as the in-process benchmark (`inference_config`: the three operating points, then
the concurrency, prompt-length and output-length axes), sent as streamed `/v1/completions` requests
to any OpenAI-compatible server: ours (`python -m cs336_inference serve`), vLLM, SGLang or
llama.cpp's server. Each request is timed on this side (`serving/client.py`, vLLM's definitions:
TTFT, TPOT, ITL, E2E, throughput). Precision, KV layout and speculative decoding are the server's
business, so those axes are absent, and so is the queueing/prefill/decode split (a client cannot
see it).

Prompts are cut from held-out text with a tokenizer (ours by default, `tokenizer=` for another) and
sent as text; answers get exactly `output_len` tokens (`ignore_eos`) unless the workload stops at
the model's end token. Output tokens are the server's `usage` count, with our re-count beside it.
Arrivals follow the workload's rate (Poisson, or `arrivals="fixed"`: evenly spaced); the
one-request-at-a-time axis sends them back to back; at most `concurrency` are in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

from ..model.checkpoints import available_pretrained
from ..model.real_models import REAL_MODELS
from ..model.tokenizer import ByteTokenizer, load_tokenizer
from ..serving.client import (EndpointRequest, arrival_times, count_tokens, http_sender, open_session, run_load,
                              stream_metrics)
from ..tables import format_table
from .base import Benchmark
from .inference_config import SPARSE_RATE, RunSpec, Workload, check_arguments, sweep_config
from .inference_runs import flatten_metrics, make_requests, source_tokens, stop_tokens

AXES = ("preset", "concurrency", "prompt_len", "output_len")
DEFAULT_TOKENIZER = "smollm2-135m"   # a real BPE, for a server whose model is not one of ours


class FileTokenizer:
    """A Hugging Face `tokenizer.json` (e.g. from a vLLM model's snapshot), with our encode/decode."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok, self.name, self.stop_ids, self.eos_id = Tokenizer.from_file(path), path, [], None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def resolve_tokenizer(model: str, tokenizer: str | None):
    """(tokenizer, its name): `tokenizer` (one of ours, or a tokenizer.json path), else `model`'s own
    when it is one of ours, else DEFAULT_TOKENIZER (approximate counts for another vocabulary)."""
    ours = set(available_pretrained()) | set(REAL_MODELS)
    name = tokenizer or (model if model in ours else DEFAULT_TOKENIZER)
    if name in ours:
        return load_tokenizer(name), name
    if Path(name).is_file():
        return FileTokenizer(name), name
    raise ValueError(f"tokenizer must be one of ours {sorted(ours)} or a tokenizer.json file, got {name!r}")


def base_url(endpoint: str) -> str:
    """http://host:port or http://host:port/v1 -> http://host:port/v1."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {endpoint!r}")
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def served_models(url: str, timeout: float = 10) -> list[dict]:
    """GET /v1/models: what the server says it serves (a clear error if it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/models", timeout=timeout) as response:
            return json.loads(response.read())["data"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"no OpenAI-compatible server answered GET {url}/models ({error})") from None


def endpoint_runs(config, preset: str | None) -> list[RunSpec]:
    """The sweep's runs on AXES, one per workload (the precision axis is the server's)."""
    runs, seen = [], set()
    for spec in config.runs(only_preset=preset):
        key = (spec.axis, spec.workload)
        if spec.axis in AXES and key not in seen:
            seen.add(key)
            runs.append(spec)
    return runs


def endpoint_requests(w: Workload, source: list[int], tokenizer, stop: tuple[int, ...],
                      arrivals: str) -> tuple[list[EndpointRequest], int]:
    """The workload's trace as text requests, and how many may be in flight."""
    trace = make_requests(w, source, tokenizer, stop)
    sequential = w.rate == SPARSE_RATE          # one request at a time: sent back to back, not hours apart
    times = arrival_times(len(trace), math.inf if sequential else w.rate, arrivals, w.seed)
    special = set(getattr(tokenizer, "stop_ids", []))
    stop_text = tuple(tokenizer.decode([t]) for t in stop if t not in special) if w.stop_at_eos else ()
    requests = [EndpointRequest(tokenizer.decode(list(r.prompt)), r.max_new_tokens, t, n=w.samples,
                                temperature=w.temperature, seed=w.seed * 10_007 + i if w.temperature > 0 else None,
                                ignore_eos=not w.stop_at_eos, stop=stop_text)
                for i, (r, t) in enumerate(zip(trace, times))]
    return requests, 1 if sequential else w.concurrency


async def _serve(url: str, model: str, requests: list[EndpointRequest], concurrency: int):
    async with open_session(concurrency) as session:
        return await run_load(http_sender(session, url, model), requests, concurrency)


def one_endpoint_run(url: str, model: str, spec: RunSpec, source, tokenizer, stop, arrivals: str) -> dict:
    w = spec.workload
    requests, concurrency = endpoint_requests(w, source, tokenizer, stop, arrivals)
    results, duration = asyncio.run(_serve(url, model, requests, concurrency))
    failed = [r.error for r in results if not r.ok]
    if len(failed) == len(results):
        raise RuntimeError(f"every request of {w.name!r} failed, e.g. {failed[0]}")
    count_tokens(results, requests, tokenizer)
    per_request = [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                    "counted_prompt_tokens": r.counted_prompt_tokens,
                    "counted_output_tokens": r.counted_output_tokens, "usage_reported": r.usage is not None,
                    "ttft_s": r.ttft if r.ok else None, "e2el_s": r.e2el if r.ok else None,
                    "tpot_s": r.tpot if r.ok else None, "error": r.error} for r in results]
    return {"axis": spec.axis, "workload": w.name, "precision": "server", "concurrency": concurrency,
            "prompt_len_lo": w.prompt_len[0], "prompt_len_hi": w.prompt_len[1], "output_len": w.output_len,
            "num_requests": w.num_requests, "samples": w.samples, "workload_spec": w.describe(),
            "arrivals": arrivals, **flatten_metrics(stream_metrics(results, duration)), "requests": per_request}


def measure_endpoint(endpoint: str, model: str, quick: bool = False, preset: str | None = None,
                     concurrency: int | None = None, output_len: int | None = None, tokenizer: str | None = None,
                     arrivals: str = "poisson", progress: bool = True) -> dict:
    """Run the sweep (or one operating point) against `endpoint`; the result dict (rows like the
    in-process benchmark's, precision "server")."""
    check_arguments(model, preset, concurrency, output_len)
    if arrivals not in ("poisson", "fixed"):
        raise ValueError(f"arrivals must be 'poisson' or 'fixed', got {arrivals!r}")
    url = base_url(endpoint)
    cards = served_models(url)
    if model not in [c.get("id") for c in cards]:
        raise ValueError(f"{url} does not serve {model!r}; it serves {[c.get('id') for c in cards]}")
    tok, tok_name = resolve_tokenizer(model, tokenizer)
    real = not isinstance(tok, ByteTokenizer)
    config = sweep_config(real, quick)
    runs = endpoint_runs(config, preset)
    if preset is not None:
        changes = {k: v for k, v in (("concurrency", concurrency), ("output_len", output_len)) if v is not None}
        runs = [RunSpec(s.axis, s.workload.replace(**changes)) for s in runs]
    stop, source = stop_tokens(tok, real), source_tokens(tok, real).tolist()
    one_endpoint_run(url, model, RunSpec("warmup", config.warmup), source, tok, stop, arrivals)
    rows = [one_endpoint_run(url, model, spec, source, tok, stop, arrivals)
            for spec in tqdm(runs, desc=f"bench inference --endpoint {url}", disable=not progress, unit="run")]
    return {"benchmark": "inference", "mode": "endpoint", "endpoint": url, "model": model, "server_models": cards,
            "tokenizer": tok_name, "arrivals": arrivals, "preset": preset, "device": "endpoint",
            "sweep": config.describe(), "rows": rows}


def endpoint_name(model: str, preset: str | None) -> str:
    """The result's name: inference_endpoint_MODEL[_PRESET] (the model's served name, made a file name)."""
    return "inference_endpoint_" + re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_") + (f"_{preset}" if preset else "")


def endpoint_csv_rows(result: dict) -> list[dict]:
    """One flat row per run (scalars only)."""
    return [{"endpoint": result["endpoint"], "model": result["model"],
             **{k: v for k, v in r.items() if not isinstance(v, (dict, list))}} for r in result["rows"]]


def print_endpoint(result: dict) -> None:
    from .inference_report import LATENCY

    print(f"\nbench inference --endpoint {result['endpoint']} --model {result['model']} (tokens counted by the "
          f"server's usage; prompts cut with the {result['tokenizer']} tokenizer; {result['arrivals']} arrivals)")
    for axis in AXES:
        rows = [r for r in result["rows"] if r["axis"] == axis]
        if rows:
            print(f"\n{axis}")
            print(format_table(rows, [("workload", "workload", None), ("concurrency", "C", None),
                                      ("prompt_len_lo", "prompt", None),
                                      ("num_requests", "requests", None), ("output_len", "max tokens", None),
                                      *LATENCY, ("failed", "failed", None)]))


def plot_endpoint(result: dict):
    """Output throughput against TPOT over the concurrency axis, and TTFT against prompt length."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = sorted((r for r in result["rows"] if r["axis"] == "concurrency" and r["tpot_median_s"]),
                  key=lambda r: r["concurrency"])
    ax1.plot([1e3 * r["tpot_median_s"] for r in rows], [r["output_throughput"] for r in rows], "o-")
    for r in rows:
        ax1.annotate(f"C={r['concurrency']}", (1e3 * r["tpot_median_s"], r["output_throughput"]),
                     textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax1.set_xlabel("time per output token, median (ms)")
    ax1.set_ylabel("output tokens / s (all users)")
    ax1.set_title("concurrency buys throughput with latency")
    rows = sorted((r for r in result["rows"] if r["axis"] == "prompt_len"), key=lambda r: r["prompt_len_lo"])
    ax2.plot([r["prompt_len_lo"] for r in rows], [1e3 * r["ttft_median_s"] for r in rows], "o-", label="p50")
    ax2.plot([r["prompt_len_lo"] for r in rows], [1e3 * r["ttft_p99_s"] for r in rows], "s--", label="p99")
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("one request at a time: TTFT = prefill + the server's overhead")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench inference --endpoint {result['endpoint']} ({result['model']})")
    fig.tight_layout()
    return fig


# the Benchmark whose table, CSV and plot present an --endpoint result (`bench inference` measures it)
ENDPOINT = Benchmark("inference_endpoint", measure_endpoint, print_endpoint, csv=endpoint_csv_rows,
                     plots={"{name}": plot_endpoint})

__all__ = ["ENDPOINT", "FileTokenizer", "base_url", "endpoint_csv_rows", "endpoint_name", "endpoint_requests",
           "endpoint_runs", "measure_endpoint", "plot_endpoint", "print_endpoint", "resolve_tokenizer"]
