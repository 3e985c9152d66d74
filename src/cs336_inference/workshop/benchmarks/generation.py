"""`bench generation`: how fast a model generates, and why.

Batch-1 decode of a model whose weights dwarf the CPU caches streams every weight each step, so time
~ weight bytes / bandwidth, and fewer bytes (bf16, int8, int4 through `QuantizedLinear`'s packed
kernels) should decode faster. `bench generation` times each precision side by side in alternating
rounds, eager and compiled, against Hugging Face's Llama on the same weights (the `[peer]` extra),
with the streaming bandwidth sampled right beside every timing (a shared host's bandwidth swings by
half within seconds), KL to fp32 (speed is never quoted without its cost), a busy-core repeat, and
where each compiled batch-1 step's time goes (`step_anatomy`: the matmuls against everything between them).
`--model smollm2-135m` times the real model instead (its published GGUF blocks as one more row) and
how long it takes to load: converting the GGUF, and reading the disk cache.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

from ...accounting.model_roofline import decode_step_fn, prefill_tokens_per_second, weight_bytes_per_step
from ...accounting.roofline import bandwidth_probe
from ..cpu_tuning import decode_threads, describe, few_row_split, tune_for_cpu
from ...data.evaluation import decode_kl_to_reference
from ...data.real_text import eval_text_tokens
from ...device import bf16_matmul_unit, omp_spin_count, omp_wait_policy
from ..fast_path import attention_kernel
from ...generation.generate import generate
from ..peers import hf_peer as peer
from ...model.checkpoints import load_pretrained
from ...model.config import ModelConfig
from ...model.real_models import gguf_path, load_gguf_weights
from ...model.transformer import TransformerLM
from ...quantization.model import quantize_model
from ...tables import print_table
from ...timing import busy_cpu, load_average, median_seconds, rss_bytes
from .. import huge_pages
from .base import Benchmark, alternate, beside_bandwidth, fraction_of_bandwidth, spread
from .step_anatomy import PARTS, step_anatomy

PRECISIONS = ("fp32", "bf16", "int8", "int4")
COMPILED = ("fp32", "bf16", "int8", "int4")   # also timed compiled, as the fast path compiles (`compile_fast`)
# the plain model and the F.linear row run with the few-row split off: what the split itself gains
SPLIT_OFF = {"fp32 plain": lambda: few_row_split(False), "fp32 F.linear": lambda: few_row_split(False)}


def int4_group(config: ModelConfig, wanted: int = 128) -> int:
    """The largest int4 kernel group (128, 64 or 32) dividing every quantized layer's input dimension."""
    return next(g for g in (wanted, 64, 32) if config.d_model % g == 0 and config.d_ff % g == 0)


def build_variants(model: TransformerLM) -> dict[str, nn.Module]:
    """Every model the benchmark times (a deep copy each). All but "fp32 plain" opt in to the CPU
    decode speed-ups (`cpu_tuning.tune_for_cpu`) and run the fast path's attention (for bf16 on a CPU,
    our decode kernel: `fast_path.attention_kernel`), as `chat --precision ...` runs them."""
    fused = copy.deepcopy(model).fuse_projections().set_attention_kernel(attention_kernel(model.device))
    fast = tune_for_cpu(copy.deepcopy(fused))   # after any dtype change: the few-row split is timed per dtype
    return {"fp32 plain": model, "fp32": fast, "fp32 F.linear": fast,
            "bf16": tune_for_cpu(fused.to(torch.bfloat16)),
            # tuned again once quantized: their kernels' layouts move to 2 MB pages as the fp32 weights did
            "int8": tune_for_cpu(quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True,
                                                quantize_lm_head=True)),
            "int4": tune_for_cpu(quantize_model(fast, "rtn", bits=4, group_size=int4_group(model.config),
                                                quantize_lm_head=True))}


def _time_rounds(fns: dict, device, rounds: int, steps: int, probe=None) -> dict[str, list]:
    """Alternate: each round times every function once (median of `steps` calls), in the same order.
    With a bandwidth `probe`, each time comes as (seconds, the mean of the bandwidth sampled just before
    and just after it): a fraction of the bandwidth then compares two things measured at one moment."""
    def timed(name, make):
        with SPLIT_OFF.get(name.rsplit(" B=", 1)[0], contextlib.nullcontext)():
            step = make()
            if probe is None:
                return median_seconds(step, device, steps, warmup=2)
            return beside_bandwidth(probe, median_seconds, step, device, steps, 2)
    return alternate({name: partial(timed, name, make) for name, make in fns.items()}, rounds)


def naive_vs_cached(model, new_tokens: int):
    """Greedy generation from a random 32-token prompt with the KV cache and without (same tokens)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    cached, naive = (generate(model, prompt, new_tokens, use_cache=c) for c in (True, False))
    assert cached.tokens == naive.tokens, "cached and naive greedy generation disagree"
    return cached, naive


def bench_config(preset: str = "bench-90m", quick: bool = False) -> ModelConfig:
    """The preset, or (quick) a smaller model of its kind for a smoke run."""
    config = ModelConfig.from_name(preset)
    return config.replace(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=768) if quick else config


def timed_compiled_step(model, switch: bool = True):
    """A `decode` for `decode_step_fn`, compiled as the CLI's fast path compiles (`fast_path.compile_fast`,
    without its eager fallback: a benchmark must fail loudly); the tuned model's thread switch
    (`decode_threads`, unless `switch` is False) stays outside the compiled graph."""
    from ..fast_path import compile_fast

    compiled = compile_fast(model)

    def decode(m, token, cache):
        with decode_threads() if switch else contextlib.nullcontext():
            return compiled(token, cache)
    return decode


# Each compiled variant is another graph of TransformerLM.forward (two: batch 1 is compiled apart), more
# than dynamo's default limit of 8 per function allows with the real model's five.
@torch._dynamo.config.patch(recompile_limit=4 * len(COMPILED))
def measure(run, model: str | None = None, preset: str = "bench-90m") -> dict:
    """model: None times a random-init `preset` model; "smollm2-135m" the real pretrained model instead
    (results in figures/generation_smollm2_135m.*; greedy check and KL on real text; loading times)."""
    device, quick = run.device, run.quick
    model, preset, loading = _reference_model(run, model, preset)
    rounds, steps, batches = (1, 4, (1, 8)) if quick else (5, 12, (1, 8))
    result = {"device": str(device), "preset": preset if not quick else f"{preset} (quick: smaller)",
              "threads": torch.get_num_threads(), "omp_wait_policy": omp_wait_policy(),
              "gomp_spincount": omp_spin_count(), "parameters": model.num_parameters(),
              "cpu_bf16_matmul": bf16_matmul_unit(device), "load_average_start": load_average()}
    real = run.name != "generation"
    models, compiled_variants = build_variants(model), COMPILED
    if real:   # its published GGUF blocks too, with no re-quantization
        result["loading"] = loading
        result["int4_exact"] = _add_exact_gguf(models, preset, device)
        compiled_variants = COMPILED + ("int4 exact",)
    result["cpu_tuning"] = describe(models["fp32"])
    print(f"{result['cpu_tuning']} (every variant but fp32 plain)")
    hf = _peer(model, result)
    quality = _check_tokens_and_quality(models, model, device, hf, preset if real else None, quick, result)
    quality |= {f"{name} compiled": quality[name] for name in compiled_variants}   # same graph, same numbers

    fns = {f"{name} B={B}": (lambda m=m, B=B: decode_step_fn(m, B, 32, steps + 4))
           for name, m in models.items() for B in batches}
    result["compile_seconds"] = {}   # one graph for all positions and batch sizes, compiled once here
    for name in compiled_variants if not quick else ():   # a smoke run skips the minutes of compiling
        fns |= _compile_variant(models, name, batches, steps, result["compile_seconds"])
    if hf is not None:
        fns |= {f"HF fp32 B={B}": (lambda B=B: peer.hf_decode_step_fn(hf, B, 32)) for B in batches}
    samples = _time_rounds(fns, device, rounds, steps, bandwidth_probe(device, empty=huge_pages.empty))
    bandwidths = [b for pairs in samples.values() for _, b in pairs]
    result["measured_bandwidth_GBps"] = statistics.median(bandwidths) / 1e9
    result["measured_bandwidth_GBps_range"] = [min(bandwidths) / 1e9, max(bandwidths) / 1e9]
    result["load_average_decode"] = load_average()
    result["rows"] = _rows(samples, models, model, quality)
    return _after_the_rounds(result, fns, models, device, rounds, steps, quick)


def _after_the_rounds(result: dict, fns: dict, models: dict, device, rounds: int, steps: int, quick: bool) -> dict:
    """`result` with what the timed rounds do not give: each profiled batch-1 step's anatomy, the busy-core
    repeat, the goals, prefill speed, and cached against naive generation."""
    # where the batch-1 step's time goes (`step_anatomy`): the compiled rows, or a quick run's eager ones
    profiled = [n.removesuffix(" B=1") for n in fns if n.endswith(" compiled B=1")] or ["fp32", "bf16"]
    result["anatomy"] = {variant: step_anatomy(fns[f"{variant} B=1"](), steps, weight_bytes_per_step(models[variant]))
                         for variant in profiled}
    busy = ("fp32 B=1", "fp32 F.linear B=1", "fp32 plain B=1", "fp32 compiled B=1", "HF fp32 B=1")
    result["busy"] = _busy_section({k: fns[k] for k in busy if k in fns}, device, rounds, steps)
    result["goals"] = goals(result)
    for prompt_len in (32, 512) if not quick else (32,):
        result[f"prefill_tok_per_s_prompt{prompt_len}"] = prefill_tokens_per_second(models["fp32"], prompt_len)
    new_tokens = 32 if quick else 128
    cached, naive = naive_vs_cached(models["fp32"], new_tokens)
    return result | dict(new_tokens=new_tokens, cached_generation_s=cached.total_time,
                         naive_generation_s=naive.total_time, naive_over_cached=naive.total_time / cached.total_time,
                         load_average_end=load_average())


def _reference_model(run, name: str | None, preset: str) -> tuple[TransformerLM, str, dict | None]:
    """(the fp32 model every variant derives from, the preset it is reported as, the real model's loading
    times or None). name None: a random-init `preset` (smaller where `run.quick`); a real model's name
    loads it, after timing its loading, and renames the run so that its results have their own files."""
    if name is None:
        return TransformerLM(bench_config(preset, run.quick), device=run.device).eval(), preset, None
    from ...model.real_models import real_model_missing

    if missing := real_model_missing(name):
        raise ValueError(f"bench generation --model {name}: {missing}")
    run.name = f"generation_{name.replace('-', '_')}"
    loading = measure_loading(name, run.device)
    return load_pretrained(name, device=run.device, dtype=torch.float32).eval(), name, loading


def _add_exact_gguf(models: dict, preset: str, device) -> str:
    """Add the real model's published GGUF blocks, with no re-quantization, as "int4 exact"; describe them."""
    exact = load_pretrained(preset, device=device, weights="gguf-exact")
    exact.set_attention_kernel(attention_kernel(device))
    models["int4 exact"] = tune_for_cpu(exact)
    return exact.describe()


def _peer(model: TransformerLM, result: dict):
    """Hugging Face's Llama on `model`'s weights (its version into `result`), or None without transformers."""
    hf = peer.hf_llama_from(model) if peer.transformers_available() else None
    if hf is None:
        print(f"peer row skipped: transformers is not installed ({peer.INSTALL_HINT})")
    result["peer"] = "transformers " + __import__("transformers").__version__ if hf is not None else None
    return hf


def _check_tokens_and_quality(models: dict, model: TransformerLM, device, hf, real_preset: str | None, quick: bool,
                              result: dict) -> dict:
    """Same greedy tokens from our readable path, our fast path and the peer (recorded in `result`), and each
    variant's (KL to fp32, top-1 agreement). Both read random ids for a random-init model (`real_preset`
    None), real text for a real one."""
    width, n_check = (32, 16) if quick else (64, 32)
    text = (eval_text_tokens(real_preset, 4 * width) if real_preset is not None
            else torch.randint(0, model.config.vocab_size, (4 * width,)))
    prompt = text[None, :16].to(device)
    greedy = {name: generate(models[name], prompt.tolist(), n_check).tokens for name in ("fp32 plain", "fp32")}
    result["greedy_fast_equals_plain"] = greedy["fp32"] == greedy["fp32 plain"]
    if hf is not None:
        result["greedy_equals_peer"] = greedy["fp32"] == peer.hf_greedy(hf, prompt, n_check)
    return {name: decode_kl_to_reference(m, model, text.view(4, width).to(device)) for name, m in models.items()}


def _compile_variant(models: dict, name: str, batches, steps: int, compile_seconds: dict) -> dict:
    """Compile variant `name` (its seconds into `compile_seconds`), add it to `models` as "{name} compiled"
    and return its step makers, one per batch size."""
    t0 = time.perf_counter()
    decode = timed_compiled_step(models[name])
    decode_step_fn(models[name], 1, 32, 8, decode)()                            # compiles
    compile_seconds[name] = time.perf_counter() - t0
    models[f"{name} compiled"] = models[name]
    return {f"{name} compiled B={B}": (lambda m=models[name], B=B, d=decode: decode_step_fn(m, B, 32, steps + 4, d))
            for B in batches}


def _rows(samples: dict[str, list], models: dict, model: TransformerLM, quality: dict) -> list[dict]:
    """One table row per timed "{variant} B={batch}": its times, throughput, weight bytes against the
    bandwidth sampled beside it, quality, and its speed-ups over fp32 (and HF's fp32) at the same batch."""
    rows = []
    for name, pairs in samples.items():
        ts = [t for t, _ in pairs]
        variant, B = name.rsplit(" B=", 1)
        seconds, weight_bytes = statistics.median(ts), weight_bytes_per_step(models.get(variant, model))
        row = dict(zip(("variant", "batch", "ms_per_step", "ms_min", "ms_max"), (variant, int(B), *spread(ts, 1e3))))
        row |= dict(tok_per_s=int(B) / seconds, weight_bytes_per_step=weight_bytes, GBps=weight_bytes / seconds / 1e9)
        row["fraction_of_bandwidth"] = fraction_of_bandwidth(weight_bytes, pairs)
        row["bandwidth_GBps"] = statistics.median(b for _, b in pairs) / 1e9
        row["kl_to_fp32"], row["top1_agreement"] = quality.get(variant, (None, None))
        rows.append(row)
    for row in rows:
        same_b = {r["variant"]: r["ms_per_step"] for r in rows if r["batch"] == row["batch"]}
        row["speedup_vs_fp32"] = same_b["fp32"] / row["ms_per_step"]
        if "HF fp32" in same_b:
            row["speedup_vs_hf_fp32"] = same_b["HF fp32"] / row["ms_per_step"]
    return rows


def _busy_section(fns: dict, device, rounds: int, steps: int) -> dict:
    """Batch-1 decode (the step makers `fns`) while one busy loop holds a core."""
    with busy_cpu(1):
        time.sleep(0.5)   # let `cpu_contended` (re-read every 0.25 s) see the busy core, as in a real run
        load = load_average()
        times = _time_rounds(fns, device, rounds, steps)
    out = {name.rsplit(" B=", 1)[0]: dict(zip(("ms_per_step", "ms_min", "ms_max"), spread(t, 1e3)))
           for name, t in times.items()}
    return out | {"load_average": load}


def goals(result: dict) -> dict:
    """The issue's targets, each with the measured value, the variant it was measured on, and whether
    it is met (None: not measured). Eager and compiled count as the same precision: the best one."""
    rows = {(r["variant"], r["batch"]): r for r in result["rows"]}

    def best(precision: str, batch: int) -> dict:
        found = [rows[k] for k in ((precision, batch), (f"{precision} compiled", batch)) if k in rows]
        return min(found, key=lambda r: r["ms_per_step"])

    def ms(where, variant):
        return where[variant]["ms_per_step"] if variant in where else None

    def ratio(a, b):   # a / b, None where a was not measured
        return a and a / b

    hf1 = ms({v: r for (v, b), r in rows.items() if b == 1}, "HF fp32")
    busy = result["busy"]
    fp32, bf16, int8, int4 = best("fp32", 1), best("bf16", 1), best("int8", 1), best("int4", 1)
    bf16_8 = best("bf16", 8)
    checks = [
        ("fp32 B=1 speed vs HF (idle)", 1.0, fp32["variant"], ratio(hf1, fp32["ms_per_step"])),
        ("fp32 B=1 speed vs HF (one busy process)", 1.0, "fp32", ratio(ms(busy, "HF fp32"), ms(busy, "fp32"))),
        ("few-row Linear vs F.linear, B=1 (idle)", 1.0, "fp32",
         rows[("fp32 F.linear", 1)]["ms_per_step"] / rows[("fp32", 1)]["ms_per_step"]),
        ("few-row Linear vs F.linear, B=1 (busy)", 1.0, "fp32", ms(busy, "fp32 F.linear") / ms(busy, "fp32")),
        ("fp32 B=1 weight bytes/step / time vs bandwidth", 0.7, fp32["variant"], fp32["fraction_of_bandwidth"]),
        ("bf16 B=1 weight bytes/step / time vs bandwidth", 0.7, bf16["variant"], bf16["fraction_of_bandwidth"]),
        ("int8 B=1 speed vs HF fp32", 1.8, int8["variant"], ratio(hf1, int8["ms_per_step"])),
        ("int4 B=1 speed vs HF fp32", 3.0, int4["variant"], ratio(hf1, int4["ms_per_step"])),
        ("bf16 B=8 speed vs fp32 (bf16 matmul unit)", 2.0, bf16_8["variant"],
         best("fp32", 8)["ms_per_step"] / bf16_8["ms_per_step"]),
    ]
    out = {name: dict(target=target, variant=variant, value=value,
                      met=None if value is None or math.isnan(value) else bool(value >= target))
           for name, target, variant, value in checks}
    # Under contention the split steps aside, and where the calibration kept it off it never runs, so
    # both rows run the same F.linear code: "never loses" then means a median inside the other's
    # round-to-round spread, not a coin flip on two equal numbers.
    one = {v: r for (v, b), r in rows.items() if b == 1}
    for where, state in ((busy, "busy"), (one, "idle")):
        goal = f"few-row Linear vs F.linear, B=1 ({state})"
        split, no_split = where["fp32"], where["fp32 F.linear"]
        tie = split["ms_per_step"] <= no_split["ms_max"] and no_split["ms_per_step"] <= split["ms_max"]
        out[goal]["within_noise"], out[goal]["met"] = tie, bool(out[goal]["met"] or tie)
    return out


def measure_loading(name: str, device: torch.device) -> dict:
    """Seconds to convert a real model's GGUF without the cache, and to load each dtype through it (warm)."""
    t0 = time.perf_counter()
    load_gguf_weights(gguf_path(name), torch.float32)          # parse + dequantize, nothing cached
    out = dict(convert_gguf_s=time.perf_counter() - t0)
    for p, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        load_pretrained(name, device=device, dtype=dt)          # make sure this dtype's cache file exists
        rss0, t0 = rss_bytes(), time.perf_counter()
        model = load_pretrained(name, device=device, dtype=dt)
        out[f"load_{p}_s"] = time.perf_counter() - t0
        out[f"parameters_{p}_MB"] = sum(t.nbytes for t in model.parameters()) / 1e6
        rss1 = rss_bytes()
        out[f"rss_growth_{p}_MB"] = None if rss0 is None or rss1 is None else (rss1 - rss0) / 2**20
        del model
    return out


def print_generation(result: dict) -> None:
    r = result
    print(f"\n{r['preset']} on {r['device']}: {r['parameters']:,} parameters, {r['threads']} thread(s), "
          f"OMP_WAIT_POLICY={r['omp_wait_policy']} (GOMP_SPINCOUNT={r.get('gomp_spincount', '-')}), bf16 matmul "
          f"unit: {r['cpu_bf16_matmul']}; streaming bandwidth beside the timings {_bandwidth_text(r)}; "
          f"each row's 'of bw' pairs its own; greedy tokens: fast == plain {r['greedy_fast_equals_plain']}, "
          f"== Hugging Face {r.get('greedy_equals_peer', 'not run (no transformers)')}")
    if ld := r.get("loading"):
        print(f"loading: convert the GGUF {ld['convert_gguf_s']:.1f} s; from the disk cache fp32 "
              f"{ld['load_fp32_s']:.2f} s ({ld['parameters_fp32_MB']:.0f} MB), bf16 {ld['load_bf16_s']:.2f} s")
    if r.get("compile_seconds"):
        print("torch.compile time: " + ", ".join(f"{k} {v:.0f} s" for k, v in r["compile_seconds"].items()))
    print_table([dict(row, spread=f"{row['ms_min']:.1f}-{row['ms_max']:.1f}") for row in r["rows"]], [
        ("variant", "variant", None), ("batch", "B", None), ("ms_per_step", "ms/step", "{:.1f}"),
        ("spread", "min-max", None), ("tok_per_s", "tok/s", "{:.1f}"),
        ("weight_bytes_per_step", "MB/step", lambda b: f"{b / 1e6:.1f}"), ("GBps", "GB/s", "{:.1f}"),
        ("bandwidth_GBps", "bw GB/s", "{:.1f}"), ("fraction_of_bandwidth", "of bw", "{:.0%}"),
        ("speedup_vs_fp32", "vs fp32", "{:.2f}x"), ("speedup_vs_hf_fp32", "vs HF", "{:.2f}x"),
        ("kl_to_fp32", "KL", "{:.5f}"), ("top1_agreement", "top1", "{:.2f}")])
    busy = r["busy"]
    print_table([dict(v, variant=k) for k, v in busy.items() if isinstance(v, dict)],
                [("variant", "variant", None), ("ms_per_step", "ms/step", "{:.1f}"), ("ms_min", "min", "{:.1f}"),
                 ("ms_max", "max", "{:.1f}")],
                title=f"\nbusy (one other process spinning, load {busy['load_average']}), batch 1:")
    if anatomy := r.get("anatomy"):
        heads = dict(zip([*PARTS, "everything else"], ("our matmul", "torch matmul", "attention", "graph's code",
                                                         "guards", "the rest")))
        print_table([dict(a["ms"], variant=k, total=a["profiled_ms_per_step"], GBps=a["matmul_GBps"])
                     for k, a in anatomy.items()],
                    [("variant", "variant", None), ("total", "ms/step", "{:.2f}"),
                     *((part, head, "{:.2f}") for part, head in heads.items()), ("GBps", "matmul GB/s", "{:.1f}")],
                    title="\nwhere a batch-1 step's time goes (ms per step under torch's profiler, `step_anatomy`; "
                          "matmul GB/s: weight bytes / time in the matmuls):")
    states, tie = {True: "met", False: "NOT met", None: "not measured"}, " (a tie: each median in the other's min-max)"
    print_table([dict(v, goal=k, state=states[v["met"]] + (tie if v.get("within_noise") and v["value"] < v["target"]
                                                           else "")) for k, v in r["goals"].items()],
                [("goal", "goal", None), ("value", "value", "{:.2f}"), ("target", "target >=", "{:g}"),
                 ("variant", "measured on", None), ("state", "", None)], title="\ngoals:")
    if "naive_over_cached" in r:
        print(f"\nprefill {r['prefill_tok_per_s_prompt32']:.0f} tok/s (prompt 32); {r['new_tokens']} tokens naive "
              f"{r['naive_generation_s']:.1f} s vs cached {r['cached_generation_s']:.1f} s "
              f"({r['naive_over_cached']:.1f}x)")


def _bandwidth_text(r: dict) -> str:
    lo_hi = r.get("measured_bandwidth_GBps_range")
    return f"{r['measured_bandwidth_GBps']:.1f} GB/s" + (f" (median; {lo_hi[0]:.0f}-{lo_hi[1]:.0f})" if lo_hi else "")


def plot_generation(result: dict):
    """Decode tokens/s per variant at batch 1 and 8 (labelled with the speed-up over fp32), and batch-1
    weight bytes per step / step time against the streaming bandwidth sampled beside its timings.
    Horizontal bars throughout: the variant names read level instead of crowding under the axis."""
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    rows = result["rows"]
    for ax, B in ((ax1, 1), (ax2, 8)):
        sel = [r for r in rows if r["batch"] == B]
        colors = ["tab:gray" if r["variant"].startswith("HF") else "tab:blue" for r in sel]
        ax.barh([r["variant"] for r in sel], [r["tok_per_s"] for r in sel], color=colors)
        for i, r in enumerate(sel):
            ax.text(r["tok_per_s"], i, f" {r['speedup_vs_fp32']:.2f}x", va="center", fontsize=8)
        ax.set_xlim(0, 1.15 * max(r["tok_per_s"] for r in sel))
        ax.set_xlabel("decode tokens/s (higher is better)")
        ax.set_title(f"Batch {B}: {result['preset']}, {result['device']}, {result['threads']} thread(s)")
    one = [r for r in rows if r["batch"] == 1]
    ax3.barh([r["variant"] for r in one], [r["GBps"] for r in one], color="tab:blue", label="weight bytes / step time")
    ax3.axvline(result["measured_bandwidth_GBps"], color="black", ls="--", label="streaming bandwidth (median)")
    if all("bandwidth_GBps" in r for r in one):   # sampled beside each row's timings; the label: the row's fraction
        ax3.plot([r["bandwidth_GBps"] for r in one], range(len(one)), "k|", ms=14, label="bandwidth beside the row")
        for i, r in enumerate(one):
            ax3.text(r["GBps"], i, f" {r['fraction_of_bandwidth']:.0%}", va="center", fontsize=8)
    ax3.set(xlabel="GB/s", title="Batch-1 decode against the memory roof")
    ax3.legend(fontsize=8, loc="lower right")
    ax1.invert_yaxis()   # shared: the table's order, top to bottom
    fig.tight_layout()
    return fig


BENCHMARK = bench_generation = Benchmark("generation", measure, print_generation, parallel=True,
                                         results=("generation", "generation_smollm2_135m"),
                                         plots={"{name}": plot_generation})
