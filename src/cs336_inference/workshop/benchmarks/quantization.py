"""`bench quantization` and `bench quantization_smollm2`: every quantization method, against full precision.

Per variant: its true stored bytes, bits per byte of held-out text, KL and top-1 agreement to the
unquantized model. `bench quantization` runs the shipped target (each layer on its default kernel:
torch's packed int4/int8 kernels where the layout fits, the dequantize-then-matmul reference
elsewhere) and times batch-1 decode; the target fits in the CPU caches, so its decode step is per-op
overhead (`bench generation` measures what fewer bytes buy). `bench quantization_smollm2` runs
SmolLM2-135M on CPython's documentation (`data.real_text`): its published weights are already 4-bit
(GGUF Q4_1), so it also compares re-quantizing on llama.cpp's grid with ours, and counts the
activations above LLM.int8()'s outlier threshold (Dettmers et al. 2022).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

from ...accounting.model_roofline import decode_step_seconds
from ..cpu_tuning import tune_for_cpu
from ...data.corpus import load_corpus
from ...data.evaluation import compare_on_text
from ...data.real_text import bytes_per_token, pydoc_documents, token_stream
from ...model import load_pretrained, load_tokenizer
from ...model.gguf import gguf_round_trip
from ...quantization.kv import quantize_kv_cache
from ...quantization.linear import QuantizedLinear, model_nbytes
from ...quantization.llm_int8 import count_activation_outliers
from ...quantization.model import quantize_model
from ...tables import print_table, quantization_smollm2_table
from .base import Benchmark, alternate

MODEL = "smollm2-135m"
THRESHOLD = 6.0
G = 96  # SmolLM2's stand-in for g128: the largest group <= 128 dividing both D = 576 and F = 1536


def _group_for(model, wanted: int) -> int:
    """The largest divisor of every linear input dim that is <= wanted."""
    common = math.gcd(*(m.in_features for m in model.layers.modules() if isinstance(m, nn.Linear)))
    return max(g for g in range(1, min(wanted, common) + 1) if common % g == 0)


def calibration_batch(stream: torch.Tensor, n: int, length: int) -> list[torch.Tensor]:
    """[(n, length)]: `n` windows of `length` tokens, evenly spaced over `stream` (quantize_model's calibration)."""
    starts = torch.linspace(0, stream.numel() - length - 1, n).long().tolist()
    return [torch.stack([stream[s:s + length] for s in starts])]


class WithQuantizedKV(nn.Module):
    """`model` through a fresh quantized KV cache on every call: full-sequence evaluation then sees the
    keys and values as a decode with that cache would (attention reads them back from it)."""

    def __init__(self, model: nn.Module, fmt: str = "int8"):
        super().__init__()
        self.model, self.fmt, self.config = model, fmt, model.config

    @property
    def device(self):
        return self.model.device

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        cache = quantize_kv_cache(self.model.new_cache(token_ids.shape[0], token_ids.shape[1]), self.fmt)
        return self.model(token_ids, cache=cache)


def variants(group: int | None, small_group: int | None) -> list[tuple[str, dict | None]]:
    """(label, quantize_model kwargs) for every row of the table; None is the fp32 baseline."""
    g, gs = group, small_group
    return [
        ("fp32", None),
        ("int8 per-channel", dict(method="rtn", bits=8, group_size=None, symmetric=True)),
        ("int8 LLM.int8()", dict(method="llm_int8", bits=8, group_size=None)),
        ("fp8 e4m3", dict(method="fp8", bits=8, group_size=None)),
        (f"int4 RTN g{g}", dict(method="rtn", bits=4, group_size=g)),
        (f"int4 RTN g{gs}", dict(method="rtn", bits=4, group_size=gs)),
        (f"int4 GPTQ g{g}", dict(method="gptq", bits=4, group_size=g)),
        (f"int4 AWQ g{g}", dict(method="awq", bits=4, group_size=g)),
        (f"int4 QAT g{g}", dict(method="qat", bits=4, group_size=g)),
        (f"int3 RTN g{g}", dict(method="rtn", bits=3, group_size=g)),
        (f"int3 GPTQ g{g}", dict(method="gptq", bits=3, group_size=g)),
        (f"int3 AWQ g{g}", dict(method="awq", bits=3, group_size=g)),
        (f"int3 QAT g{g}", dict(method="qat", bits=3, group_size=g)),
    ]


def measure(run) -> dict:
    """Every row of `variants` on the shipped target: bytes, quality against fp32, decode speed."""
    quick = run.quick
    model = load_pretrained("target", device=run.device).eval()
    seq_len = min(512, model.config.context_length)   # the target records its val loss at 512
    val, train = load_corpus("val"), load_corpus("train")
    n_calib, calib_len, n_eval, qat_steps = (8, 128, 8, 20) if quick else (32, 256, 32, 50)
    calibration = calibration_batch(train, n_calib, calib_len)
    qat = dict(calibration=[train[: 400_000]], qat_steps=qat_steps, qat_seq_len=128, qat_lr=2e-4)  # fine-tune stream
    group, small_group = _group_for(model, 128), _group_for(model, 32)
    rows, models = [], {}
    for label, kwargs in variants(group, small_group):
        t0 = time.perf_counter()
        models[label] = qm = model if kwargs is None else quantize_model(
            model, **kwargs, **(qat if kwargs["method"] == "qat" else dict(calibration=calibration)))
        seconds = time.perf_counter() - t0
        print(f"quantized {label:<22} in {seconds:6.1f} s", flush=True)
        kernels = sorted({"packed" if m.packed_weight(m.qweight.device) is not None else "reference"
                          for m in qm.modules() if isinstance(m, QuantizedLinear)})
        rows.append(dict(variant=label, kernel="+".join(kernels) or "-", method=(kwargs or {}).get("method", "none"),
                         bits=(kwargs or {}).get("bits", 32), group_size=(kwargs or {}).get("group_size"),
                         model_bytes=model_nbytes(qm), quantize_seconds=seconds))
    models["fp32 + int8 KV cache"] = WithQuantizedKV(model)
    rows.append(dict(variant="fp32 + int8 KV cache", method="kv_int8", bits=32, group_size=None,
                     model_bytes=model_nbytes(model), quantize_seconds=0.0))
    # bits per byte (a byte per token) and agreement with fp32 on the first validation windows
    windows = val[: n_eval * seq_len + 1].unfold(0, seq_len + 1, seq_len)           # (n_eval, seq_len + 1)
    quality = compare_on_text(models, model, windows, torch.ones(model.config.vocab_size))
    for row in rows:
        q = quality[row["variant"]]
        row.update(val_bits_per_byte=q["bits_per_byte"], kl_to_fp32=q["kl_to_reference"],
                   top1_agreement=q["top1_agreement"],
                   delta_bits_per_byte=q["bits_per_byte"] - quality["fp32"]["bits_per_byte"],
                   bytes_ratio_vs_fp32=rows[0]["model_bytes"] / row["model_bytes"])
    # decode speed: variants interleaved over rounds, so drifting machine load hits them alike
    rounds, steps = (2, 8) if quick else (3, 16)
    timed = [r for r in rows if r["method"] != "kv_int8"]
    times = alternate({r["variant"]: partial(decode_step_seconds, models[r["variant"]], 1, 32, steps)
                       for r in timed}, rounds)
    for r in timed:
        r["decode_tok_per_s"] = 1.0 / statistics.median(times[r["variant"]])
        r["decode_speed_vs_fp32"] = statistics.median(times["fp32"]) / statistics.median(times[r["variant"]])
    kv = dict(fp32_bytes_per_token=model.new_cache(1, seq_len).bytes_per_token,
              int8_bytes_per_token=quantize_kv_cache(model.new_cache(1, seq_len)).bytes_per_token)
    return dict(model="target", device=str(run.device), threads=torch.get_num_threads(),
                parameters=sum(p.numel() for p in model.parameters()), config=model.config.to_dict(), seq_len=seq_len,
                eval_tokens=int(windows[:, 1:].numel()), calibration_tokens=n_calib * calib_len, qat_steps=qat_steps,
                group_size=group, small_group_size=small_group, kv_cache=kv, rows=rows,
                note=("decode tok/s measured batch 1 on a shared CPU (medians of interleaved rounds) on a model "
                      "that fits in cache: per-op overhead, not bytes; see bench generation for the speed-up"))


def print_tables(result: dict) -> None:
    print_table(result["rows"], [
        ("variant", "variant", None), ("kernel", "kernel", None), ("model_bytes", "bytes", "{:,}"),
        ("bytes_ratio_vs_fp32", "ratio", "{:.2f}x"), ("val_bits_per_byte", "bpb", "{:.4f}"),
        ("delta_bits_per_byte", "d bpb", "{:+.4f}"), ("kl_to_fp32", "KL", "{:.4f}"),
        ("top1_agreement", "top1", "{:.3f}"), ("decode_tok_per_s", "tok/s", "{:.0f}"),
        ("quantize_seconds", "quant s", "{:.1f}")])
    kv = result["kv_cache"]
    print(f"\nKV cache bytes per token: fp32 {kv['fp32_bytes_per_token']}, int8 {kv['int8_bytes_per_token']}")


def plot_quantization(result: dict):
    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"none": "black", "rtn": "tab:blue", "gptq": "tab:orange", "awq": "tab:green", "qat": "tab:red",
              "fp8": "tab:purple", "llm_int8": "tab:brown", "kv_int8": "tab:gray"}
    markers = {32: "*", 8: "o", 4: "s", 3: "^"}
    for r in rows:
        if r["method"] == "kv_int8":
            continue
        # KL(fp32 || quantized) separates the methods far better than bpb deltas of a few 1e-3
        # hollow markers: methods of one size and bit width land on top of each other
        ax1.scatter(r["model_bytes"] / 1e6, max(r["kl_to_fp32"], 1e-5), facecolors="none", linewidths=1.6,
                    edgecolors=colors[r["method"]], marker=markers.get(r["bits"], "o"), s=90 if r["bits"] == 32 else 60)
    for method, color in colors.items():
        if any(r["method"] == method for r in rows) and method != "kv_int8":
            ax1.scatter([], [], color=color, label={"none": "fp32", "llm_int8": "LLM.int8()"}.get(method, method))
    for bits, marker in markers.items():
        ax1.scatter([], [], color="gray", marker=marker, label=f"{bits} bits")
    ax1.legend(fontsize=8, ncol=2)
    ax1.set(yscale="log", xlabel="model MB (measured: packed codes + scales + zero points + fp32 embedding/lm_head)",
            ylabel="KL(fp32 || quantized), nats/token (fp32 drawn at 1e-5)",
            title=f"Quality vs size: {result['model']} ({result['parameters'] / 1e6:.1f}M params)")
    ax1.grid(alpha=0.3)
    timed = [r for r in rows if "decode_tok_per_s" in r]
    ax2.barh([r["variant"] for r in timed], [r["decode_tok_per_s"] for r in timed],
             color=[colors[r["method"]] for r in timed])
    ax2.invert_yaxis()
    ax2.set(xlabel=f"decode tokens/s, batch 1 ({result['device']}, shared machine)",
            title="Decode speed of the (cache-resident) target model")
    fig.tight_layout()
    return fig


BENCHMARK = bench_quantization = Benchmark("quantization", measure, print_tables,
                                           plots={"quantization": plot_quantization})


# --- bench quantization_smollm2 ---------------------------------------------------------------------

def requantize_q4_1(model: nn.Module) -> nn.Module:
    """A copy whose block linears went through llama.cpp's Q4_1 quantizer again."""
    q = copy.deepcopy(model)
    with torch.no_grad():
        for m in q.layers.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(gguf_round_trip(m.weight, "Q4_1"))
    return q


def smollm2_variants(quick: bool) -> list[tuple[str, str, dict | None]]:
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
    if kwargs is None:
        return model
    special = kwargs.get("special")
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


def measure_smollm2(run) -> dict:
    quick, device = run.quick, run.device
    reference = tune_for_cpu(load_pretrained(MODEL, device=device, dtype=torch.float32).set_attention_kernel("sdpa"))
    tokenizer = load_tokenizer(MODEL)
    eos = tokenizer.special_to_id["<|endoftext|>"]
    seq_len, n_eval, n_calib, calib_len, awq_grid = (256, 2, 4, 128, 5) if quick else (512, 8, 16, 256, 20)
    evaluation = token_stream(tokenizer, pydoc_documents("eval"), eos)
    calib_stream = token_stream(tokenizer, pydoc_documents("calibration"), eos)
    windows = evaluation[: n_eval * (seq_len + 1)].view(n_eval, seq_len + 1)    # consecutive, non-overlapping
    calibration = calibration_batch(calib_stream, n_calib, calib_len)
    print(f"{MODEL} on {device} ({torch.get_num_threads()} threads): "
          f"eval {n_eval} x {seq_len} tokens of pydoc text, calibration {n_calib} x {calib_len}")

    rows, models = [], {}
    for label, family, kwargs in smollm2_variants(quick):
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


def print_smollm2(data: dict) -> None:
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


bench_quantization_smollm2 = Benchmark("quantization_smollm2", measure_smollm2, print_smollm2, parallel=True,
                                       plots={"quantization_smollm2": plot_quantization_smollm2})
