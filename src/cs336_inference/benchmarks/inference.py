"""`bench inference`: the complete inference benchmark the lecture's last section asks for.

For one model on one device it serves request traces with the serving `Engine` (continuous batching,
paged KV cache) and sweeps what an operator chooses: the lecture's three operating points (interactive
chat, offline batch, RL rollouts), then concurrency, prompt length and output length, each at every
precision (fp32, bf16, weight-only int8 and int4), the paged vs contiguous KV cache on the chat point,
and speculative decoding (plain, prompt lookup, the shipped draft model) on the chat point served one
request at a time. Per run it records vLLM's serving metrics (`serving.metrics`: TTFT, ITL pooled over
every request's gaps, TPOT, E2E, throughput), each request's queueing / prefill / decode split
(communication is 0: one device), peak memory, and quality against fp32 (bits per byte of held-out
text, KL per token).

Where ours differ from `vllm bench serve`: the clock is the engine's (measured compute time per step;
idle gaps between arrivals are skipped, not slept through), there is no HTTP, network or
detokenization in any latency, and a request asking for n > 1 samples is timed from its first token of
any sample to its last. Each run is repeated `repeats` times in interleaved rounds and the
median-duration repeat is kept (min and max of the main metrics beside it).
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .. import _checks
from ..device import default_dtype
from ..model.checkpoints import load_pretrained
from ..model.real_models import REAL_MODELS
from ..model.tokenizer import load_tokenizer
from ..quantization.linear import model_nbytes
from ..serving.metrics import request_metrics
from .base import Benchmark, load_avg
from .inference_config import PRECISIONS, RunSpec, SweepConfig, check_arguments, sweep_config
from .inference_endpoint import ENDPOINT, endpoint_name, measure_endpoint
from .inference_report import plot_operating_points, plot_ttft, print_inference
from .inference_runs import (GAMMA, build_precision, make_requests, quality_vs_reference, quality_windows,
                             run_benchmark, source_tokens, stop_tokens)

NAME = "inference"
RANGED = ("output_throughput", "ttft_median_s", "tpot_median_s", "itl_median_s", "e2el_median_s")


def precision_order(device: torch.device) -> tuple[str, ...]:
    """Every precision, the device's full-precision default first (fp32 on a CPU, bf16 on a GPU): the
    base for the KV-layout comparison and for the plots' ordering."""
    base = "bf16" if default_dtype(device) == torch.bfloat16 else "fp32"
    return (base,) + tuple(p for p in PRECISIONS if p != base)


def measure(run, model: str = "target", preset: str | None = None, concurrency: int | None = None,
            output_len: int | None = None, progress: bool = True, sweep: SweepConfig | None = None,
            endpoint: str | None = None, tokenizer: str | None = None, arrivals: str | None = None) -> dict:
    """Run the sweep (or one operating point: `preset`, optionally at another `concurrency` /
    `output_len`) on `model` ("target", or "smollm2-135m" when its package is installed). Results:
    figures/inference[_MODEL].json / .csv / _operating_points.png / _ttft.png. `sweep`: another
    SweepConfig than the model's. A `preset` or a custom `sweep` is a partial run (figures/scratch).
    `endpoint`: measure the OpenAI-compatible server at that URL instead, as its streaming client
    (`inference_endpoint`; `tokenizer` cuts the prompts and re-counts, `arrivals` poisson or fixed):
    figures/scratch/inference_endpoint_MODEL.*."""
    check_arguments(model, preset, concurrency, output_len)
    if endpoint is not None:
        run.name, run.committed, run.report = endpoint_name(model, preset), False, ENDPOINT
        return measure_endpoint(endpoint, model, run.quick, preset, concurrency, output_len, tokenizer,
                                arrivals or "poisson", progress)
    if tokenizer is not None or arrivals is not None:
        raise ValueError("tokenizer and arrivals are options of the endpoint benchmark: give endpoint too")
    if sweep is not None:
        _checks.instance("sweep", sweep, SweepConfig)
    device, real = run.device, model in REAL_MODELS
    config = (sweep or sweep_config(real, run.quick)).with_precisions(precision_order(device))
    if "draft" in (config.speculative if preset is None else ()) and model != "target":
        raise ValueError(f"speculative mode 'draft' needs a draft model of {model!r}; only the shipped target has one "
                         f"(models/draft); use speculative=('off', 'prompt_lookup') for {model!r}")
    runs = config.runs(only_preset=preset)
    changes = {k: v for k, v in (("concurrency", concurrency), ("output_len", output_len)) if v is not None}
    runs = [RunSpec(s.axis, s.workload.replace(**changes), s.precision, s.kv_layout, s.speculative) for s in runs]
    run.name = (NAME if model == "target" else f"{NAME}_{model.replace('-', '_')}") + (f"_{preset}" if preset else "")
    run.committed = preset is None and sweep is None
    return {**_sweep(model, real, device, config, runs, progress), "preset": preset}


def _sweep(model: str, real: bool, device: torch.device, config: SweepConfig, runs: list[RunSpec],
           progress: bool) -> dict:
    """Load the model, build every precision, measure quality, warm up, then serve every run
    `config.repeats` times in interleaved rounds."""
    load_before = load_avg()
    reference = load_pretrained(model, device=device).eval()
    tokenizer = load_tokenizer(model)
    text, stop = source_tokens(tokenizer, real), stop_tokens(tokenizer, real)
    source, base = text.tolist(), config.precisions[0]
    models = {p: build_precision(reference, p, device) for p in config.precisions}
    windows = quality_windows(text, *config.quality_windows)
    quality = quality_vs_reference(models, reference.float(), windows, tokenizer)
    del reference
    modes = {s.speculative for s in runs}
    drafts = {mode: mode for mode in modes & {"prompt_lookup"}}
    if "draft" in modes:   # the shipped draft model, at the target's precision
        drafts["draft"] = build_precision(load_pretrained("draft", device=device).eval(), base, device)
    # untimed: kernel layouts, allocator pools and caches get built here, not in the first timed run
    warm = make_requests(config.warmup, source, tokenizer, stop)
    for m in models.values():
        run_benchmark(m, warm, config.warmup.concurrency, "paged", device)
    for draft in [None, *drafts.values()] if drafts else []:
        run_benchmark(models[base], warm[:1], 1, "contiguous", device, "one_at_a_time", draft)
    repeats = [[] for _ in runs]
    order = [i for _ in range(config.repeats) for i in range(len(runs))]   # rounds: every run, then again
    for i in tqdm(order, desc=f"bench inference ({model})", disable=not progress, unit="run"):
        repeats[i].append(one_run(runs[i], models[runs[i].precision], source, tokenizer, stop, device, drafts))
    rows = [median_run(r) for r in repeats]
    match_plain_greedy(rows)
    return {"benchmark": NAME, "model": model, "device": str(device), "threads": torch.get_num_threads(),
            "load_avg_before": load_before, "load_avg_after": load_avg(), "base_precision": base,
            "precisions": list(config.precisions), "weight_bytes": {p: model_nbytes(m) for p, m in models.items()},
            "quality": quality, "quality_tokens": int(windows[:, 1:].numel()),
            "speculative": {"modes": list(config.speculative), "gamma": GAMMA, "drafts": sorted(drafts)},
            "sweep": config.describe(), "rows": rows}


def one_run(spec: RunSpec, model, source, tokenizer, stop, device, drafts: dict | None = None) -> dict:
    """Serve one run of the sweep and return its row (and the per-request split for operating points;
    each request's output tokens on the speculative axis, to check greedy outputs against plain decoding)."""
    w = spec.workload
    draft = (drafts or {}).get(spec.speculative) if spec.speculative != "off" else None
    if spec.speculative != "off" and draft is None:
        raise ValueError(f"speculative mode {spec.speculative!r} has no drafter here "
                         f"(drafters: {sorted(drafts or {})})")
    server = "one_at_a_time" if spec.axis == "speculative" else "engine"
    row, outputs = run_benchmark(model, make_requests(w, source, tokenizer, stop), w.concurrency, spec.kv_layout,
                                 device, server, draft)
    row = {"axis": spec.axis, "workload": w.name, "precision": spec.precision, "kv_layout": spec.kv_layout,
           "speculative": spec.speculative, "concurrency": w.concurrency, "prompt_len_lo": w.prompt_len[0],
           "prompt_len_hi": w.prompt_len[1], "output_len": w.output_len, "num_requests": w.num_requests,
           "samples": w.samples, "workload_spec": w.describe(), **row}
    if spec.axis == "preset":
        row["requests"] = [{"id": m.request_id, "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                            "queueing_s": m.queueing, "prefill_s": m.prefill, "decode_s": m.decode, "ttft_s": m.ttft,
                            "tpot_s": m.tpot, "e2el_s": m.e2el} for m in map(request_metrics, outputs)]
    if spec.axis == "speculative":
        row["output_token_ids"] = [o.tokens for o in outputs]
    return row


def median_run(rows: list[dict]) -> dict:
    """The repeat with the median duration (the lower middle of an even count), so every number of a row
    comes from one run and stays consistent; with the min and max of the main metrics over repeats."""
    out = {**sorted(rows, key=lambda r: r["duration_s"])[(len(rows) - 1) // 2], "repeats": len(rows)}
    for key in RANGED:
        values = [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]
        out[f"{key}_min"], out[f"{key}_max"] = (min(values), max(values)) if values else (None, None)
    return out


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

__all__ = ["bench_inference", "check_arguments", "csv_rows", "one_run", "precision_order"]
