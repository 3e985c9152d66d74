"""`bench inference`: the complete inference benchmark of the lecture's last section.

In process, the serving `Engine` (continuous batching, paged KV cache) serves the three operating
points (interactive chat, offline batch, RL rollouts), then sweeps concurrency, prompt length and
output length, each at every precision; on the chat point also paged vs contiguous KV and
speculative decoding (one request at a time). Per run: vLLM's serving metrics (`serving.metrics`),
each request's queueing / prefill / decode split, peak memory, and quality against fp32. Unlike
`vllm bench serve`, the clock is the engine's (idle gaps between arrivals are skipped) and no HTTP or
detokenization is timed. Runs repeat in interleaved rounds; the median-duration repeat is kept.

`endpoint=URL` sends the same workloads as streamed `/v1/completions` to any OpenAI-compatible server
(ours, vLLM, SGLang, llama.cpp) and times them as its client (`serving/client.py`); precision, KV
layout and speculation are the server's business there, and a client cannot see the time split.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ... import _checks
from ...data.evaluation import compare_on_text
from ...data.real_text import bytes_per_token
from ...device import load_avg
from ...model.checkpoints import available_pretrained, load_pretrained
from ...model.real_models import REAL_MODELS
from ...model.tokenizer import ByteTokenizer, load_tokenizer
from ...quantization.linear import model_nbytes
from ...serving import Engine, benchmark_metrics, flat_metrics, request_metrics, serve_one_at_a_time
from ...serving.client import base_url, count_tokens, serve_over_http, served_models, stream_metrics
from ...serving.request import Request
from ...timing import PeakMemory
from .base import Benchmark, median_repeat
from .inference_report import plot_operating_points, plot_ttft, print_endpoint, print_inference
from .inference_sweep import (DEFAULT_TOKENIZER, ENDPOINT_AXES, GAMMA, NAME, RANGED, SERVERS, SPARSE_RATE, RunSpec,
                              SweepConfig, build_precision, check_arguments, engine_options, precision_order,
                              source_and_stop, sweep_config, workload_row)


def run_benchmark(model: nn.Module, requests: list[Request], concurrency: int, kv_layout: str = "paged",
                  device: torch.device | None = None, server: str = "engine", draft=None) -> tuple[dict, list]:
    """Serve `requests` on `server` ("engine": at most `concurrency` sequences in `kv_layout` memory;
    "one_at_a_time": `serve_one_at_a_time`, speculative with `draft`) and measure the run: vLLM's
    metrics, the queueing/prefill/decode split, KV and weight bytes, peak memory. Returns (one flat
    row, the RequestRecords)."""
    _checks.positive_int("concurrency", concurrency)
    _checks.one_of("server", server, SERVERS)
    if not requests:
        raise ValueError("requests is empty: nothing to serve")
    alone = server == "one_at_a_time"
    if alone and (concurrency != 1 or kv_layout != "contiguous"):
        raise ValueError(f"server 'one_at_a_time' runs one sequence on the model's contiguous cache: concurrency "
                         f"must be 1 and kv_layout 'contiguous', got {concurrency!r} and {kv_layout!r}")
    if draft is not None and not alone:
        raise ValueError("draft (speculative decoding) needs server='one_at_a_time': the engine does not draft")
    with PeakMemory(device if device is not None else model.device) as peak:
        if alone:
            outputs, stats = serve_one_at_a_time(model, requests, draft, GAMMA)
        else:
            result = Engine(model, **engine_options(requests, concurrency, kv_layout)).run(requests)
            outputs = result.outputs
    row = {**flat_metrics(benchmark_metrics(outputs)), **peak.result(), "weight_bytes": model_nbytes(model),
           "communication_s": 0.0, "server": server}   # one rank here; --tensor-parallel-size N measures N ranks
    if alone:
        return row | {f"spec_{k}": v for k, v in stats.items()}, outputs
    s = result.summary()
    return row | {"kv_pool_bytes": result.capacity_tokens * result.bytes_per_token,
                  "kv_peak_reserved_bytes": s["peak_reserved_bytes"], **{k: s[k] for k in (
                      "kv_waste_fraction", "kv_shared_fraction", "max_running", "steps", "preemptions",
                      "cached_prompt_tokens")}}, outputs


def one_run(spec: RunSpec, model, source, tokenizer, stop, device, drafts: dict | None = None) -> dict:
    """Serve one run of the sweep and return its row (with the per-request split on operating points;
    each request's tokens on the speculative axis, to check greedy outputs against plain decoding)."""
    w, draft = spec.workload, (drafts or {}).get(spec.speculative) if spec.speculative != "off" else None
    if spec.speculative != "off" and draft is None:
        raise ValueError(f"speculative mode {spec.speculative!r} has no drafter here "
                         f"(drafters: {sorted(drafts or {})})")
    server = "one_at_a_time" if spec.axis == "speculative" else "engine"
    row, outputs = run_benchmark(model, w.requests(source, tokenizer, stop), w.concurrency, spec.kv_layout, device,
                                 server, draft)
    row = {**workload_row(spec), "kv_layout": spec.kv_layout, "speculative": spec.speculative, **row}
    if spec.axis == "preset":
        row["requests"] = [{"id": m.request_id, "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                            "queueing_s": m.queueing, "prefill_s": m.prefill, "decode_s": m.decode, "ttft_s": m.ttft,
                            "tpot_s": m.tpot, "e2el_s": m.e2el} for m in map(request_metrics, outputs)]
    if spec.axis == "speculative":
        row["output_token_ids"] = [o.tokens for o in outputs]
    return row


def measure(run, model: str = "target", preset: str | None = None, concurrency: int | None = None,
            output_len: int | None = None, progress: bool = True, sweep: SweepConfig | None = None,
            endpoint: str | None = None, tokenizer: str | None = None, arrivals: str | None = None,
            tensor_parallel_size: int | None = None) -> dict:
    """Run the sweep (or one operating point: `preset`, optionally at another `concurrency` /
    `output_len`) on `model` ("target", or "smollm2-135m" when its package is installed); `sweep`:
    another SweepConfig. A `preset` or a custom `sweep` is a partial run (figures/scratch). `endpoint`:
    measure that server instead (`tokenizer` cuts the prompts, `arrivals` poisson or fixed).
    `tensor_parallel_size`: the operating points (fp32, paged) on one device and over that many ranks
    (`parallel.engine`), with the seconds in collectives (inference_tensor_parallel.py)."""
    check_arguments(model, preset, concurrency, output_len)
    changes = {k: v for k, v in (("concurrency", concurrency), ("output_len", output_len)) if v is not None}
    if endpoint is not None and tensor_parallel_size is not None:
        raise ValueError("tensor_parallel_size shards the model in this process's ranks; a server at endpoint "
                         "sets its own (vllm serve --tensor-parallel-size N): give one of endpoint, "
                         "tensor_parallel_size")
    if endpoint is not None:
        run.name, run.committed, run.report = endpoint_name(model, preset), False, ENDPOINT
        return measure_endpoint(endpoint, model, run.quick, preset, changes, tokenizer, arrivals or "poisson",
                                progress)
    _check_in_process(model, sweep, tokenizer, arrivals)
    if tensor_parallel_size is not None:   # the operating points on 1 and on N ranks, communication measured
        from .inference_tensor_parallel import TENSOR_PARALLEL, measure_tensor_parallel

        run.report = TENSOR_PARALLEL
        return measure_tensor_parallel(run, model, tensor_parallel_size, preset, changes, sweep, progress)
    device, real = run.device, model in REAL_MODELS
    config = (sweep or sweep_config(real, run.quick)).with_precisions(precision_order(device))
    if "draft" in (config.speculative if preset is None else ()) and model != "target":
        raise ValueError(f"speculative mode 'draft' needs a draft model of {model!r}; only the shipped target has one "
                         f"(models/draft); use speculative=('off', 'prompt_lookup') for {model!r}")
    runs = [dataclasses.replace(s, workload=s.workload.replace(**changes)) for s in config.runs(only_preset=preset)]
    run.name = (NAME if model == "target" else f"{NAME}_{model.replace('-', '_')}") + (f"_{preset}" if preset else "")
    run.committed = preset is None and sweep is None

    load_before, reference, tok = load_avg(), load_pretrained(model, device=device).eval(), load_tokenizer(model)
    text, stop = source_and_stop(tok, real)
    source, base = text.tolist(), config.precisions[0]
    models = {p: build_precision(reference, p, device) for p in config.precisions}
    quality, quality_tokens = _quality(models, reference, text, config, tok)
    del reference
    drafts = _drafters({s.speculative for s in runs}, base, device)
    _warm_up(models, drafts, config.warmup.requests(source, tok, stop), config.warmup.concurrency, base, device)
    rows = _in_rounds(runs, config.repeats, lambda spec: one_run(spec, models[spec.precision], source, tok, stop,
                                                                  device, drafts),
                      tqdm_desc=f"bench inference ({model})", progress=progress)
    match_plain_greedy(rows)
    return {"benchmark": NAME, "model": model, "device": str(device), "threads": torch.get_num_threads(),
            "load_avg_before": load_before, "load_avg_after": load_avg(), "base_precision": base,
            "precisions": list(config.precisions), "weight_bytes": {p: model_nbytes(m) for p, m in models.items()},
            "quality": quality, "quality_tokens": quality_tokens,
            "speculative": {"modes": list(config.speculative), "gamma": GAMMA, "drafts": sorted(drafts)},
            "sweep": dataclasses.asdict(config), "rows": rows, "preset": preset}


def _in_rounds(runs: list[RunSpec], repeats: int, run_one, tqdm_desc: str, progress: bool) -> list[dict]:
    """Each run `repeats` times in interleaved rounds (every run, then again), and of each its
    median-duration repeat (with the RANGED measures' min and max over the repeats)."""
    done = [[] for _ in runs]
    order = [i for _ in range(repeats) for i in range(len(runs))]
    for i in tqdm(order, desc=tqdm_desc, disable=not progress, unit="run"):
        done[i].append(run_one(runs[i]))
    return [median_repeat(r, "duration_s", RANGED) for r in done]


def _check_in_process(model: str, sweep, tokenizer, arrivals) -> None:
    """Refuse the endpoint benchmark's options, a model we cannot load and a sweep that is no SweepConfig."""
    if tokenizer is not None or arrivals is not None:
        raise ValueError("tokenizer and arrivals are options of the endpoint benchmark: give endpoint too")
    if model != "target" and model not in REAL_MODELS:
        raise ValueError(f"unknown model {model!r} for the in-process benchmark: use 'target' or one of "
                         f"{sorted(REAL_MODELS)} (any served model name works with endpoint=URL)")
    if sweep is not None:
        _checks.instance("sweep", sweep, SweepConfig)


def _quality(models: dict, reference: nn.Module, text: torch.Tensor, config: SweepConfig, tok) -> tuple[dict, int]:
    """Each precision's bits per byte, KL to fp32 and top-1 agreement on held-out windows from the end of
    `text` (prompts come from anywhere), and how many tokens they were measured on."""
    seq_len, count = config.quality_windows
    windows = text[-count * (seq_len + 1):].view(count, seq_len + 1)
    quality = {p: {"bits_per_byte": r["bits_per_byte"], "kl_to_fp32": r["kl_to_reference"],
                   "top1_agreement": r["top1_agreement"], "tokens": r["tokens"]}
               for p, r in compare_on_text(models, reference.float(), windows, bytes_per_token(tok)).items()}
    return quality, int(windows[:, 1:].numel())


def _drafters(modes: set[str], base: str, device: torch.device) -> dict:
    """The drafter of each speculative mode the runs use: prompt lookup by name; the shipped draft model,
    at the target's precision."""
    drafts = {mode: mode for mode in modes & {"prompt_lookup"}}
    if "draft" in modes:
        drafts["draft"] = build_precision(load_pretrained("draft", device=device).eval(), base, device)
    return drafts


def _warm_up(models: dict, drafts: dict, warm: list[Request], concurrency: int, base: str,
             device: torch.device) -> None:
    """Untimed runs: kernel layouts, allocator pools and caches get built here, not in the first timed run."""
    for m in models.values():
        run_benchmark(m, warm, concurrency, "paged", device)
    for draft in [None, *drafts.values()] if drafts else []:
        run_benchmark(models[base], warm[:1], 1, "contiguous", device, "one_at_a_time", draft)


def match_plain_greedy(rows: list[dict]) -> None:
    """On the speculative axis of a greedy workload, the share of requests whose tokens equal plain
    decoding's (speculative greedy decoding is exact: 1.0 up to floating-point ties), then drop the tokens."""
    spec = [r for r in rows if r["axis"] == "speculative"]
    tokens = [r.pop("output_token_ids") for r in spec]
    plain = next((t for r, t in zip(spec, tokens) if r["speculative"] == "off"), None)
    for r, t in zip(spec, tokens):
        if plain is not None and r["workload_spec"]["temperature"] == 0:
            r["same_tokens_as_plain"] = sum(a == b for a, b in zip(t, plain)) / len(t)


# --- against a server ------------------------------------------------------------------------------

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
    """Send one workload's requests as text (at most its concurrency in flight; exactly `output_len`
    tokens unless it stops at the end token) and return its row: output tokens are the server's
    `usage`, our re-count beside it."""
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
    """The sweep's workloads on ENDPOINT_AXES (or one operating point, with `changes` such as
    {"concurrency": 16}) against `endpoint`: rows like the in-process benchmark's, precision "server"."""
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
    runs = {(s.axis, s.workload): s for s in config.runs(only_preset=preset) if s.axis in ENDPOINT_AXES}
    runs = [dataclasses.replace(s, workload=s.workload.replace(**changes)) for s in runs.values()]  # one a workload
    text, stop = source_and_stop(tok, real)
    source = text.tolist()
    one_endpoint_run(url, model, RunSpec("warmup", config.warmup), source, tok, stop, arrivals)
    rows = [one_endpoint_run(url, model, spec, source, tok, stop, arrivals)
            for spec in tqdm(runs, desc=f"bench inference --endpoint {url}", disable=not progress, unit="run")]
    return {"benchmark": "inference", "mode": "endpoint", "endpoint": url, "model": model, "server_models": cards,
            "tokenizer": tok_name, "arrivals": arrivals, "preset": preset, "device": "endpoint",
            "sweep": dataclasses.asdict(config), "rows": rows}


def endpoint_name(model: str, preset: str | None) -> str:
    """The result's name: inference_endpoint_MODEL[_PRESET] (the model's served name, made a file name)."""
    return "inference_endpoint_" + re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_") + (f"_{preset}" if preset else "")


def csv_rows(result: dict) -> list[dict]:
    """One flat row per run (scalars only), each with where it ran."""
    if result.get("mode") == "endpoint":
        where = {"endpoint": result["endpoint"], "model": result["model"]}
    else:
        m = result["machine"]
        where = {"model": result["model"], "device": result["device"], "cpu": m["cpu"],
                 "torch_threads": m["torch_threads"], "torch": m["torch"], "gpu": m.get("gpu"),
                 "load_avg_1m_before": (result["load_avg_before"] or [None])[0]}
    return [{**where, **{k: v for k, v in r.items() if not isinstance(v, (dict, list))}} for r in result["rows"]]


PLOTS = {"{name}_operating_points": plot_operating_points, "{name}_ttft": plot_ttft}
BENCHMARK = bench_inference = Benchmark(
    NAME, measure, print_inference, csv=csv_rows, parallel=lambda options: options.get("model") in REAL_MODELS,
    results=(NAME, f"{NAME}_smollm2_135m"), plots=PLOTS)
# the Benchmark whose table, CSV and plots present an --endpoint result (`bench inference` measures it)
ENDPOINT = Benchmark("inference_endpoint", measure_endpoint, print_endpoint, csv=csv_rows, plots=PLOTS)
