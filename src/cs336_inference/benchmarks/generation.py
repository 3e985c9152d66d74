"""`bench generation`: how fast the model generates, and why.

A ~90M-parameter model (or, with `--model smollm2-135m`, the real one) whose fp32 weights dwarf the
CPU caches, so batch-1 decode streams every weight each step: time ~ weight bytes / bandwidth. Fewer
bytes (bf16, int8, int4) should mean faster decode, *if* the kernels read the small bytes directly
(`QuantizedLinear`'s packed kernels). Timed side by side in alternating rounds (medians, min/max):
fp32 / bf16 / int8 / int4 at batch 1 and 8 with our decode options (fused projections, SDPA), eager
and compiled; "fp32 plain", the readable path; Hugging Face's Llama on the same weights (the `[peer]`
extra; its greedy tokens must equal ours); weight bytes per step / time against the bandwidth
measured in the same run; KL(fp32 || variant), so speed is never quoted without its cost; batch-1
fp32 again while another process holds a core; prefill tokens/s; naive vs cached generation.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from functools import partial

import torch
import torch.nn as nn

from ..accounting.model_roofline import decode_step_fn, prefill_tokens_per_second, weight_bytes_per_step
from ..accounting.roofline import measure_memory_bandwidth
from .._openmp import spin_count, wait_policy
from ..cpu_tuning import decode_threads, describe, few_row_split, tune_for_cpu
from ..data.evaluation import decode_kl_to_reference
from ..data.real_text import eval_text_tokens
from ..device import bf16_matmul_unit
from ..generation.compiled import compile_decode
from ..generation.generate import generate
from ..model.checkpoints import load_pretrained
from ..model.config import ModelConfig
from ..model.transformer import TransformerLM
from ..quantization.model import quantize_model
from ..timing import busy_cpu, load_average, median_seconds
from ..model import hf_peer as peer
from .base import Benchmark, alternate
from .generation_report import plot_generation, print_generation

PRECISIONS = ("fp32", "bf16", "int8", "int4")
COMPILED = ("fp32", "bf16", "int4")   # also timed through `compile_decode`


def _group_size(config: ModelConfig, wanted: int = 128) -> int:
    """The largest of 128/64/32 (int4 kernel groups) dividing d_model and d_ff."""
    return next(g for g in (wanted, 64, 32) if config.d_model % g == 0 and config.d_ff % g == 0)


def build_variants(model: TransformerLM) -> tuple[dict[str, nn.Module], dict[str, contextlib.AbstractContextManager]]:
    """Every model the benchmark times (a deep copy each) and the context each must run in. All but
    "fp32 plain" (the plain model) opt in to the CPU decode speed-ups (`cpu_tuning.tune_for_cpu`)."""
    fast = tune_for_cpu(copy.deepcopy(model).fuse_projections().set_attention_kernel("sdpa"))
    g = _group_size(model.config)
    models = {
        "fp32 plain": model,
        "fp32": fast,
        "fp32 F.linear": fast,   # the same model with the few-row split off: what the split itself gains
        "bf16": copy.deepcopy(fast).to(torch.bfloat16),
        "int8": quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True, quantize_lm_head=True),
        "int4": quantize_model(fast, "rtn", bits=4, group_size=g, quantize_lm_head=True),
    }
    return models, SPLIT_OFF


SPLIT_OFF = {"fp32 plain": lambda: few_row_split(False), "fp32 F.linear": lambda: few_row_split(False)}


def _time_rounds(fns: dict, contexts: dict, device, rounds: int, steps: int) -> dict[str, list[float]]:
    """Alternate: each round times every function once (median of `steps` calls), in the same order."""
    def timed(name, make):
        with contexts.get(name.rsplit(" B=", 1)[0], contextlib.nullcontext)():
            return median_seconds(make(), device, steps, warmup=2)
    return alternate({name: partial(timed, name, make) for name, make in fns.items()}, rounds)


def measure(run, model: str | None = None, preset: str = "bench-90m") -> dict:
    """model: None times a random-init `preset` model; "smollm2-135m" the real pretrained model instead
    (results in figures/generation_smollm2_135m.*; greedy check and KL on real text)."""
    device, quick = run.device, run.quick
    if model is None:
        config = ModelConfig.from_name(preset)
        if quick:
            config = config.replace(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=768)
        model = TransformerLM(config, device=device).eval()   # fp32: the variants derive from it
    else:
        from ..model.real_models import real_model_missing

        missing = real_model_missing(model)
        if missing:
            raise ValueError(f"bench generation --model {model}: {missing}")
        run.name, preset = f"generation_{model.replace('-', '_')}", model
        model = load_pretrained(model, device=device, dtype=torch.float32).eval()
        config = model.config
    rounds, steps, batches = (1, 4, (1, 8)) if quick else (5, 12, (1, 8))
    result = {"device": str(device), "preset": preset if not quick else f"{preset} (quick: smaller)",
              "threads": torch.get_num_threads(), "omp_wait_policy": wait_policy(),
              "gomp_spincount": spin_count(),
              "parameters": model.num_parameters(), "cpu_bf16_matmul": bf16_matmul_unit(device),
              "load_average_start": load_average()}

    models, contexts = build_variants(model)
    compiled_variants = COMPILED
    if run.name != "generation":   # a real model: its published GGUF blocks too, with no re-quantization
        exact = load_pretrained(preset, device=device, weights="gguf-exact").set_attention_kernel("sdpa")
        models["int4 exact"], compiled_variants = tune_for_cpu(exact), COMPILED + ("int4 exact",)
        result["int4_exact"] = exact.describe()
    result["cpu_tuning"] = describe(models["fp32"])
    print(f"{result['cpu_tuning']} (every variant but fp32 plain)")
    hf = None
    if peer.transformers_available():
        hf = peer.hf_llama_from(model)
    else:
        print(f"peer row skipped: transformers is not installed ({peer.INSTALL_HINT})")
    result["peer"] = "transformers " + __import__("transformers").__version__ if hf is not None else None

    # Same greedy tokens: our readable path, our fast path and the peer, from the same prompt.
    # Tokens for the greedy check and the KL: random ids for a random-init model, real text for a real one.
    width = 64 if not quick else 32
    real = run.name != "generation"
    text = eval_text_tokens(preset, 4 * width) if real else torch.randint(0, config.vocab_size, (4 * width,))
    prompt = text[None, :16].to(device)
    n_check = 16 if quick else 32
    greedy = {name: generate(models[name], prompt.tolist(), n_check).tokens for name in ("fp32 plain", "fp32")}
    result["greedy_fast_equals_plain"] = greedy["fp32"] == greedy["fp32 plain"]
    if hf is not None:
        result["greedy_equals_peer"] = greedy["fp32"] == peer.hf_greedy(hf, prompt, n_check)

    ids = text.view(4, width).to(device)
    quality = {name: decode_kl_to_reference(m, model, ids) for name, m in models.items()}
    quality |= {f"{name} compiled": quality[name] for name in compiled_variants}   # same graph, same numbers

    fns = {f"{name} B={B}": (lambda m=m, B=B: decode_step_fn(m, B, 32, steps + 4))
           for name, m in models.items() for B in batches}
    # torch.compile'd decode steps (one graph for all positions and batch sizes; compiled once here)
    result["compile_seconds"] = {}
    for name in compiled_variants if not quick else ():   # a smoke run skips the minutes of compiling
        t0 = time.perf_counter()
        compiled = compile_decode(models[name])

        def decode(m, token, cache, compiled=compiled):
            with decode_threads():   # the tuned model's thread switch, outside the compiled graph
                return compiled(token, cache)
        decode_step_fn(models[name], 1, 32, 8, decode)()                            # compiles
        result["compile_seconds"][name] = time.perf_counter() - t0
        models[f"{name} compiled"] = models[name]
        fns |= {f"{name} compiled B={B}": (lambda m=models[name], B=B, d=decode: decode_step_fn(m, B, 32, steps + 4, d))
                for B in batches}
    if hf is not None:
        fns |= {f"HF fp32 B={B}": (lambda B=B: peer.hf_decode_step_fn(hf, B, 32)) for B in batches}
    bandwidths = [measure_memory_bandwidth(device, repeats=5)]
    times = _time_rounds(fns, contexts, device, rounds, steps)
    bandwidths.append(measure_memory_bandwidth(device, repeats=5))
    result["measured_bandwidth_GBps"] = statistics.median(bandwidths) / 1e9
    result["load_average_decode"] = load_average()

    rows = []
    for name, ts in times.items():
        variant, B = name.rsplit(" B=", 1)
        m = models.get(variant, model)
        seconds = statistics.median(ts)
        row = dict(variant=variant, batch=int(B), ms_per_step=seconds * 1e3, ms_min=min(ts) * 1e3,
                   ms_max=max(ts) * 1e3, tok_per_s=int(B) / seconds, weight_bytes_per_step=weight_bytes_per_step(m))
        row["GBps"] = row["weight_bytes_per_step"] / seconds / 1e9
        row["fraction_of_bandwidth"] = row["GBps"] / result["measured_bandwidth_GBps"]
        row["kl_to_fp32"], row["top1_agreement"] = quality.get(variant, (None, None))
        rows.append(row)
    for row in rows:
        same_b = {r["variant"]: r["ms_per_step"] for r in rows if r["batch"] == row["batch"]}
        row["speedup_vs_fp32"] = same_b["fp32"] / row["ms_per_step"]
        if "HF fp32" in same_b:
            row["speedup_vs_hf_fp32"] = same_b["HF fp32"] / row["ms_per_step"]
    result["rows"] = rows

    compiled_fp32 = fns.get("fp32 compiled B=1")
    result["busy"] = _busy_section(models["fp32"], models["fp32 plain"], hf, device, rounds, steps, compiled_fp32)
    result["goals"] = goals(result)

    for prompt_len in (32, 512) if not quick else (32,):
        result[f"prefill_tok_per_s_prompt{prompt_len}"] = prefill_tokens_per_second(models["fp32"], prompt_len)
    new_tokens = 32 if quick else 128
    prompt_list = torch.randint(0, config.vocab_size, (1, 32)).tolist()
    cached = generate(models["fp32"], prompt_list, new_tokens, use_cache=True)
    naive = generate(models["fp32"], prompt_list, new_tokens, use_cache=False)
    assert cached.tokens == naive.tokens, "cached and naive greedy generation disagree"
    result |= dict(new_tokens=new_tokens, cached_generation_s=cached.total_time, naive_generation_s=naive.total_time,
                   naive_over_cached=naive.total_time / cached.total_time, load_average_end=load_average())

    return result


def _busy_section(fast, plain, hf, device, rounds: int, steps: int, compiled=None) -> dict:
    """Batch-1 fp32 decode while one busy loop holds a core: ours (fast, plain F.linear and, if given,
    the compiled step's maker), the peer."""
    fns = {"fp32 B=1": lambda: decode_step_fn(fast, 1, 32, steps + 4),
           "fp32 F.linear B=1": lambda: decode_step_fn(fast, 1, 32, steps + 4),
           "fp32 plain B=1": lambda: decode_step_fn(plain, 1, 32, steps + 4)}
    if compiled is not None:
        fns["fp32 compiled B=1"] = compiled
    if hf is not None:
        fns["HF fp32 B=1"] = lambda: peer.hf_decode_step_fn(hf, 1, 32)
    with busy_cpu(1):
        time.sleep(0.5)   # let `cpu_contended` (re-read every 0.25 s) see the busy core, as in a real run
        load = load_average()
        times = _time_rounds(fns, SPLIT_OFF, device, rounds, steps)
    out = {name.rsplit(" B=", 1)[0]: dict(ms_per_step=statistics.median(t) * 1e3, ms_min=min(t) * 1e3,
                                          ms_max=max(t) * 1e3) for name, t in times.items()}
    out["load_average"] = load
    return out


def goals(result: dict) -> dict:
    """The issue's targets, each with the measured value, the variant it was measured on, and whether
    it is met (None: not measured). Eager and compiled count as the same precision: the best one."""
    rows = {(r["variant"], r["batch"]): r for r in result["rows"]}

    def best(precision: str, batch: int) -> dict:
        found = [rows[k] for k in ((precision, batch), (f"{precision} compiled", batch)) if k in rows]
        return min(found, key=lambda r: r["ms_per_step"])

    hf1 = rows.get(("HF fp32", 1))
    busy = result["busy"]
    fp32, int8, int4, bf16_8 = best("fp32", 1), best("int8", 1), best("int4", 1), best("bf16", 8)
    checks = [
        ("fp32 B=1 speed vs HF (idle)", 1.0, fp32["variant"], hf1 and hf1["ms_per_step"] / fp32["ms_per_step"]),
        ("fp32 B=1 speed vs HF (one busy process)", 1.0, "fp32",
         busy["HF fp32"]["ms_per_step"] / busy["fp32"]["ms_per_step"] if "HF fp32" in busy else None),
        ("few-row Linear vs F.linear, B=1 (idle)", 1.0, "fp32",
         rows[("fp32 F.linear", 1)]["ms_per_step"] / rows[("fp32", 1)]["ms_per_step"]),
        ("few-row Linear vs F.linear, B=1 (busy)", 1.0, "fp32",
         busy["fp32 F.linear"]["ms_per_step"] / busy["fp32"]["ms_per_step"]),
        ("fp32 B=1 weight bytes/step / time vs bandwidth", 0.7, fp32["variant"], fp32["fraction_of_bandwidth"]),
        ("int8 B=1 speed vs HF fp32", 1.8, int8["variant"], hf1 and hf1["ms_per_step"] / int8["ms_per_step"]),
        ("int4 B=1 speed vs HF fp32", 3.0, int4["variant"], hf1 and hf1["ms_per_step"] / int4["ms_per_step"]),
        ("bf16 B=8 speed vs fp32 (bf16 matmul unit)", 2.0, bf16_8["variant"],
         best("fp32", 8)["ms_per_step"] / bf16_8["ms_per_step"]),
    ]
    out = {name: dict(target=target, variant=variant, value=value,
                      met=None if value is None or math.isnan(value) else bool(value >= target))
           for name, target, variant, value in checks}
    # Under contention the split steps aside, so both rows run the same F.linear code: "never loses"
    # then means a median inside the other's round-to-round spread, not a coin flip on two equal numbers.
    split, no_split = busy["fp32"], busy["fp32 F.linear"]
    tie = split["ms_per_step"] <= no_split["ms_max"] and no_split["ms_per_step"] <= split["ms_max"]
    busy_goal = out["few-row Linear vs F.linear, B=1 (busy)"]
    busy_goal["within_noise"] = tie
    busy_goal["met"] = bool(busy_goal["met"] or tie)
    return out


BENCHMARK = bench_generation = Benchmark("generation", measure, print_generation, parallel=True,
                                         results=("generation", "generation_smollm2_135m"),
                                         plots={"{name}": plot_generation})
