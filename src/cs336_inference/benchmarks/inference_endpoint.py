"""`bench inference --endpoint URL --model NAME`: the inference sweep, measured as a client of a server.

The same workloads as the in-process benchmark (`inference_config`: the three operating points, then
the concurrency, prompt-length and output-length axes), sent as streamed `/v1/completions` requests
to any OpenAI-compatible server: ours (`python -m cs336_inference serve`), vLLM, SGLang or
llama.cpp's server. Each request is timed on this side (`serving/client.py`, vLLM's definitions:
TTFT, TPOT, ITL, E2E, throughput). Precision, KV layout and speculative decoding are the server's
business, so those axes are absent, and so is the queueing/prefill/decode split (a client cannot
see it).

Prompts are cut from held-out text with a tokenizer (ours by default, `tokenizer=` for another) and
sent as text (`Workload.text_requests`); answers get exactly `output_len` tokens (`ignore_eos`)
unless the workload stops at the model's end token. Output tokens are the server's `usage` count,
with our re-count beside it. Arrivals follow the workload's rate (Poisson, or `arrivals="fixed"`:
evenly spaced); the one-request-at-a-time axis sends them back to back; at most `concurrency` are in
flight.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from tqdm.auto import tqdm

from .. import _checks
from ..model.checkpoints import available_pretrained
from ..model.real_models import REAL_MODELS
from ..model.tokenizer import ByteTokenizer, load_tokenizer
from ..serving.client import base_url, count_tokens, serve_over_http, served_models, stream_metrics
from ..serving.metrics import flat_metrics
from .base import Benchmark
from .inference_config import (SPARSE_RATE, RunSpec, check_arguments, source_tokens, stop_tokens, sweep_config,
                               workload_row)
from .inference_report import plot_operating_points, plot_ttft, print_endpoint

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


def one_endpoint_run(url: str, model: str, spec: RunSpec, source, tokenizer, stop, arrivals: str) -> dict:
    """Send one workload's requests (at most its concurrency in flight) and return its row."""
    w = spec.workload
    sequential = w.rate == SPARSE_RATE          # one request at a time: sent back to back, not hours apart
    requests = w.text_requests(source, tokenizer, stop, arrivals, rate=math.inf if sequential else None)
    concurrency = 1 if sequential else w.concurrency
    results, duration = serve_over_http(url, model, requests, concurrency)
    failed = [r.error for r in results if not r.ok]
    if len(failed) == len(results):
        raise RuntimeError(f"every request of {w.name!r} failed, e.g. {failed[0]}")
    count_tokens(results, requests, tokenizer)
    per_request = [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                    "counted_prompt_tokens": r.counted_prompt_tokens,
                    "counted_output_tokens": r.counted_output_tokens, "usage_reported": r.usage is not None,
                    "ttft_s": r.ttft if r.ok else None, "e2el_s": r.e2el if r.ok else None,
                    "tpot_s": r.tpot if r.ok else None, "error": r.error} for r in results]
    return {**workload_row(spec), "precision": "server", "concurrency": concurrency, "arrivals": arrivals,
            **flat_metrics(stream_metrics(results, duration)), "requests": per_request}


def measure_endpoint(endpoint: str, model: str, quick: bool = False, preset: str | None = None,
                     changes: dict | None = None, tokenizer: str | None = None, arrivals: str = "poisson",
                     progress: bool = True) -> dict:
    """Run the sweep's workloads on AXES (or one operating point, with `changes` such as
    {"concurrency": 16}) against `endpoint`; the result dict (rows like the in-process benchmark's,
    precision "server")."""
    changes = changes or {}
    check_arguments(model, preset, changes.get("concurrency"), changes.get("output_len"))
    _checks.one_of("arrivals", arrivals, ("poisson", "fixed"))
    url = base_url(endpoint)
    cards = served_models(url)
    if model not in [c.get("id") for c in cards]:
        raise ValueError(f"{url} does not serve {model!r}; it serves {[c.get('id') for c in cards]}")
    tok, tok_name = resolve_tokenizer(model, tokenizer)
    real = not isinstance(tok, ByteTokenizer)
    config = sweep_config(real, quick)
    runs = {(s.axis, s.workload): s for s in config.runs(only_preset=preset) if s.axis in AXES}  # one per workload
    runs = [dataclasses.replace(s, workload=s.workload.replace(**changes)) for s in runs.values()]
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


# the Benchmark whose table, CSV and plots present an --endpoint result (`bench inference` measures it)
ENDPOINT = Benchmark("inference_endpoint", measure_endpoint, print_endpoint, csv=endpoint_csv_rows,
                     plots={"{name}_operating_points": plot_operating_points, "{name}_ttft": plot_ttft})

__all__ = ["ENDPOINT", "FileTokenizer", "endpoint_csv_rows", "endpoint_name", "measure_endpoint",
           "resolve_tokenizer"]
