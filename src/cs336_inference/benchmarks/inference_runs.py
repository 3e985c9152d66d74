"""One run of `bench inference`: build the model at a precision, make the workload's requests, serve
them, and measure (vLLM's metrics, the time split, peak memory).

Two servers. "engine": the serving `Engine` (continuous batching, paged or contiguous KV); this module
only prepares its inputs and reads its outputs. "one_at_a_time": one sequence at a time on the
model's own contiguous cache, plainly (`generate`) or with speculative decoding (prompt lookup or a
draft model): speculative decoding decodes one sequence, a latency technique the engine does not
use. Each of its tokens gets the time its pass finished (the tokens of one pass arrive together, one
chunk for ITL, as a stream delivers them); the clock jumps over idle gaps like the engine's.
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn as nn

from ..cpu_tuning import tune_for_cpu
from ..data.corpus import load_corpus
from ..data.evaluation import compare_on_text
from ..data.real_text import bytes_per_token, pydoc_documents, token_stream
from ..device import default_dtype
from ..generation.generate import generate
from ..generation.speculative import SpeculativeDecoder
from ..quantization.linear import model_nbytes
from ..quantization.model import quantize_model
from ..serving import Engine, TraceConfig, benchmark_metrics, make_chat_trace, make_trace
from ..serving.request import Request, RequestRecord
from ..timing import sync_device
from .base import PeakMemory
from .inference_config import PRECISIONS, Workload

NEWLINE = 10   # the byte tokenizer's stop token for the toy model: an answer ends with its line
BLOCK_SIZE = 16
GAMMA = 4      # drafts per target pass: near the best `bench speculative` measures on both models
SERVERS = ("engine", "one_at_a_time")
SYSTEM_PROMPT = ("You are a concise assistant for a course on language-model inference. Answer in one short "
                 "paragraph of plain English.")


def build_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """A copy of `model` (fp32) that runs at `precision`, with fused projections and torch's fused
    attention: fp32 / bf16 weights, or weight-only int8 (per channel) / int4 (groups) with torch's
    packed kernels, quantized from the device's default dtype (fp32 on a CPU, bf16 on a GPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    fast = tune_for_cpu(copy.deepcopy(model).to(device).fuse_projections().set_attention_kernel("sdpa").eval())
    if precision in ("fp32", "bf16"):
        return fast.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    fast = fast.to(default_dtype(device))
    if precision == "int8":
        return quantize_model(fast, "rtn", bits=8, group_size=None, symmetric=True, kernel="packed")
    c = fast.config   # the largest int4 kernel group dividing every quantized layer's input dimension
    group = next(g for g in (128, 64, 32) if c.d_model % g == 0 and c.d_ff % g == 0)
    return quantize_model(fast, "rtn", bits=4, group_size=group, kernel="packed")


def source_tokens(tokenizer, real_model: bool) -> torch.Tensor:
    """Held-out text as one token stream: the toy corpus's validation split, or CPython's help text."""
    return token_stream(tokenizer, pydoc_documents("eval"), tokenizer.eos_id) if real_model else load_corpus("val")


def stop_tokens(tokenizer, real_model: bool) -> tuple[int, ...]:
    return tuple(tokenizer.stop_ids) if real_model else (NEWLINE,)


def make_requests(workload: Workload, source: list[int], tokenizer=None, stop: tuple[int, ...] = ()) -> list[Request]:
    """The workload's trace (serving.make_trace / make_chat_trace), deterministic in workload.seed.
    Prompts are slices of `source` (a list: a tensor would be converted on every call); a chat workload
    on a tokenizer with a chat template formats each as a user message (half of them behind
    SYSTEM_PROMPT); stop tokens apply only if stop_at_eos."""
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


def run_benchmark(model: nn.Module, requests: list[Request], concurrency: int, kv_layout: str = "paged",
                  device: torch.device | None = None, server: str = "engine", draft=None) -> tuple[dict, list]:
    """Serve `requests` on `server` (see the module docstring; the engine runs at most `concurrency`
    sequences in `kv_layout` memory; `draft`: speculative decoding from a TransformerLM or
    "prompt_lookup") and measure the run: vLLM's metrics (`serving.metrics.benchmark_metrics`), the
    queueing/prefill/decode split, KV and weight bytes, the peak memory. Returns (one flat row, the
    RequestRecords)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1 (at least one sequence runs), got {concurrency!r}")
    if not requests:
        raise ValueError("requests is empty: nothing to serve")
    if server not in SERVERS:
        raise ValueError(f"server must be one of {SERVERS}, got {server!r}")
    alone = server == "one_at_a_time"
    if alone and (concurrency != 1 or kv_layout != "contiguous"):
        raise ValueError(f"server 'one_at_a_time' runs one sequence on the model's contiguous cache: concurrency "
                         f"must be 1 and kv_layout 'contiguous', got {concurrency!r} and {kv_layout!r}")
    if draft is not None and not alone:
        raise ValueError("draft (speculative decoding) needs server='one_at_a_time': the engine does not draft")
    with PeakMemory(device if device is not None else model.device) as peak:
        if alone:
            outputs, stats = serve_one_at_a_time(model, requests, draft)
        else:
            longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
            engine = Engine(model, kv_layout=kv_layout, block_size=BLOCK_SIZE, max_num_seqs=concurrency,
                            num_blocks=concurrency * math.ceil(longest / BLOCK_SIZE) + 1, watermark_blocks=0)
            result = engine.run(requests)
            outputs = result.outputs
    row = {**flatten_metrics(benchmark_metrics(outputs)), **peak.result(), "weight_bytes": model_nbytes(model),
           "communication_s": 0.0, "server": server}   # one device: no multi-device path in this package
    if alone:
        return row | {f"spec_{k}": v for k, v in stats.items()}, outputs
    s = result.summary()
    return row | {"kv_pool_bytes": result.capacity_tokens * result.bytes_per_token,
                  "kv_peak_reserved_bytes": s["peak_reserved_bytes"], **{k: s[k] for k in (
                      "kv_waste_fraction", "kv_shared_fraction", "max_running", "steps", "preemptions",
                      "cached_prompt_tokens")}}, outputs


def flatten_metrics(metrics: dict) -> dict:
    """{"ttft": {"mean": .., "median": .., "p99": ..}} -> {"ttft_mean_s": .., "ttft_median_s": .., ...}."""
    out = {}
    for key, value in metrics.items():
        out.update({f"{key}_{stat}_s": v for stat, v in value.items()} if isinstance(value, dict) else {key: value})
    return out


def serve_one_at_a_time(target, requests: list[Request], draft=None, gamma: int = GAMMA) -> tuple[list, dict]:
    """Serve `requests` in arrival order, one sequence at a time (the samples of an n > 1 request one
    after the other), plainly (`draft=None`) or speculatively. Returns the RequestRecords (in the given
    order, engine-clock times) and the drafting statistics: target passes, drafts proposed and
    accepted, tokens per pass."""
    now, outputs, stats = 0.0, {}, {"passes": 0, "proposed": 0, "accepted": 0}
    for request in sorted(requests, key=lambda r: r.arrival_time):
        start = now = max(now, request.arrival_time)
        tokens, times, reasons = [], [], []
        for sample in range(request.sampling.n):
            out, t, reason, counts = _one_sequence(target, draft, gamma, request, sample)
            tokens.append(out)
            times.append([now + x for x in t])
            reasons.append(reason)
            now = times[-1][-1] if times[-1] else now
            for k, v in counts.items():
                stats[k] += v
        outputs[request.request_id] = RequestRecord(
            request_id=request.request_id, prompt_len=len(request.prompt), arrival_time=request.arrival_time,
            tokens=tokens, token_times=times, finish_reasons=reasons, first_scheduled_time=start, finish_time=now)
    if draft is not None and stats["passes"]:   # the first token of each sample is the prefill's
        generated = sum(len(t) for o in outputs.values() for t in o.tokens) - sum(r.sampling.n for r in requests)
        stats["tokens_per_pass"] = generated / stats["passes"]
        stats["draft_acceptance_rate"] = stats["accepted"] / stats["proposed"] if stats["proposed"] else None
    return [outputs[r.request_id] for r in requests], {"gamma": gamma if draft is not None else None, **stats}


def _one_sequence(target, draft, gamma: int, request: Request, sample: int) -> tuple[list, list, str, dict]:
    """One sample of `request`: its tokens, their times after the call started, the finish reason and
    the drafting counts (plain `generate` when draft is None; else each pass is timed)."""
    p = request.sampling
    gen = None if p.temperature == 0 or p.seed is None else torch.Generator().manual_seed(p.seed + sample)
    if draft is None:
        out = generate(target, [list(request.prompt)], request.max_new_tokens, p.temperature, p.top_k, p.top_p,
                       p.stop_token_ids or None, gen)
        return out.tokens[0], out.token_times[:len(out.tokens[0])], out.finish_reasons[0], {}
    t0 = time.perf_counter()
    decoder = SpeculativeDecoder(target, draft, [list(request.prompt)], gamma, p.temperature, request.max_new_tokens,
                                 p.top_k, p.top_p, p.stop_token_ids or None, gen)
    sync_device(target.device)
    times = [time.perf_counter() - t0] * len(decoder.result.tokens)       # the first token, from the prefill
    while not decoder.finished:
        before = len(decoder.result.tokens)
        decoder.step()
        sync_device(target.device)
        times += [time.perf_counter() - t0] * (len(decoder.result.tokens) - before)
    r = decoder.finish()
    return r.tokens, times, r.finish_reason, {"passes": len(r.accepted), "proposed": sum(r.proposed),
                                              "accepted": sum(r.accepted)}


def quality_windows(source: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` consecutive non-overlapping windows of seq_len + 1 tokens from the end of `source`
    (prompts are cut from anywhere; the quality text is the same for every precision)."""
    need = count * (seq_len + 1)
    if source.numel() < need:
        raise ValueError(f"source has {source.numel()} tokens, the quality check needs {need}")
    return source[-need:].view(count, seq_len + 1)


def quality_vs_reference(models: dict[str, nn.Module], reference: nn.Module, windows: torch.Tensor,
                         tokenizer) -> dict[str, dict]:
    """Bits per byte of each model on the windows, KL(reference || model) and top-1 agreement per
    token: each precision's regression against fp32."""
    out = compare_on_text(models, reference, windows, bytes_per_token(tokenizer))
    return {name: {"bits_per_byte": r["bits_per_byte"], "kl_to_fp32": r["kl_to_reference"],
                   "top1_agreement": r["top1_agreement"], "tokens": r["tokens"]} for name, r in out.items()}


__all__ = ["GAMMA", "SERVERS", "build_precision", "flatten_metrics", "make_requests", "quality_vs_reference",
           "quality_windows", "run_benchmark", "serve_one_at_a_time", "source_tokens", "stop_tokens"]
