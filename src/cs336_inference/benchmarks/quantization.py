"""`bench quantization`: every quantization method on the shipped target: true bytes, validation bits
per byte, KL and top-1 agreement to fp32, and batch-1 decode speed (interleaved rounds, medians).

Each layer runs its default kernel (torch's packed int4/int8 kernels where the layout fits, the
dequantize-then-matmul reference elsewhere, e.g. int3; each row says which). The 2M-parameter target
fits in the CPU caches, so its decode step is per-op overhead and its tokens/s say little about
bytes: `bench generation` measures what fewer bytes buy on a model that streams its weights.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial

import torch
import torch.nn as nn

from ..accounting.model_roofline import decode_step_seconds
from ..data.corpus import load_corpus
from ..data.evaluation import compare_on_text
from ..model.checkpoints import load_pretrained
from ..quantization.kv import quantize_kv_cache
from ..quantization.linear import QuantizedLinear, model_nbytes
from ..quantization.model import quantize_model
from ..tables import print_table
from .base import Benchmark, alternate


def _group_for(model, wanted: int) -> int:
    """The largest divisor of every linear input dim that is <= wanted."""
    common = math.gcd(*(m.in_features for m in model.layers.modules() if isinstance(m, nn.Linear)))
    return max(g for g in range(1, min(wanted, common) + 1) if common % g == 0)


class WithQuantizedKV(nn.Module):
    """Runs `model` through a fresh int8 KV cache on every call, so full-sequence evaluation sees the
    keys and values exactly as a decode with that cache would (attention reads them back from it)."""

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
    starts = torch.linspace(0, train.numel() - calib_len - 1, n_calib).long().tolist()
    calibration = [torch.stack([train[s:s + calib_len] for s in starts])]   # (n, T), evenly spaced
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
    import matplotlib.pyplot as plt

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
    ax1.set_yscale("log")
    ax1.set_xlabel("model MB (measured: packed codes + scales + zero points + fp32 embedding/lm_head)")
    ax1.set_ylabel("KL(fp32 || quantized), nats/token (fp32 drawn at 1e-5)")
    ax1.set_title(f"Quality vs size: {result['model']} ({result['parameters'] / 1e6:.1f}M params)")
    ax1.grid(alpha=0.3)
    timed = [r for r in rows if "decode_tok_per_s" in r]
    ax2.barh([r["variant"] for r in timed], [r["decode_tok_per_s"] for r in timed],
             color=[colors[r["method"]] for r in timed])
    ax2.invert_yaxis()
    ax2.set_xlabel(f"decode tokens/s, batch 1 ({result['device']}, shared machine)")
    ax2.set_title("Decode speed of the (cache-resident) target model")
    fig.tight_layout()
    return fig


BENCHMARK = bench_quantization = Benchmark("quantization", measure, print_tables,
                                           plots={"quantization": plot_quantization})
