"""`bench quantization_smollm2`: every quantization method on a real model and real English text
(CPython's documentation, `data.real_text`), against the unquantized model.

Per variant: bits per UTF-8 byte of held-out text, KL(reference || variant) and top-1 agreement per
token, the model's true stored bytes; and how many activations entering each layer's linears exceed
LLM.int8()'s outlier threshold 6.0 (Dettmers et al. 2022). The reference is the published model: its
weights are *already* 4-bit (GGUF Q4_1: blocks of 32, w = d q + m), dequantized to fp32. Re-quantizing
on llama.cpp's own grid reproduces them exactly, while our affine int4 g32 uses another grid (range
widened to contain 0, an integer zero point): the table shows what that costs. 128 does not divide
D = 576, so the "g128" rows use g96 (the largest group <= 128 dividing both 576 and F = 1536).
"""

from __future__ import annotations

import copy
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

from ..data.evaluation import compare_on_text
from ..data.real_text import bytes_per_token, pydoc_documents, token_stream
from ..cpu_tuning import tune_for_cpu
from ..model import load_pretrained, load_tokenizer
from ..model.gguf import gguf_round_trip
from ..quantization.kv import quantize_kv_cache
from ..quantization.llm_int8 import count_activation_outliers
from ..quantization.linear import model_nbytes
from ..quantization.model import quantize_model
from ..tables import quantization_smollm2_table
from .base import Benchmark
from .quantization import WithQuantizedKV

MODEL = "smollm2-135m"
THRESHOLD = 6.0
G = 96  # stands in for g128: 128 does not divide D = 576


def requantize_q4_1(model: nn.Module) -> nn.Module:
    """A copy whose block linears went through llama.cpp's Q4_1 quantizer again."""
    q = copy.deepcopy(model)
    with torch.no_grad():
        for m in q.layers.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(gguf_round_trip(m.weight, "Q4_1"))
    return q


def variants(quick: bool) -> list[tuple[str, str, dict | None]]:
    """(label, family, quantize_model kwargs or a special marker) for each row of the table."""
    rows = [("fp32 (published Q4_1, dequantized)", "reference", None),
            ("bf16", "cast", {"special": "bf16"}),
            ("int8 per-channel RTN", "rtn", dict(method="rtn", bits=8, group_size=None, symmetric=True)),
            ("fp8 e4m3 per-channel", "fp8", dict(method="fp8", bits=8, group_size=None)),
            ("LLM.int8() (threshold 6)", "llm_int8", dict(method="llm_int8", bits=8, group_size=None)),
            ("Q4_1 again (llama.cpp's grid)", "q4_1", {"special": "q4_1"}),
            ("int4 RTN g32 (affine)", "rtn", dict(method="rtn", bits=4, group_size=32)),
            ("int4 RTN g64 (affine)", "rtn", dict(method="rtn", bits=4, group_size=64)),
            (f"int4 RTN g{G} (affine)", "rtn", dict(method="rtn", bits=4, group_size=G)),
            (f"int4 GPTQ g{G}", "gptq", dict(method="gptq", bits=4, group_size=G)),
            (f"int4 AWQ g{G}", "awq", dict(method="awq", bits=4, group_size=G)),
            (f"int3 RTN g{G}", "rtn", dict(method="rtn", bits=3, group_size=G)),
            (f"int3 GPTQ g{G}", "gptq", dict(method="gptq", bits=3, group_size=G)),
            (f"int3 AWQ g{G}", "awq", dict(method="awq", bits=3, group_size=G)),
            ("fp32 weights + int8 KV cache", "kv", {"special": "kv_int8"}),
            ("fp32 weights + int4 KV cache", "kv", {"special": "kv_int4"})]
    if quick:  # the smoke run: no GPTQ/AWQ (minutes on a CPU even with little calibration data)
        rows = [r for r in rows if r[1] not in ("gptq", "awq")]
    return rows


def build(model, kwargs, calibration, awq_grid: int) -> nn.Module:
    special = (kwargs or {}).get("special")
    if kwargs is None:
        return model
    if special == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16)
    if special == "q4_1":
        return requantize_q4_1(model)
    if special in ("kv_int8", "kv_int4"):
        return WithQuantizedKV(model, special.removeprefix("kv_"))
    # quality of the quantization grid itself: exact dequantize-then-matmul in fp32 (the packed kernels'
    # bf16 activations would add their own small error on top)
    extra = dict(calibration=calibration) if kwargs["method"] in ("gptq", "awq") else {}
    if kwargs["method"] in ("rtn", "gptq", "awq"):
        extra["kernel"] = "reference"
    if kwargs["method"] == "awq":
        extra["awq_grid"] = awq_grid
    return quantize_model(model, **kwargs, **extra)


def grid_comparison(model, requantized, rtn) -> dict:
    """How far each 4-bit re-quantization moves the published weights (block linears, fp32)."""
    out = {}
    for label, other in (("q4_1_again", requantized), ("int4_rtn_g32_affine", rtn)):
        diff, ref, changed, total = 0.0, 0.0, 0, 0
        for m, o in zip(model.layers.modules(), other.layers.modules()):
            if not isinstance(m, nn.Linear):
                continue
            w = m.weight.detach().float()
            w2 = (o.dequantized_weight() if hasattr(o, "dequantized_weight") else o.weight).detach().float()
            diff += float(((w2 - w) ** 2).sum())
            ref += float((w ** 2).sum())
            changed += int((w2 != w).sum())
            total += w.numel()
        out[label] = dict(relative_rms_change=math.sqrt(diff / ref), fraction_of_weights_changed=changed / total)
    return out


def measure(run) -> dict:
    quick, device = run.quick, run.device
    reference = tune_for_cpu(load_pretrained(MODEL, device=device, dtype=torch.float32).set_attention_kernel("sdpa"))
    tokenizer = load_tokenizer(MODEL)
    eos = tokenizer.special_to_id["<|endoftext|>"]
    seq_len, n_eval, n_calib, calib_len, awq_grid = (256, 2, 4, 128, 5) if quick else (512, 8, 16, 256, 20)
    evaluation = token_stream(tokenizer, pydoc_documents("eval"), eos)
    calib_stream = token_stream(tokenizer, pydoc_documents("calibration"), eos)
    windows = evaluation[: n_eval * (seq_len + 1)].view(n_eval, seq_len + 1)    # consecutive, non-overlapping
    starts = torch.linspace(0, calib_stream.numel() - calib_len - 1, n_calib).long().tolist()
    calibration = [torch.stack([calib_stream[s:s + calib_len] for s in starts])]
    print(f"{MODEL} on {device} ({torch.get_num_threads()} threads): "
          f"eval {n_eval} x {seq_len} tokens of pydoc text, calibration {n_calib} x {calib_len}")

    rows, models = [], {}
    for label, family, kwargs in variants(quick):
        t0 = time.perf_counter()
        models[label] = build(reference, kwargs, calibration, awq_grid)
        seconds = time.perf_counter() - t0
        inner = models[label].model if isinstance(models[label], WithQuantizedKV) else models[label]
        rows.append(dict(variant=label, family=family, spec={k: v for k, v in (kwargs or {}).items()},
                         model_bytes=model_nbytes(inner), build_seconds=seconds))
        print(f"  built {label:<38} {seconds:6.1f} s", flush=True)
    t0 = time.perf_counter()
    quality = compare_on_text(models, reference, windows, bytes_per_token(tokenizer))
    print(f"  evaluated {len(models)} variants on {windows.numel()} tokens in {time.perf_counter() - t0:.0f} s")
    for row in rows:
        row.update(quality[row["variant"]])
        row["bytes_ratio_vs_reference"] = rows[0]["model_bytes"] / row["model_bytes"]
    kv_bytes = {fmt: quantize_kv_cache(reference.new_cache(1, 1), fmt).bytes_per_token for fmt in ("int8", "int4")}
    kv_bytes["fp32"] = reference.new_cache(1, 1).bytes_per_token
    rtn32 = models.get("int4 RTN g32 (affine)")
    return dict(
        model=MODEL, device=str(device), threads=torch.get_num_threads(), seq_len=seq_len,
        eval_windows=n_eval, eval_tokens=int(windows[:, 1:].numel()), calibration_tokens=n_calib * calib_len,
        awq_grid=awq_grid, kv_cache_bytes_per_token=kv_bytes,
        text="pydoc_data.topics (CPython's help text): every 4th topic evaluates, the rest calibrate",
        rows=rows, outlier_threshold=THRESHOLD,
        outliers=count_activation_outliers(reference, windows[: max(1, n_eval // 2), None, :-1], THRESHOLD),
        grids=grid_comparison(reference, models["Q4_1 again (llama.cpp's grid)"], rtn32) if rtn32 is not None else {},
        note=("reference = the published SmolLM2-135M-Instruct weights (GGUF Q4_1) dequantized to fp32; "
              "embedding/lm_head (tied) stay fp32 in every weight-quantized variant; KL = KL(reference || variant) "
              "in nats per token"))


def _print(data: dict) -> None:
    print()
    print(quantization_smollm2_table(data))
    for label, g in data["grids"].items():
        print(f"re-quantizing the published weights, {label}: relative RMS change {g['relative_rms_change']:.2e}, "
              f"{100 * g['fraction_of_weights_changed']:.1f}% of weights changed")
    print(f"activations above {data['outlier_threshold']} (entries per layer, attn_in/attn_out/mlp_in/mlp_down):")
    for i, layer in enumerate(data["outliers"]):
        cells = (f"{k} {v['count']:6d} ({v['outlier_dims']:3d} dims, max {v['max_abs']:6.1f})"
                 for k, v in layer.items())
        print(f"  layer {i:2d}: " + "  ".join(cells))


COLORS = {"reference": "black", "cast": "gray", "rtn": "tab:blue", "fp8": "tab:purple", "llm_int8": "tab:brown",
          "q4_1": "tab:pink", "gptq": "tab:orange", "awq": "tab:green", "kv": "tab:cyan"}


def plot_quantization_smollm2(data: dict):
    """Quality against stored bytes, and LLM.int8() outlier dimensions per layer."""
    rows = data["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), gridspec_kw=dict(width_ratios=[1.2, 1]))
    floor = 1e-5
    ys = range(len(rows))
    ax1.barh(ys, [max(r["kl_to_reference"], floor) for r in rows], color=[COLORS[r["family"]] for r in rows])
    for y, r in zip(ys, rows):
        ax1.text(max(r["kl_to_reference"], floor) * 1.15, y, f"{r['model_bytes'] / 1e6:.0f} MB, "
                 f"{r['bits_per_byte']:.3f} bits/byte", va="center", fontsize=7)
    ax1.set_yticks(list(ys), [r["variant"] for r in rows], fontsize=8)
    ax1.invert_yaxis()
    ax1.set(xscale="log", xlim=(floor / 2, 30), xlabel=f"KL(reference || variant), nats/token ({floor:g} = identical)",
            title=f"{data['model']} on held-out English ({data['eval_tokens']} tokens)")
    ax1.grid(alpha=0.3, axis="x")
    layers = range(len(data["outliers"]))
    for kind, color in (("attn_in", "tab:blue"), ("attn_out", "tab:orange"), ("mlp_in", "tab:green"),
                        ("mlp_down", "tab:red")):
        ax2.plot(layers, [l[kind]["outlier_dims"] for l in data["outliers"]], "o-", color=color, label=kind, ms=3)
    ax2.set(xlabel="layer", ylabel=f"feature dims with any |x| > {data['outlier_threshold']:g}",
            title="LLM.int8() outlier dimensions entering each layer's linears")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig


BENCHMARK = bench_quantization_smollm2 = Benchmark("quantization_smollm2", measure, _print, parallel=True,
                                                   plots={"quantization_smollm2": plot_quantization_smollm2})
