"""`bench inference`'s workloads: the lecture's operating points, the sweep over concurrency, prompt and
output length, precision, KV layout and speculation (`SweepConfig`), one run's description (`RunSpec`) and
the engine options each run gets. Shared by the one-device sweep (inference.py) and the tensor-parallel
one (inference_tensor_parallel.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ... import _checks
from ..cpu_tuning import tune_for_cpu
from ...data.corpus import load_corpus
from ...data.real_text import pydoc_documents, token_stream
from ...device import default_dtype
from ...quantization.model import quantize_model
from ...serving.request import Request
from ...serving.workload import Workload
from .generation import int4_group

NAME = "inference"
PRECISIONS = ("fp32", "bf16", "int8", "int4")
KV_LAYOUTS = ("paged", "contiguous")
SPECULATIVE = ("off", "prompt_lookup", "draft")   # plain decoding, prompt lookup, the shipped draft model
SERVERS = ("engine", "one_at_a_time")
NEWLINE = 10   # the byte tokenizer's stop token for the toy model: an answer ends with its line
SPARSE_RATE = 1e-4   # arrivals far apart: each request runs alone (TTFT = prefill, no queueing); the
                     # engine jumps over idle gaps, so they cost no time (throughput means nothing there)
RANGED = ("output_throughput", "ttft_median_s", "tpot_median_s", "itl_median_s", "e2el_median_s")
BLOCK_SIZE = 16
GAMMA = 4      # drafts per target pass: near the best `bench speculative` measures on both models
ENDPOINT_AXES = ("preset", "concurrency", "prompt_len", "output_len")
DEFAULT_TOKENIZER = "smollm2-135m"   # a real BPE, for a server whose model is not one of ours


# --- what is swept ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """One point of the sweep: a `serving.Workload` at a precision, KV layout and speculative setting."""

    axis: str                          # which sweep it belongs to ("concurrency", "prompt_len", ...)
    workload: Workload
    precision: str = "fp32"
    kv_layout: str = "paged"
    speculative: str = "off"

    def __post_init__(self):
        _checks.one_of("precision", self.precision, PRECISIONS)
        _checks.one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        _checks.one_of("speculative", self.speculative, SPECULATIVE)


def workload_row(spec: RunSpec) -> dict:
    """The columns that say what a run served (the in-process and the endpoint benchmark's rows)."""
    w = spec.workload
    return {"axis": spec.axis, "workload": w.name, "precision": spec.precision, "concurrency": w.concurrency,
            "prompt_len_lo": w.prompt_len[0], "prompt_len_hi": w.prompt_len[1], "output_len": w.output_len,
            "num_requests": w.num_requests, "samples": w.samples, "workload_spec": dataclasses.asdict(w)}


def source_and_stop(tokenizer, real_model: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Held-out text as one token stream (the toy corpus's validation split, or CPython's help text)
    and the tokens an answer stops at."""
    if real_model:
        return token_stream(tokenizer, pydoc_documents("eval"), tokenizer.eos_id), tuple(tokenizer.stop_ids)
    return load_corpus("val"), (NEWLINE,)


def _toy_points() -> dict[str, Workload]:
    """Operating points for the shipped target (byte tokens, context 512)."""
    return {
        # A person waits for every token: requests trickle in, small batches, answers end naturally.
        "chat": Workload("chat", prompt_len=(32, 128), output_len=128, concurrency=8, num_requests=32, rate=40.0,
                         stop_at_eos=True, system_prompt_len=64, system_prompt_fraction=0.5, chat=True),
        # Nobody waits: every document is queued at once, long prompts, the biggest batch that fits.
        "batch": Workload("batch", prompt_len=(192, 320), output_len=64, concurrency=32, num_requests=64),
        # RL: many samples per prompt at temperature 1, long generations, the whole batch at once.
        "rollouts": Workload("rollouts", prompt_len=(32, 64), output_len=192, concurrency=32, num_requests=8,
                             samples=8, temperature=1.0, stop_at_eos=True),
    }


def _real_points() -> dict[str, Workload]:
    """The same three points sized for a ~135M-parameter model on a shared 2-core CPU."""
    return {
        "chat": Workload("chat", prompt_len=(16, 48), output_len=32, concurrency=4, num_requests=6, rate=2.0,
                         stop_at_eos=True, system_prompt_fraction=0.5, chat=True),
        "batch": Workload("batch", prompt_len=(128, 256), output_len=16, concurrency=8, num_requests=8),
        "rollouts": Workload("rollouts", prompt_len=(24, 48), output_len=32, concurrency=8, num_requests=2,
                             samples=4, temperature=1.0, stop_at_eos=True),
    }


OPERATING_POINTS = tuple(_toy_points())


def operating_points(real_model: bool, quick: bool = False) -> dict[str, Workload]:
    """The three presets for the toy target or a real model; quick: an eighth of the requests and tokens."""
    points = _real_points() if real_model else _toy_points()
    if quick:
        points = {k: w.replace(num_requests=max(2, w.num_requests // 8), output_len=max(4, w.output_len // 8))
                  for k, w in points.items()}
    return points


def check_preset(preset) -> str:
    return _checks.one_of("preset (one of the operating points)", preset, OPERATING_POINTS)


@dataclass(frozen=True)
class SweepConfig:
    """The axes of one `bench inference` run. Each axis varies one knob around a base workload and is
    crossed with every precision; the concurrency axis is the operating-point picture (throughput vs
    latency), the prompt-length axis serves one request at a time (TTFT = prefill)."""

    precisions: tuple[str, ...] = PRECISIONS
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    concurrency_base: Workload = Workload("concurrency", prompt_len=(128, 128), output_len=64, concurrency=1,
                                          num_requests=16)
    requests_per_slot: int = 2          # concurrency axis: num_requests = max(base, this x concurrency)
    prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 448)
    prompt_base: Workload = Workload("prompt_len", prompt_len=(16, 16), output_len=4, concurrency=1, num_requests=4,
                                     rate=SPARSE_RATE)
    output_lens: tuple[int, ...] = (1, 16, 64, 192)
    output_base: Workload = Workload("output_len", prompt_len=(64, 64), output_len=1, concurrency=8, num_requests=16)
    kv_layouts: tuple[str, ...] = KV_LAYOUTS   # compared on the chat operating point
    speculative: tuple[str, ...] = SPECULATIVE  # compared on the chat point, one request at a time (if > 1 mode)
    speculative_requests: int = 8       # chat requests served per speculative mode
    presets: dict = field(default_factory=_toy_points)
    warmup: Workload = Workload("warmup", prompt_len=(32, 64), output_len=8, concurrency=4, num_requests=4)
    quality_windows: tuple[int, int] = (256, 8)   # held-out windows for bits/byte and KL: (tokens, count)
    repeats: int = 3                    # each run this many times, rounds interleaved; the median run is kept

    def __post_init__(self):
        if not self.precisions:
            raise ValueError(f"precisions must name at least one of {PRECISIONS}, got {self.precisions!r}")
        for name, allowed in (("precisions", PRECISIONS), ("kv_layouts", KV_LAYOUTS), ("speculative", SPECULATIVE)):
            for value in getattr(self, name):
                _checks.one_of(f"{name}: each", value, allowed)
        for name in ("concurrencies", "output_lens", "prompt_lens"):
            for value in getattr(self, name):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name}: each must be an int >= 1, got {value!r}")
        for k in self.presets:
            check_preset(k)
        _checks.positive_int("repeats", self.repeats)

    def with_precisions(self, precisions: tuple[str, ...]) -> SweepConfig:
        """The same sweep over `precisions` (kept in the given order where this sweep has them)."""
        return dataclasses.replace(self, precisions=tuple(p for p in precisions if p in self.precisions))

    def runs(self, only_preset: str | None = None) -> list[RunSpec]:
        """Every run, in order: operating points x precisions, the chat point with the other KV layouts
        and speculative modes (base precision), then the concurrency, prompt-length and output-length
        axes x precisions. `only_preset`: just that operating point at every precision."""
        if only_preset is not None:
            return [RunSpec("preset", self.presets[check_preset(only_preset)], p) for p in self.precisions]
        base = self.precisions[0]
        out = [RunSpec("preset", w, p) for w in self.presets.values() for p in self.precisions]
        if (chat := self.presets.get("chat")) is not None:
            out += [RunSpec("kv_layout", chat, base, layout) for layout in self.kv_layouts if layout != "paged"]
            if len(self.speculative) > 1:   # one sequence at a time on the model's own (contiguous) cache
                alone = chat.replace(concurrency=1, rate=SPARSE_RATE,
                                     num_requests=min(chat.num_requests, self.speculative_requests))
                out += [RunSpec("speculative", alone, base, "contiguous", mode) for mode in self.speculative]
        c_base = self.concurrency_base
        for axis, workloads in (
                ("concurrency", [c_base.replace(concurrency=c, num_requests=max(
                    c_base.num_requests, self.requests_per_slot * c)) for c in self.concurrencies]),
                ("prompt_len", [self.prompt_base.replace(prompt_len=(n, n)) for n in self.prompt_lens]),
                ("output_len", [self.output_base.replace(output_len=n) for n in self.output_lens])):
            out += [RunSpec(axis, w, p) for p in self.precisions for w in workloads]
        return out


def sweep_config(real_model: bool, quick: bool = False) -> SweepConfig:
    """The sweep for the toy target or a real model (smaller: it decodes far slower on a CPU); quick: a
    smoke run of every axis."""
    if quick:
        return SweepConfig(precisions=("fp32", "bf16", "int4"), concurrencies=(1, 4),
                           concurrency_base=Workload("concurrency", (32, 32), 8, 1, 4), prompt_lens=(16, 64),
                           prompt_base=Workload("prompt_len", (16, 16), 2, 1, 2, rate=SPARSE_RATE),
                           output_lens=(1, 8), output_base=Workload("output_len", (32, 32), 1, 2, 4),
                           presets=operating_points(real_model, quick=True),
                           warmup=Workload("warmup", (16, 16), 2, 2, 2), quality_windows=(64, 2), repeats=1,
                           speculative=("off", "prompt_lookup") if real_model else SPECULATIVE,
                           speculative_requests=2)
    if real_model:
        return SweepConfig(concurrencies=(1, 2, 4, 8, 16), requests_per_slot=1,
                           concurrency_base=Workload("concurrency", (64, 64), 16, 1, 4),
                           prompt_lens=(32, 128, 512, 1024),
                           prompt_base=Workload("prompt_len", (32, 32), 2, 1, 2, rate=SPARSE_RATE),
                           output_lens=(1, 16), output_base=Workload("output_len", (64, 64), 1, 4, 4),
                           presets=operating_points(True), warmup=Workload("warmup", (16, 16), 2, 2, 2),
                           quality_windows=(256, 4), repeats=1, speculative=("off", "prompt_lookup"))
    return SweepConfig()


def check_arguments(model: str, preset, concurrency, output_len) -> None:
    """Refuse bad arguments before anything loads (each error names the argument and what is allowed)."""
    _checks.instance("model", model, str)
    if preset is not None:
        check_preset(preset)
    for name, value, why in (("concurrency", concurrency, "at least one sequence must run"),
                             ("output_len", output_len, "a request generates at least one token")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 ({why}), got {value!r}")
    if (concurrency is not None or output_len is not None) and preset is None:
        raise ValueError(f"concurrency / output_len override one operating point: give preset too "
                         f"(one of {list(OPERATING_POINTS)})")


# --- in process ------------------------------------------------------------------------------------

def precision_order(device: torch.device) -> tuple[str, ...]:
    """Every precision, the device's full-precision default first (fp32 on a CPU, bf16 on a GPU): the
    base for the KV-layout comparison and for the plots' ordering."""
    base = "bf16" if default_dtype(device) == torch.bfloat16 else "fp32"
    return (base,) + tuple(p for p in PRECISIONS if p != base)


def build_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """A copy of `model` (fp32) at `precision`, with fused projections and torch's fused attention:
    fp32 / bf16 weights, or weight-only int8 (per channel) / int4 (groups) on torch's packed kernels,
    quantized from the device's default dtype (fp32 on a CPU, bf16 on a GPU)."""
    _checks.one_of("precision", precision, PRECISIONS)
    fast = tune_for_cpu(copy.deepcopy(model).to(device).fuse_projections().set_attention_kernel("sdpa").eval())
    if precision in ("fp32", "bf16"):
        return fast.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    fast = fast.to(default_dtype(device))
    if precision == "int8":
        return quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True, kernel="packed")
    return quantize_model(fast, "rtn", bits=4, group_size=int4_group(fast.config), kernel="packed")


def engine_options(requests: list[Request], concurrency: int, kv_layout: str = "paged") -> dict:
    """The engine of a run: at most `concurrency` sequences, a pool that holds them all at their longest."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return dict(kv_layout=kv_layout, block_size=BLOCK_SIZE, max_num_seqs=concurrency,
                num_blocks=concurrency * math.ceil(longest / BLOCK_SIZE) + 1, watermark_blocks=0)
