"""`quantize_model`: a quantized copy of a `TransformerLM` that prefill/decode/generate run unchanged.

Every `nn.Linear` inside the transformer blocks is replaced (attention projections and the SwiGLU
matrices); the token embedding and lm_head stay in full precision unless asked (they are small
for big vocabularies-per-layer ratios, sensitive, and often kept in 16 bits in practice).
Calibration-based methods (GPTQ, AWQ) run *sequentially*, block by block: the inputs of block i are
captured from the copy whose blocks 0..i-1 are already quantized, so later layers see and absorb the
earlier layers' errors (as in the GPTQ paper). The original model is never modified: every check
runs before anything is copied, and all work happens on a deep copy.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from .. import _checks
from .awq import awq_search_scales
from .core import check_bits, quantize_tensor
from .gptq import gptq_quantize
from .kernels import SlowKernelWarning, check_kernel, collect_fallbacks
from .linear import QUANTIZED_LINEAR_TYPES, Fp8Linear, LLMInt8Linear, QuantizedLinear
from .qat import qat_finetune

METHODS = ("rtn", "gptq", "awq", "qat", "fp8", "llm_int8")
NEEDS_CALIBRATION = ("gptq", "awq", "qat")

# AWQ folds 1/s into the op that produces a linear's input: an RMSNorm weight (scale its entries)
# or a linear (scale its output rows). Keyed by the first linear of a group sharing one input.
_FOLD_INTO = {"attn.q_proj": "ln1", "ffn.w1": "ln2", "ffn.w2": "ffn.w3", "lm_head": "ln_final"}


class QuantizedEmbedding(nn.Module):
    """An embedding table stored like a `QuantizedLinear` weight (rows = tokens, groups along D). A
    tied model's lm_head may be that very `table` (one copy of the codes, read as a matmul there)."""

    def __init__(self, embedding: nn.Embedding | QuantizedLinear, bits: int | None = None,
                 group_size: int | None = None, symmetric: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.table = (embedding if isinstance(embedding, QuantizedLinear)
                      else QuantizedLinear.from_linear(embedding, bits, group_size, symmetric))
        self.dtype = dtype or self.table.out_dtype or torch.float32    # of the rows handed to the model

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:   # (...,) -> (..., D)
        return self.table.dequantized_weight(self.dtype, rows=token_ids)   # only the rows looked up

    def _apply(self, fn, *args, **kwargs):
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype      # a cast of the model casts the rows
        return super()._apply(fn, *args, **kwargs)

    def kernel_summary(self) -> str:
        return f"lookup: dequantize the rows read (int{self.table.bits}, group_size={self.table.group_size})"


class RescoredHead(nn.Module):
    """A quantized lm_head whose k highest logits are recomputed in fp32 from the same codes.

    The packed kernels compute in bf16 and return bf16 logits. Near a logit of 20, bf16 values are
    0.125 apart, so two candidates closer than that tie or swap, and greedy decoding follows the
    rounding, not the weights (the bf16 scales round too). This head runs the fast kernel over the
    whole vocabulary, then dequantizes the k rows it ranked highest (k x D values, a few KB) and
    rescores them in fp32: the argmax and the head of the distribution are those of the stored
    weights, the rest of the vocabulary keeps bf16 precision. Returns fp32 logits.
    """

    def __init__(self, head: QuantizedLinear, k: int = 16):
        super().__init__()
        if head.input_scale is not None or head.bias is not None:
            raise ValueError("RescoredHead rescores W_hat x; a head with input scales or a bias is not supported")
        self.head, self.k = head, _checks.positive_int("k", k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (..., D) -> (..., V)
        logits = self.head(x).float()
        top = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices          # (..., k)
        rows = self.head.dequantized_weight(torch.float32, rows=top)               # (..., k, D)
        exact = (rows @ x.float().unsqueeze(-1)).squeeze(-1)                       # (..., k)
        return logits.scatter(-1, top, exact)

    def weight_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(R, D): the quantized head's rows for these ids, dequantized (`QuantizedLinear.weight_rows`)."""
        return self.head.weight_rows(rows, dtype)

    def kernel_summary(self) -> str:
        return f"{self.head.kernel_summary()}; its top {self.k} logits rescored in fp32"


def _check_calibration(calibration, vocab_size: int) -> list[torch.Tensor]:
    """Token ids (B, T) / (T,) or a list of such -> list of (B, T) long batches; refuse empty data."""
    if calibration is None:
        raise ValueError("calibration data is required for this method: token ids (B, T), (T,) or a list of them")
    batches = list(calibration) if isinstance(calibration, (list, tuple)) else [calibration]
    if not batches:
        raise ValueError("calibration data is empty: give at least one sequence of token ids")
    out = []
    for i, b in enumerate(batches):
        b = _checks.token_ids(f"calibration batch {i}", torch.as_tensor(b), vocab_size)
        out.append(b[None] if b.dim() == 1 else b)
    return out


def _target_linears(model: nn.Module, quantize_lm_head: bool) -> list[str]:
    names = [f"layers.{n}" for n, m in model.layers.named_modules() if isinstance(m, nn.Linear)]
    return names + (["lm_head"] if quantize_lm_head else [])


def _check_args(model, method, bits, group_size, calibration, quantize_embedding, quantize_lm_head):
    """The layers to quantize and the calibration batches (None where the method needs none), after
    refusing, in this order: a model that is not a full-precision TransformerLM, a method or bits it
    does not support, a group size or int4 packing the layers' input dimensions do not allow, and
    weights that are not finite."""
    if not isinstance(model, nn.Module) or not hasattr(model, "layers") or not hasattr(model, "lm_head"):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    _checks.one_of("method", method, METHODS)
    _refuse_quantized(model)
    if method in ("fp8", "llm_int8"):
        if bits != 8:
            raise ValueError(f"method {method!r} stores 8-bit weights; bits must be 8, got {bits!r}")
    else:
        check_bits(bits)
    names = _target_linears(model, quantize_lm_head)
    dims = {model.get_submodule(n).in_features for n in names}
    if quantize_embedding:
        dims.add(model.token_embeddings.embedding_dim)
    _check_input_dims(dims, method, bits, group_size)
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ValueError(f"weight {name} contains NaN/Inf; refusing to quantize a broken model")
    if method in NEEDS_CALIBRATION:
        return names, _check_calibration(calibration, model.config.vocab_size)
    return names, None


def _refuse_quantized(model: nn.Module) -> None:
    done = [n for n, m in model.named_modules() if isinstance(m, QUANTIZED_LINEAR_TYPES + (QuantizedEmbedding,))]
    if done or getattr(model, "quantization", None):
        raise ValueError(f"model is already quantized ({getattr(model, 'quantization', None) or done[:3]}); "
                         f"quantize the full-precision model instead (quantizing twice compounds the error "
                         f"and mislabels the bits)")


def _check_input_dims(dims: set[int], method: str, bits: int, group_size) -> None:
    """group_size must divide every input dimension to quantize (per channel for fp8/llm_int8: any size
    goes), and int4 packs two values a byte, so every input dimension must be even."""
    if group_size is not None:
        _checks.optional_positive_int("group_size", group_size)
        bad = [] if method in ("fp8", "llm_int8") else sorted(d for d in dims if d % group_size)   # per channel
        if bad:
            raise ValueError(f"group_size {group_size} does not divide the input dimension(s) {bad} of the "
                             f"layers to quantize; choose a common divisor of {sorted(dims)} or None")
    if bits == 4 and any(d % 2 for d in dims):
        raise ValueError("int4 packing needs even input dimensions")


class _Stop(Exception):
    """Raised by a hook to end a calibration forward pass once the block of interest has run."""


@torch.no_grad()
def capture_linear_inputs(model: nn.Module, names: list[str], batches: list[torch.Tensor],
                          stop_at: nn.Module | None = None):
    """Inputs (n, I) seen by each named linear over the calibration batches, and which linears
    share the very same input tensor (q/k/v read one normed x; w1/w3 another)."""
    inputs = {n: [] for n in names}
    first: dict[str, torch.Tensor] = {}   # a reference keeps id() unique while we compare
    hooks = []
    for n in names:
        def hook(module, args, n=n):
            x = args[0]
            first.setdefault(n, x)
            inputs[n].append(x.detach().reshape(-1, x.shape[-1]).float())
        hooks.append(model.get_submodule(n).register_forward_pre_hook(hook))
    if stop_at is not None:
        def stop(module, args, output):
            raise _Stop
        hooks.append(stop_at.register_forward_hook(stop))
    try:
        for b in batches:
            try:
                model(b.to(model.device))
            except _Stop:
                pass
    finally:
        for h in hooks:
            h.remove()
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(id(first[n]), []).append(n)
    return {n: torch.cat(v) for n, v in inputs.items()}, list(groups.values())


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@torch.no_grad()
def _fold(model: nn.Module, group: list[str], s: torch.Tensor) -> bool:
    """Multiply the group's weight columns by s and fold 1/s into the producer of their input."""
    first = group[0]
    suffix = next((k for k in _FOLD_INTO if first.endswith(k)), None)
    if suffix is None:
        return False
    producer = model.get_submodule(first[: len(first) - len(suffix)] + _FOLD_INTO[suffix])
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s.to(producer.weight.dtype)[:, None])   # rows of the producing linear
    else:
        producer.weight.div_(s.to(producer.weight.dtype))            # RMSNorm gain
    for n in group:
        model.get_submodule(n).weight.mul_(s.to(model.get_submodule(n).weight.dtype))
    return True


def quantize_model(model: nn.Module, method: str = "rtn", bits: int = 4, group_size: int | None = 128,
                   calibration=None, *, symmetric: bool = False, quantize_embedding: bool = False,
                   quantize_lm_head: bool = False, act_order: bool = False, damp: float = 0.01,
                   block_size: int = 128, awq_grid: int = 20, fold_scales: bool = True, fp8_format: str = "e4m3",
                   threshold: float | None = 6.0, qat_steps: int = 100, qat_lr: float = 3e-4,
                   qat_batch_size: int = 8, qat_seq_len: int = 128, qat_teacher: bool = True,
                   scale_dtype: torch.dtype = torch.float16, kernel: str = "auto") -> nn.Module:
    """A quantized deep copy of `model` (the original is untouched).

    method: "rtn" (round to nearest), "gptq", "awq", "qat" (fake-quant fine-tune, then RTN), "fp8"
    (e4m3 per channel; bits=8) or "llm_int8" (bits=8). group_size None = per output channel.
    calibration: token ids (B, T) / (T,) or a list of them (GPTQ/AWQ statistics; QAT training data).
    kernel: how every `QuantizedLinear` runs: "auto" (torch's packed int4/int8 kernels where the layout
    fits, else dequantize + matmul), "reference" (always dequantize + matmul) or "packed".
    """
    check_kernel(kernel)
    if method == "awq" and fold_scales and hasattr(model, "config"):
        model.config.require_handout_base("AWQ with fold_scales=True")   # folds into ln1/ln2/w3/ln_final
    names, batches = _check_args(model, method, bits, group_size, calibration, quantize_embedding,
                                 quantize_lm_head)
    record = _record(method, bits, group_size, symmetric, calibration, quantize_embedding, quantize_lm_head,
                     fp8_format, threshold)
    q = copy.deepcopy(model).eval()
    with collect_fallbacks():   # layers are announced together, once, by set_quantized_kernel below
        if method in ("fp8", "llm_int8"):
            for n in names:
                lin = q.get_submodule(n)
                _set(q, n, Fp8Linear(lin, fp8_format) if method == "fp8" else LLMInt8Linear(lin, threshold))
        elif method in ("rtn", "qat"):
            if method == "qat":
                stream = torch.cat([b.reshape(-1) for b in batches])
                q.qat_losses = qat_finetune(q, stream, names, bits, group_size, symmetric, steps=qat_steps,
                                            lr=qat_lr, batch_size=qat_batch_size, seq_len=qat_seq_len,
                                            teacher=model if qat_teacher else None)
            for n in names:
                _set(q, n, QuantizedLinear.from_linear(q.get_submodule(n), bits, group_size, symmetric,
                                                       scale_dtype=scale_dtype))
        else:
            _calibrated(q, method, names, batches, bits, group_size, symmetric, act_order, damp, block_size,
                        awq_grid, fold_scales, scale_dtype)
        if quantize_embedding:
            q.token_embeddings = QuantizedEmbedding(q.token_embeddings, record["bits"], record["group_size"],
                                                    record["symmetric"])
    q.quantization = record
    return set_quantized_kernel(q, kernel)


def _record(method, bits, group_size, symmetric, calibration, quantize_embedding, quantize_lm_head, fp8_format,
            threshold) -> dict:
    """What the quantized model really uses (`model.quantization`); options the method ignores are listed
    under "ignored", and a group size that fp8 / LLM.int8() cannot honour is said out loud."""
    ignored = [] if calibration is None or method in NEEDS_CALIBRATION else ["calibration"]
    record = dict(method=method, bits=bits, group_size=group_size, symmetric=symmetric,
                  quantize_embedding=quantize_embedding, quantize_lm_head=quantize_lm_head)
    if method in ("fp8", "llm_int8"):   # one scale per output channel, absmax (symmetric) by construction
        if group_size is not None:
            ignored.append(f"group_size={group_size}")
            if group_size != 128:       # 128 is quantize_model's default, not a request
                warnings.warn(f"method {method!r} scales each output channel; group_size={group_size} is not "
                              f"used (pass group_size=None)", UserWarning, stacklevel=3)
        if not symmetric:
            ignored.append("symmetric=False")
        record |= dict(group_size=None, symmetric=True)
        record |= dict(fp8_format=fp8_format) if method == "fp8" else dict(threshold=threshold)
    return record | dict(ignored=ignored)


def set_quantized_kernel(model: nn.Module, kernel: str) -> nn.Module:
    """Run every `QuantizedLinear` of `model` with `kernel` ("auto", "reference" or "packed"); checks all
    layers before changing any, so a refused "packed" leaves the model as it was. Layers that fall back
    to dequantizing on every call are announced in one `SlowKernelWarning`."""
    check_kernel(kernel)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if kernel == "packed":
        for m in layers:
            reason = m.packed_unsupported_reason(m.qweight.device)
            if reason is not None:
                raise ValueError(f"kernel='packed' cannot run layer ({m.extra_repr()}): {reason}; use 'auto'")
    with collect_fallbacks():
        for m in layers:
            m.set_kernel(kernel)
    announce_slow_layers(model)
    return model


def slow_layers(model: nn.Module) -> dict[str, list[str]]:
    """reason -> names of the quantized layers that dequantize their weight on every call (not by request)."""
    found: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear) and m.fallback_reason is not None:
            found.setdefault(m.fallback_reason, []).append(name)
        elif isinstance(m, (Fp8Linear, LLMInt8Linear)):
            found.setdefault(m.kernel_summary().split(": ", 1)[1], []).append(name)
    return found


def announce_slow_layers(model: nn.Module) -> None:
    """One warning naming every layer that decodes slower than full precision, grouped by reason."""
    found = slow_layers(model)
    if not found:
        return
    total = sum(isinstance(m, QUANTIZED_LINEAR_TYPES) for m in model.modules())
    slow = sum(len(v) for v in found.values())
    parts = [f"{reason} ({', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''})"
             for reason, names in found.items()]
    warnings.warn(f"{slow} of {total} quantized layers dequantize their weight on every call, so they run slower "
                  f"than full precision: {'; '.join(parts)}. model.describe() lists each layer's kernel.",
                  SlowKernelWarning, stacklevel=3)


def _calibrated(q, method, names, batches, bits, group_size, symmetric, act_order, damp, block_size,
                awq_grid, fold_scales, scale_dtype) -> None:
    """GPTQ / AWQ, block by block (then lm_head), each on inputs from the partly quantized copy."""
    stages = [([n for n in names if n.startswith(f"layers.{i}.")], block) for i, block in enumerate(q.layers)]
    if "lm_head" in names:
        stages.append((["lm_head"], None))
    for stage_names, block in stages:
        inputs, groups = capture_linear_inputs(q, stage_names, batches, stop_at=block)
        if method == "gptq":
            for n in stage_names:
                lin = q.get_submodule(n)
                res = gptq_quantize(lin.weight, inputs=inputs[n], bits=bits, group_size=group_size,
                                    symmetric=symmetric, block_size=block_size, damp=damp, act_order=act_order)
                _set(q, n, QuantizedLinear(res.quantized, scale_dtype=scale_dtype, out_dtype=lin.weight.dtype,
                                           bias=lin.bias))
            continue
        # AWQ: one shared scale per group of linears reading the same input. Search the groups whose
        # producer is a linear of this stage first (w2's 1/s lands in w3's rows before w3 is searched).
        ordered = sorted(groups, key=lambda g: 0 if g[0].endswith("ffn.w2") else 1)
        explicit = {}
        for group in ordered:
            stacked = torch.cat([q.get_submodule(n).weight for n in group])
            s = awq_search_scales(stacked, inputs[group[0]], bits, group_size, symmetric, awq_grid).scales
            if not (fold_scales and _fold(q, group, s)):
                with torch.no_grad():
                    for n in group:
                        q.get_submodule(n).weight.mul_(s)
                        explicit[n] = s
        for n in stage_names:
            lin = q.get_submodule(n)
            granularity = "channel" if group_size is None else "group"
            qt = quantize_tensor(lin.weight.detach(), bits, symmetric, granularity, group_size)
            _set(q, n, QuantizedLinear(qt, input_scale=explicit.get(n), scale_dtype=scale_dtype,
                                       out_dtype=lin.weight.dtype, bias=lin.bias))
