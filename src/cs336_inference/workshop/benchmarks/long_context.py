"""`bench long_context`: what each way of shrinking the KV cache costs a real model trained without it.

SmolLM2-135M-Instruct (full attention) retrieves a passkey (`data.passkey`) at several contexts and
depths, under variants applied post hoc: sliding windows, windows keeping attention sinks
(StreamingLLM), local/global hybrids, MQA by mean-pooling the KV heads, int8 / fp8 / int4 KV caches.
Per variant: accuracy, the cache's measured bytes and decode latency at the longest context. Work is
shared only where exact: a trial is one prefill plus one teacher-forced forward of its answer (greedy
decoding emits the key iff each answer token is the argmax); the KV formats quantize the full
prefill's cache; a window covering the whole sequence reuses the full-attention result.
"""

from __future__ import annotations

import copy
import statistics
import time

import matplotlib.pyplot as plt
import torch

from ...accounting import kv_cache_bytes
from ..cpu_tuning import tune_for_cpu
from ...data.passkey import passkey_trials, prefill_trial, score_trial
from ...model import load_pretrained, load_tokenizer
from ...model.convert import mean_pool_kv_heads, with_attention
from ...quantization.kv import quantize_kv_cache
from ...tables import long_context_table
from ...timing import alternating_timings
from .base import Benchmark, spread

MODEL = "smollm2-135m"
CONTEXTS, QUICK_CONTEXTS = (256, 512, 1024, 2048), (256, 512)
TRIALS, QUICK_TRIALS = 20, 2
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SINKS = 4
DECODE_STEPS = 8   # decode steps timed per variant (interleaved) after its first trial at the longest context
PREFILL_CHUNK = 256


def variants() -> list[dict]:
    """name, family and how to build each variant from the loaded model (kv: a cache format instead)."""
    rows = [dict(name="full attention (GQA, K=3)", family="full", changes={})]
    rows += [dict(name=f"window {w}", family="window", changes=dict(sliding_window=w)) for w in (128, 256, 512)]
    rows += [dict(name=f"window {w} + {SINKS} sinks", family="sinks",
                  changes=dict(sliding_window=w, attention_sinks=SINKS)) for w in (128, 256, 512)]
    rows += [dict(name=f"hybrid W128 + sinks, 1 global in {g}", family="hybrid",
                  changes=dict(sliding_window=128, attention_sinks=SINKS, global_every=g)) for g in (6, 2)]
    rows += [dict(name="MQA (mean-pooled KV heads, K=1)", family="mqa", kv_heads=1)]
    rows += [dict(name=f"{fmt} KV cache", family="kv", kv=fmt) for fmt in ("int8", "e4m3", "int4")]
    return rows


def _build(model, spec):
    if "kv_heads" in spec:
        return mean_pool_kv_heads(model, spec["kv_heads"])
    return with_attention(model, **spec["changes"]) if spec.get("changes") else model


def _window_covers(spec, context: int) -> bool:
    """A window at least as long as the whole sequence leaves every query's view unchanged."""
    w = spec.get("changes", {}).get("sliding_window")
    return w is not None and context <= w


def evaluate(model, tokenizer, specs, contexts, num_trials, log=print) -> tuple[dict, dict]:
    """Every variant on every trial -> per-trial records, and per variant (model, cache) of its first trial
    at the longest context, left with room for DECODE_STEPS more tokens (for `time_decode`)."""
    kv_specs = [s for s in specs if "kv" in s]
    results = {s["name"]: [] for s in specs}
    full = results[specs[0]["name"]]  # specs[0] is full attention: it runs first
    longest, timers = max(contexts), {}
    for spec in [s for s in specs if "kv" not in s]:
        built = _build(model, spec)
        t0 = time.perf_counter()
        index = 0                                   # the same (context, trial) order for every variant
        for context in contexts:
            for t, trial in enumerate(passkey_trials(tokenizer, context, num_trials, DEPTHS)):
                index += 1
                if _window_covers(spec, context):
                    results[spec["name"]].append(dict(full[index - 1], copied_from_full=True))
                    continue
                timed = context == longest and t == 0
                cache, last = prefill_trial(built, trial, DECODE_STEPS if timed else 0, PREFILL_CHUNK)
                targets = [(spec, cache)]
                if spec["family"] == "full":  # the KV formats share this prefill (quantized copies)
                    targets += [(k, quantize_kv_cache(copy.copy(cache), k["kv"])) for k in kv_specs]
                for target, c in targets:
                    correct, logprob = score_trial(built, c, last, trial)
                    results[target["name"]].append(dict(context=context, depth=trial.depth, distance=trial.distance,
                                                        key=trial.key, correct=correct, answer_logprob=logprob))
                    if timed:
                        timers[target["name"]] = (built, c)
            acc = [r["correct"] for r in results[spec["name"]] if r["context"] == context]
            log(f"  {spec['name']:<34} context {context:5d}: {sum(acc):2d}/{len(acc)} "
                f"({time.perf_counter() - t0:6.1f} s so far)")
    return results, timers


@torch.inference_mode()
def time_decode(timers: dict, steps: int = DECODE_STEPS) -> dict[str, list[float]]:
    """Seconds of single-token decode steps, one variant after another in each of `steps` rounds."""
    def step(model, cache):
        return lambda: model(torch.zeros(1, 1, dtype=torch.long, device=model.device), cache=cache,
                             start_pos=cache.length)
    if not timers:
        return {}
    device = next(iter(timers.values()))[0].device
    return {name: t["times"] for name, t in alternating_timings(
        {name: step(*mc) for name, mc in timers.items()}, steps, 0, device).items()}


def _kv_bytes(model, spec, longest: int) -> int:
    """Bytes of the variant's cache object for one sequence of the longest context (measured)."""
    if "kv" in spec:
        return quantize_kv_cache(model.new_cache(1, longest), spec["kv"]).nbytes
    return _build(model, spec).new_cache(1, longest).nbytes


def summarize(model, specs, results, decode_seconds, contexts) -> list[dict]:
    longest = max(contexts)
    rows = []
    for spec in specs:
        trials, per_context = results[spec["name"]], {}
        for context in contexts:
            cell = [r for r in trials if r["context"] == context]
            per_context[str(context)] = dict(
                accuracy=sum(r["correct"] for r in cell) / len(cell), trials=len(cell),
                mean_answer_logprob=statistics.fmean(r["answer_logprob"] for r in cell),
                copied_from_full=all(r.get("copied_from_full", False) for r in cell))
        at_depth = {str(d): [r["correct"] for r in trials if r["depth"] == d] for d in DEPTHS}
        nbytes, decode = _kv_bytes(model, spec, longest), decode_seconds.get(spec["name"], [])
        rows.append(dict(
            variant=spec["name"], family=spec["family"], changes=spec.get("changes", {}), kv_format=spec.get("kv"),
            kv_heads=spec.get("kv_heads", model.config.num_kv_heads), kv_bytes_at_longest=nbytes,
            kv_bytes_per_context_token=nbytes / longest, accuracy=per_context,
            accuracy_by_depth={d: sum(c) / max(1, len(c)) for d, c in at_depth.items()},
            overall_accuracy=sum(r["correct"] for r in trials) / len(trials),
            decode_ms_at_longest=dict(zip(("median", "min", "max"), spread(decode, 1e3)), steps=len(decode))
            if decode else None, trials=trials))
    return rows


def measure(run) -> dict:
    contexts, num_trials = (QUICK_CONTEXTS, QUICK_TRIALS) if run.quick else (CONTEXTS, TRIALS)
    dtype = torch.bfloat16  # the inference default; the CPU here has bf16 matmul instructions
    model = tune_for_cpu(load_pretrained(MODEL, device=run.device, dtype=dtype).set_attention_kernel("sdpa"))
    tokenizer = load_tokenizer(MODEL)
    specs = variants()
    print(f"{MODEL} ({dtype}, {run.device}, {torch.get_num_threads()} threads): "
          f"{len(specs)} variants x contexts {list(contexts)} x {num_trials} trials")
    results, timers = evaluate(model, tokenizer, specs, contexts, num_trials)
    rows = summarize(model, specs, results, time_decode(timers), contexts)
    longest = max(contexts)
    assert rows[0]["kv_bytes_at_longest"] == kv_cache_bytes(model.config, 1, longest, 2), "cache bytes != accounting"
    return dict(model=MODEL, dtype=str(dtype), device=str(run.device), contexts=list(contexts),
                trials_per_context=num_trials, depths=list(DEPTHS), sinks=SINKS, decode_steps_timed=DECODE_STEPS,
                threads=torch.get_num_threads(), chance_accuracy=1e-5, rows=rows,
                note=("accuracy = exact greedy retrieval of a 5-digit key (teacher-forced check); KV formats quantize "
                      "the cache after a bf16 prefill; decode ms = one B=1 step at the longest context, medians on a "
                      "shared CPU (see machine.load_avg)"))


def print_table(data: dict) -> None:
    print(f"\npasskey accuracy ({data['trials_per_context']} trials per context; KV cache and decode at "
          f"{max(data['contexts'])} tokens)")
    print(long_context_table(data))


COLORS = {"full": "black", "window": "tab:red", "sinks": "tab:orange", "hybrid": "tab:green", "mqa": "tab:purple",
          "kv": "tab:blue"}


def plot_long_context(data: dict):
    """Accuracy per variant and context (a heat map), and what each variant's cache costs at the longest
    context (bars: MB, labelled with accuracy and decode time)."""
    contexts, rows = data["contexts"], data["rows"]
    names = [r["variant"] for r in rows]
    acc = [[r["accuracy"][str(c)]["accuracy"] for c in contexts] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.42 * len(rows) + 1.8),
                                   gridspec_kw=dict(width_ratios=[1, 1.3]))
    ax1.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(acc):
        for j, a in enumerate(row):
            copied = rows[i]["accuracy"][str(contexts[j])]["copied_from_full"]
            ax1.text(j, i, f"{a:.2f}" + ("=" if copied else ""), ha="center", va="center", fontsize=8)
    ax1.set_xticks(range(len(contexts)), [str(c) for c in contexts])
    ax1.set_yticks(range(len(rows)), names, fontsize=8)
    for tick, r in zip(ax1.get_yticklabels(), rows):
        tick.set_color(COLORS[r["family"]])
    ax1.set_xlabel("context (tokens: prompt + answer)")
    ax1.set_title(f"passkey accuracy, {data['trials_per_context']} trials per cell\n(= : window covers the "
                  "sequence, same as full attention)", fontsize=10)
    longest = str(max(contexts))
    mb = [r["kv_bytes_at_longest"] / 1e6 for r in rows]
    ax2.barh(range(len(rows)), mb, color=[COLORS[r["family"]] for r in rows], alpha=0.75)
    for i, r in enumerate(rows):
        ms = r["decode_ms_at_longest"]
        label = f" acc {r['accuracy'][longest]['accuracy']:.2f}" + (f", {ms['median']:.0f} ms/step" if ms else "")
        ax2.text(mb[i], i, label, va="center", fontsize=8)
    ax2.set_yticks(range(len(rows)), [""] * len(rows))
    ax2.invert_yaxis()
    ax2.set(xlim=(0, max(mb) * 1.45),
            xlabel=f"KV cache MB for one {longest}-token sequence (measured on the cache, {data['dtype']})")
    ax2.set_title(f"{data['model']}, post hoc (no retraining): cache size, accuracy and B=1 decode at {longest}",
                  fontsize=10)
    ax1.set_ylim(len(rows) - 0.5, -0.5)
    fig.tight_layout()
    return fig


BENCHMARK = bench_long_context = Benchmark("long_context", measure, print_table, parallel=True,
                                           plots={"long_context": plot_long_context})
