"""`bench inference`: the complete inference benchmark the lecture's last section asks for.

For one model on one device it serves request traces with the serving `Engine` (continuous batching,
paged KV cache) and sweeps what an operator chooses: the lecture's three operating points (interactive
chat, offline batch, RL rollouts), then concurrency, prompt length and output length, each at every
precision (fp32, bf16, weight-only int8 and int4), the paged vs contiguous KV cache on the chat point,
and speculative decoding (plain, prompt lookup, the shipped draft model) on the chat point served one
request at a time (`serving.serve_one_at_a_time`). Per run it records vLLM's serving metrics
(`serving.metrics`: TTFT, ITL pooled over every request's gaps, TPOT, E2E, throughput), each request's
queueing / prefill / decode split (communication is 0: one device), peak memory, and quality against
fp32 (bits per byte of held-out text, KL per token).

Where ours differ from `vllm bench serve`: the clock is the engine's (measured compute time per step;
idle gaps between arrivals are skipped, not slept through), there is no HTTP, network or
detokenization in any latency, and a request asking for n > 1 samples is timed from its first token of
any sample to its last. Each run is repeated `repeats` times in interleaved rounds and the
median-duration repeat is kept (min and max of the main metrics beside it). `endpoint=URL` measures
an OpenAI-compatible server instead, as its client (`inference_endpoint`).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from .. import _checks
from ..cpu_tuning import tune_for_cpu
from ..data.evaluation import compare_on_text
from ..data.real_text import bytes_per_token
from ..device import default_dtype
from ..model.checkpoints import load_pretrained
from ..model.real_models import REAL_MODELS
from ..model.tokenizer import load_tokenizer
from ..quantization.linear import model_nbytes
from ..quantization.model import quantize_model
from ..serving import Engine, benchmark_metrics, flat_metrics, request_metrics, serve_one_at_a_time
from ..serving.request import Request
from ..device import load_avg
from ..timing import PeakMemory
from .base import Benchmark, median_repeat
from .inference_config import (PRECISIONS, RunSpec, SweepConfig, check_arguments, source_tokens, stop_tokens,
                               sweep_config, workload_row)
from .inference_endpoint import ENDPOINT, endpoint_name, measure_endpoint
from .inference_report import plot_operating_points, plot_ttft, print_inference

NAME = "inference"
RANGED = ("output_throughput", "ttft_median_s", "tpot_median_s", "itl_median_s", "e2el_median_s")
BLOCK_SIZE = 16
GAMMA = 4      # drafts per target pass: near the best `bench speculative` measures on both models
SERVERS = ("engine", "one_at_a_time")


def precision_order(device: torch.device) -> tuple[str, ...]:
    """Every precision, the device's full-precision default first (fp32 on a CPU, bf16 on a GPU): the
    base for the KV-layout comparison and for the plots' ordering."""
    base = "bf16" if default_dtype(device) == torch.bfloat16 else "fp32"
    return (base,) + tuple(p for p in PRECISIONS if p != base)


def build_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """A copy of `model` (fp32) that runs at `precision`, with fused projections and torch's fused
    attention: fp32 / bf16 weights, or weight-only int8 (per channel) / int4 (groups) with torch's
    packed kernels, quantized from the device's default dtype (fp32 on a CPU, bf16 on a GPU)."""
    _checks.one_of("precision", precision, PRECISIONS)
    fast = tune_for_cpu(copy.deepcopy(model).to(device).fuse_projections().set_attention_kernel("sdpa").eval())
    if precision in ("fp32", "bf16"):
        return fast.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    fast = fast.to(default_dtype(device))
    if precision == "int8":
        return quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True, kernel="packed")
    c = fast.config   # the largest int4 kernel group dividing every quantized layer's input dimension
    group = next(g for g in (128, 64, 32) if c.d_model % g == 0 and c.d_ff % g == 0)
    return quantize_model(fast, "rtn", bits=4, group_size=group, kernel="packed")


def run_benchmark(model: nn.Module, requests: list[Request], concurrency: int, kv_layout: str = "paged",
                  device: torch.device | None = None, server: str = "engine", draft=None) -> tuple[dict, list]:
    """Serve `requests` on `server` ("engine": at most `concurrency` sequences in `kv_layout` memory;
    "one_at_a_time": `serve_one_at_a_time`, speculative with `draft`) and measure the run: vLLM's
    metrics, the queueing/prefill/decode split, KV and weight bytes, the peak memory. Returns (one flat
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
            longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
            result = Engine(model, kv_layout=kv_layout, block_size=BLOCK_SIZE, max_num_seqs=concurrency,
                            num_blocks=concurrency * math.ceil(longest / BLOCK_SIZE) + 1, watermark_blocks=0
                            ).run(requests)
            outputs = result.outputs
    row = {**flat_metrics(benchmark_metrics(outputs)), **peak.result(), "weight_bytes": model_nbytes(model),
           "communication_s": 0.0, "server": server}   # one device: no multi-device path in this package
    if alone:
        return row | {f"spec_{k}": v for k, v in stats.items()}, outputs
    s = result.summary()
    return row | {"kv_pool_bytes": result.capacity_tokens * result.bytes_per_token,
                  "kv_peak_reserved_bytes": s["peak_reserved_bytes"], **{k: s[k] for k in (
                      "kv_waste_fraction", "kv_shared_fraction", "max_running", "steps", "preemptions",
                      "cached_prompt_tokens")}}, outputs


def one_run(spec: RunSpec, model, source, tokenizer, stop, device, drafts: dict | None = None) -> dict:
    """Serve one run of the sweep and return its row (and the per-request split for operating points;
    each request's output tokens on the speculative axis, to check greedy outputs against plain decoding)."""
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
            endpoint: str | None = None, tokenizer: str | None = None, arrivals: str | None = None) -> dict:
    """Run the sweep (or one operating point: `preset`, optionally at another `concurrency` /
    `output_len`) on `model` ("target", or "smollm2-135m" when its package is installed). Results:
    figures/inference[_MODEL].json / .csv / _operating_points.png / _ttft.png. `sweep`: another
    SweepConfig than the model's. A `preset` or a custom `sweep` is a partial run (figures/scratch).
    `endpoint`: measure the OpenAI-compatible server at that URL instead, as its streaming client
    (`inference_endpoint`; `tokenizer` cuts the prompts and re-counts, `arrivals` poisson or fixed):
    figures/scratch/inference_endpoint_MODEL.*. Each precision is built and its quality measured,
    everything is warmed up, then every run is served `repeats` times in interleaved rounds."""
    check_arguments(model, preset, concurrency, output_len)
    changes = {k: v for k, v in (("concurrency", concurrency), ("output_len", output_len)) if v is not None}
    if endpoint is not None:
        run.name, run.committed, run.report = endpoint_name(model, preset), False, ENDPOINT
        return measure_endpoint(endpoint, model, run.quick, preset, changes, tokenizer, arrivals or "poisson",
                                progress)
    if tokenizer is not None or arrivals is not None:
        raise ValueError("tokenizer and arrivals are options of the endpoint benchmark: give endpoint too")
    if model != "target" and model not in REAL_MODELS:
        raise ValueError(f"unknown model {model!r} for the in-process benchmark: use 'target' or one of "
                         f"{sorted(REAL_MODELS)} (any served model name works with endpoint=URL)")
    if sweep is not None:
        _checks.instance("sweep", sweep, SweepConfig)
    device, real = run.device, model in REAL_MODELS
    config = (sweep or sweep_config(real, run.quick)).with_precisions(precision_order(device))
    if "draft" in (config.speculative if preset is None else ()) and model != "target":
        raise ValueError(f"speculative mode 'draft' needs a draft model of {model!r}; only the shipped target has one "
                         f"(models/draft); use speculative=('off', 'prompt_lookup') for {model!r}")
    runs = [dataclasses.replace(s, workload=s.workload.replace(**changes)) for s in config.runs(only_preset=preset)]
    run.name = (NAME if model == "target" else f"{NAME}_{model.replace('-', '_')}") + (f"_{preset}" if preset else "")
    run.committed = preset is None and sweep is None

    load_before, reference, tok = load_avg(), load_pretrained(model, device=device).eval(), load_tokenizer(model)
    text, stop = source_tokens(tok, real), stop_tokens(tok, real)
    source, base = text.tolist(), config.precisions[0]
    models = {p: build_precision(reference, p, device) for p in config.precisions}
    seq_len, count = config.quality_windows   # held-out windows from the end (prompts come from anywhere)
    windows = text[-count * (seq_len + 1):].view(count, seq_len + 1)
    quality = {p: {"bits_per_byte": r["bits_per_byte"], "kl_to_fp32": r["kl_to_reference"],
                   "top1_agreement": r["top1_agreement"], "tokens": r["tokens"]}
               for p, r in compare_on_text(models, reference.float(), windows, bytes_per_token(tok)).items()}
    del reference
    modes = {s.speculative for s in runs}
    drafts = {mode: mode for mode in modes & {"prompt_lookup"}}
    if "draft" in modes:   # the shipped draft model, at the target's precision
        drafts["draft"] = build_precision(load_pretrained("draft", device=device).eval(), base, device)
    # untimed: kernel layouts, allocator pools and caches get built here, not in the first timed run
    warm = config.warmup.requests(source, tok, stop)
    for m in models.values():
        run_benchmark(m, warm, config.warmup.concurrency, "paged", device)
    for draft in [None, *drafts.values()] if drafts else []:
        run_benchmark(models[base], warm[:1], 1, "contiguous", device, "one_at_a_time", draft)
    repeats = [[] for _ in runs]
    order = [i for _ in range(config.repeats) for i in range(len(runs))]   # rounds: every run, then again
    for i in tqdm(order, desc=f"bench inference ({model})", disable=not progress, unit="run"):
        repeats[i].append(one_run(runs[i], models[runs[i].precision], source, tok, stop, device, drafts))
    rows = [median_repeat(r, "duration_s", RANGED) for r in repeats]
    match_plain_greedy(rows)
    return {"benchmark": NAME, "model": model, "device": str(device), "threads": torch.get_num_threads(),
            "load_avg_before": load_before, "load_avg_after": load_avg(), "base_precision": base,
            "precisions": list(config.precisions), "weight_bytes": {p: model_nbytes(m) for p, m in models.items()},
            "quality": quality, "quality_tokens": int(windows[:, 1:].numel()),
            "speculative": {"modes": list(config.speculative), "gamma": GAMMA, "drafts": sorted(drafts)},
            "sweep": config.describe(), "rows": rows, "preset": preset}


def match_plain_greedy(rows: list[dict]) -> None:
    """On the speculative axis of a greedy workload, the share of requests whose tokens equal plain
    decoding's (speculative greedy decoding is exact: 1.0 up to floating-point ties), then drop the tokens."""
    spec = [r for r in rows if r["axis"] == "speculative"]
    tokens = [r.pop("output_token_ids") for r in spec]
    plain = next((t for r, t in zip(spec, tokens) if r["speculative"] == "off"), None)
    for r, t in zip(spec, tokens):
        if plain is not None and r["workload_spec"]["temperature"] == 0:
            r["same_tokens_as_plain"] = sum(a == b for a, b in zip(t, plain)) / len(t)


def csv_rows(result: dict) -> list[dict]:
    """One flat row per run (scalars only), each with the machine it ran on."""
    m = result["machine"]
    machine = {"model": result["model"], "device": result["device"], "cpu": m["cpu"],
               "torch_threads": m["torch_threads"], "torch": m["torch"], "gpu": m.get("gpu"),
               "load_avg_1m_before": (result["load_avg_before"] or [None])[0]}
    return [{**machine, **{k: v for k, v in r.items() if not isinstance(v, (dict, list))}} for r in result["rows"]]


BENCHMARK = bench_inference = Benchmark(
    NAME, measure, print_inference, csv=csv_rows, parallel=lambda options: options.get("model") in REAL_MODELS,
    results=(NAME, f"{NAME}_smollm2_135m"),
    plots={"{name}_operating_points": plot_operating_points, "{name}_ttft": plot_ttft})

__all__ = ["bench_inference", "build_precision", "csv_rows", "one_run", "precision_order", "run_benchmark"]
