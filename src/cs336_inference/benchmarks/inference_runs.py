"""One run of `bench inference`: build the model at a precision, make the workload's requests, serve
them with the serving `Engine`, and measure (vLLM's metrics, the time split, peak memory).

The request loop is the engine's: this module only prepares its inputs and reads its outputs.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from ..data.corpus import load_corpus
from ..data.real_text import bytes_per_token, pydoc_documents, token_stream
from ..device import default_dtype
from ..quantization.linear import model_nbytes
from ..quantization.model import quantize_model
from ..serving import Engine, TraceConfig, benchmark_metrics, make_chat_trace, make_trace
from ..serving.request import Request
from .inference_config import PRECISIONS, Workload
from .inference_speculative import serve_one_at_a_time
from .base import PeakMemory
from ..data.evaluation import compare_on_text

NEWLINE = 10   # the byte tokenizer's stop token for the toy model: an answer ends with its line
BLOCK_SIZE = 16
SYSTEM_PROMPT = ("You are a concise assistant for a course on language-model inference. Answer in one short "
                 "paragraph of plain English.")


def _group_size(model: nn.Module) -> int:
    """The largest int4 kernel group (128, 64, 32) dividing every quantized layer's input dimension."""
    c = model.config
    return next(g for g in (128, 64, 32) if c.d_model % g == 0 and c.d_ff % g == 0)


def build_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """A copy of `model` (fp32) that runs at `precision`, with fused projections and torch's fused
    attention: fp32 / bf16 weights, or weight-only int8 (per channel) / int4 (groups) with torch's
    packed kernels, quantized from the device's default dtype (fp32 on a CPU, bf16 on a GPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    fast = copy.deepcopy(model).to(device).fuse_projections().set_attention_kernel("sdpa").eval()
    if precision == "fp32":
        return fast.float()
    if precision == "bf16":
        return fast.to(torch.bfloat16)
    fast = fast.to(default_dtype(device))
    if precision == "int8":
        return quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True, kernel="packed")
    return quantize_model(fast, "rtn", bits=4, group_size=_group_size(fast), kernel="packed")


def source_tokens(tokenizer, real_model: bool) -> torch.Tensor:
    """Held-out text as one token stream: the toy corpus's validation split, or CPython's help text."""
    if real_model:
        return token_stream(tokenizer, pydoc_documents("eval"), tokenizer.eos_id)
    return load_corpus("val")


def stop_tokens(tokenizer, real_model: bool) -> tuple[int, ...]:
    return tuple(tokenizer.stop_ids) if real_model else (NEWLINE,)


def make_requests(workload: Workload, source: list[int], tokenizer=None,
                  stop: tuple[int, ...] = ()) -> list[Request]:
    """The workload's trace (serving.make_trace / make_chat_trace), deterministic in workload.seed.
    Prompts are slices of `source` (a list of token ids: a tensor would be converted on every call); a
    chat workload on a tokenizer with a chat template formats each as a user message (half of them
    behind SYSTEM_PROMPT); stop tokens apply only if stop_at_eos."""
    sampled = workload.samples > 1 or workload.temperature > 0
    config = TraceConfig(num_requests=workload.num_requests, rate=workload.rate, prompt_len=workload.prompt_len,
                         max_new_tokens=workload.output_len, stop_tokens=stop if workload.stop_at_eos else (),
                         system_prompt_fraction=workload.system_prompt_fraction,
                         sampled_fraction=1.0 if sampled else 0.0, n_samples=workload.samples,
                         temperature=workload.temperature if workload.temperature > 0 else 1.0, seed=workload.seed)
    if workload.chat and getattr(tokenizer, "chat_template", None):
        return make_chat_trace(tokenizer, source, config, SYSTEM_PROMPT,
                               instruction="Explain what this text is about in a short paragraph.")
    offset = workload.system_prompt_len
    return make_trace(source[offset:], config, system_prompt=list(source[:offset]))


def pool_blocks(requests: list[Request], concurrency: int, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks for `concurrency` sequences of the trace's longest (prompt + max_new_tokens)."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return concurrency * math.ceil(longest / block_size) + 1


SERVERS = ("engine", "one_at_a_time")


def run_benchmark(model: nn.Module, requests: list[Request], concurrency: int, kv_layout: str = "paged",
                  device: torch.device | None = None, server: str = "engine", draft=None) -> tuple[dict, list]:
    """Serve `requests` and measure the run: vLLM's metrics (see serving.metrics.benchmark_metrics), the
    queueing/prefill/decode split, KV and weight bytes, and the peak memory (`PeakMemory`).
    server "engine": the serving Engine, at most `concurrency` sequences at once in `kv_layout` memory.
    server "one_at_a_time": one sequence at a time on the model's own contiguous cache, plainly or with
    speculative decoding from `draft` (a TransformerLM or "prompt_lookup"; see inference_speculative).
    Returns (one flat row of the sweep, the RequestOutputs)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1 (at least one sequence runs), got {concurrency!r}")
    if not requests:
        raise ValueError("requests is empty: nothing to serve")
    if server not in SERVERS:
        raise ValueError(f"server must be one of {SERVERS}, got {server!r}")
    one_at_a_time = server == "one_at_a_time"
    if one_at_a_time and (concurrency != 1 or kv_layout != "contiguous"):
        raise ValueError(f"server 'one_at_a_time' runs one sequence on the model's contiguous cache: concurrency "
                         f"must be 1 and kv_layout 'contiguous', got {concurrency!r} and {kv_layout!r}")
    if draft is not None and not one_at_a_time:
        raise ValueError("draft (speculative decoding) needs server='one_at_a_time': the engine does not draft")
    device = torch.device(device) if device is not None else model.device
    with PeakMemory(device) as peak:
        if one_at_a_time:
            outputs, stats = serve_one_at_a_time(model, requests, draft)
            result = None
        else:
            engine = Engine(model, kv_layout=kv_layout, block_size=BLOCK_SIZE, max_num_seqs=concurrency,
                            num_blocks=pool_blocks(requests, concurrency), watermark_blocks=0)
            result = engine.run(requests)
            outputs, stats = result.outputs, {}
    metrics = benchmark_metrics(outputs)
    row = {**flatten_metrics(metrics), **peak.result(), "weight_bytes": model_nbytes(model), "communication_s": 0.0,
           "server": server}
    if result is not None:
        summary = result.summary()
        row.update({"kv_pool_bytes": result.capacity_tokens * result.bytes_per_token,
                    "kv_peak_reserved_bytes": summary["peak_reserved_bytes"],
                    "kv_waste_fraction": summary["kv_waste_fraction"],
                    "kv_shared_fraction": summary["kv_shared_fraction"], "max_running": summary["max_running"],
                    "steps": summary["steps"], "preemptions": summary["preemptions"],
                    "cached_prompt_tokens": summary["cached_prompt_tokens"]})
    else:
        row.update({f"spec_{k}": v for k, v in stats.items()})
    return row, outputs


def flatten_metrics(metrics: dict) -> dict:
    """{"ttft": {"mean": .., "median": .., "p99": ..}} -> {"ttft_mean_s": .., "ttft_median_s": .., ...}."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update({f"{key}_{stat}_s": v for stat, v in value.items()})
        else:
            out[key] = value
    return out


def quality_windows(source: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` consecutive non-overlapping windows of seq_len + 1 tokens from the end of `source`
    (prompts are cut from anywhere; the quality text is the same for every precision)."""
    need = count * (seq_len + 1)
    if source.numel() < need:
        raise ValueError(f"source has {source.numel()} tokens, the quality check needs {need}")
    return source[-need:].view(count, seq_len + 1)


def quality_vs_reference(models: dict[str, nn.Module], reference: nn.Module, windows: torch.Tensor,
                         tokenizer) -> dict[str, dict]:
    """Bits per byte of each model on the windows, KL(reference || model) and top-1 agreement per token
    (`bench quantization_smollm2`'s `compare_on_text`): each precision's regression against fp32."""
    out = compare_on_text(models, reference, windows, bytes_per_token(tokenizer))
    return {name: {"bits_per_byte": r["bits_per_byte"], "kl_to_fp32": r["kl_to_reference"],
                   "top1_agreement": r["top1_agreement"], "tokens": r["tokens"]} for name, r in out.items()}


__all__ = ["SERVERS", "build_precision", "flatten_metrics", "make_requests", "pool_blocks",
           "quality_vs_reference", "quality_windows", "run_benchmark", "source_tokens", "stop_tokens"]
