"""A real model on the measured roofline: time a prefill and a decode step of a `TransformerLM` and
predict each from its FLOPs and bytes (`formulas`) on this machine's measured roofs (`roofline`).

Used by `bench roofline` and notebook 01; the lecture's claim is that decode is memory-bound, so its
time should be close to bytes / bandwidth. Also the step timers the decode benchmarks share, and the
weight bytes a decode step of a (possibly quantized) model reads.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..generation.generate import decode_one_token
from ..model.transformer import TransformerLM
from ..timing import median_seconds
from .formulas import decode_step_bytes, forward_flops
from .roofline import HardwareMeasurement, RooflineSweep, _element_size

PRECISION_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@torch.inference_mode()
def measure_prefill(model: TransformerLM, prompt_len: int, hardware: HardwareMeasurement, repeats: int = 3) -> dict:
    """Time one prefill of a random prompt (B = 1) and predict it: max(FLOPs / peak, bytes / bandwidth)."""
    cfg, precision = model.config, PRECISION_OF[model.dtype]
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=model.device)
    caches = [model.new_cache(1, prompt_len) for _ in range(repeats + 2)]
    seconds = median_seconds(lambda: model(ids, cache=caches.pop(), last_only=True), model.device, repeats)
    flops = forward_flops(cfg, 1, prompt_len, 0, last_only=True)
    nbytes = decode_step_bytes(cfg, 1, prompt_len, precision)
    predicted = max(flops / hardware.peak_flops, nbytes / hardware.memory_bandwidth)
    return dict(prompt_len=prompt_len, seconds=seconds, seconds_per_token=seconds / prompt_len, flops=flops,
                achieved_flops=flops / seconds, predicted_seconds=predicted)


@torch.inference_mode()
def measure_decode(model: TransformerLM, batch_size: int, context_len: int, hardware: HardwareMeasurement,
                   repeats: int = 5) -> dict:
    """Time one decode step of B sequences at context S and predict it from bytes and FLOPs.

    The cache is marked as holding S tokens without running a prefill (its contents do not change
    the time, and a B = 64 prefill would cost minutes on a CPU); after each timed step it is
    truncated back to S so every repeat reads the same S + 1 positions.
    """
    cfg, precision = model.config, PRECISION_OF[model.dtype]
    cache = model.new_cache(batch_size, context_len + 1)
    cache.length = context_len  # pretend S tokens are cached (global attention: nothing else to set)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, 1), device=model.device)

    def step():
        model(ids, cache=cache)
        cache.truncate(context_len)

    seconds = median_seconds(step, model.device, repeats)
    # The same step's weight matmuls alone (B rows through every nn.Linear): splits the gap to the
    # prediction into "BLAS does not stream weights at full bandwidth" and "everything else".
    # The model's own Linear modules, so the matmuls run the same kernel path as inside the step.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch_size, m.in_features, device=model.device, dtype=model.dtype)
              for m in linears}
    with torch.inference_mode():
        matmul_seconds = median_seconds(lambda: [m(inputs[m.in_features]) for m in linears], model.device, repeats)
    nbytes = decode_step_bytes(cfg, batch_size, context_len + 1, precision)
    flops = forward_flops(cfg, batch_size, 1, context_len)
    t_mem, t_compute = nbytes / hardware.memory_bandwidth, flops / hardware.peak_flops
    return dict(batch_size=batch_size, context_len=context_len, seconds=seconds, matmul_only_seconds=matmul_seconds,
                tokens_per_second=batch_size / seconds, bytes=nbytes, flops=flops,
                predicted_memory_s=t_mem, predicted_compute_s=t_compute, predicted_seconds=max(t_mem, t_compute),
                achieved_bandwidth=nbytes / seconds)


def matvec_bandwidth(sweep: RooflineSweep) -> float | None:
    """Bytes/s the B = 1 point of the sweep (a matrix-vector product) actually streamed: the bandwidth
    a decode step's matmuls can hope for, which BLAS often leaves below the streaming measurement."""
    if 1 not in sweep.batch_sizes:
        return None
    i = sweep.batch_sizes.index(1)
    e = _element_size(sweep.dtype)
    return e * (sweep.d_in + sweep.d_in * sweep.d_out + sweep.d_out) / sweep.seconds[i]


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and quantized weight except the token
    embedding table (a step reads one row of it). Packed quantized layers count the bytes their
    kernel reads (codes + scales + zeros in the kernel's layout)."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) or type(module).__name__ == "QuantizedEmbedding":
            continue
        if hasattr(module, "packed_weight"):   # a QuantizedLinear
            packed = module.packed_weight(module.qweight.device)
            total += packed.nbytes if packed is not None else sum(b.nbytes for b in module.buffers(recurse=False))
            continue
        if hasattr(getattr(module, "table", None), "packed_weight"):   # tied to a quantized lm_head
            continue
        total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


@torch.inference_mode()
def prefill_tokens_per_second(model, prompt_len: int, batch_size: int = 1, repeats: int = 3) -> float:
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), device=device)

    def run():
        model(ids, cache=model.new_cache(batch_size, prompt_len), last_only=True)

    return batch_size * prompt_len / median_seconds(run, device, repeats, warmup=1)


def decode_step_fn(model, batch_size: int, context: int = 32, steps: int = 32, decode=decode_one_token):
    """Prefill `context` random tokens; return a function running one decode step (room for `steps` + 4).

    decode(model, token_ids, cache) runs the step (a `compile_decode` step takes (token_ids, cache))."""
    device = model.device
    cache = model.new_cache(batch_size, context + steps + 4)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (batch_size, context), device=device), cache=cache)
    token = torch.zeros(batch_size, dtype=torch.long, device=device)

    def step():
        with torch.inference_mode():
            return decode(model, token, cache)
    return step


@torch.inference_mode()
def decode_step_seconds(model, batch_size: int, context: int = 32, steps: int = 32) -> float:
    """Median seconds of one decode step for `batch_size` sequences after a `context`-token prefill."""
    return median_seconds(decode_step_fn(model, batch_size, context, steps), model.device, steps, warmup=1)
