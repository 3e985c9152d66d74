"""`verify_checkpoint`: does the loaded model compute what the student's own model computes?

A checkpoint's keys say which tensors exist, not how the forward uses them: the handout's post-norm, NoPE and
weightless-QK-norm ablations have exactly the base model's keys, so they load without an error and give other
logits. The only proof is to run both forwards on the same ids. When they differ, the same weights are tried
under those variants (and a few norm eps values): one that matches is named, with the config field to set.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn as nn

from .. import _checks
from .config import ModelConfig
from .transformer import TransformerLM

_EPS_TRIED = (1e-5, 1e-6, 1e-8)


class CheckpointMismatchError(ValueError):
    """The loaded model's logits differ from the student's forward; `max_delta` and `suggestion` (a dict of
    config fields whose model matches the student's forward, or None) say by how much and why."""

    def __init__(self, message: str, max_delta: float, suggestion: dict | None):
        super().__init__(message)
        self.max_delta, self.suggestion = max_delta, suggestion


def _variants(config: ModelConfig) -> list[dict]:
    """Config changes that keep the state-dict keys (so the same weights load): the ablations first."""
    flips = [("norm_position", ("pre", "post")) if config.norm == "rmsnorm" else None,
             ("positional", ("rope", "none")) if config.attention_type == "gqa" else None,
             ("qk_norm", ("none", "no_gain")) if config.qk_norm in ("none", "no_gain") else None]
    flips = [f for f in flips if f is not None]
    out = []
    for values in itertools.product(*(vals for _, vals in flips)):
        change = {name: v for (name, _), v in zip(flips, values) if getattr(config, name) != v}
        if change:
            out.append(change)
    out.sort(key=len)
    if config.norm == "rmsnorm" or config.qk_norm != "none":
        out += [{"norm_eps": e, **{f: None for f in ("ln1_eps", "ln2_eps", "ln_final_eps", "qk_norm_eps")
                                  if getattr(config, f) is not None}}
                for e in _EPS_TRIED if e != config.norm_eps]
    return out


def _student_logits(student_forward, ids: torch.Tensor) -> torch.Tensor:
    device = ids.device
    if isinstance(student_forward, nn.Module):
        param = next(iter(student_forward.parameters()), None)
        device = param.device if param is not None else device
    with torch.no_grad():
        out = student_forward(ids.to(device))
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        out = out[0]           # (logits, cache) or (logits, loss) from some students' forwards
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"student_forward must return the logits tensor (B, T, V), got {type(out).__name__}")
    return out


def verify_checkpoint(model: nn.Module, student_forward: Callable[[torch.Tensor], torch.Tensor], *,
                      batch_size: int = 2, seq_len: int | None = None, atol: float | None = None,
                      rtol: float | None = None, seed: int = 0) -> float:
    """Compare `model`'s logits with `student_forward(token_ids)` (the student's own model, or any callable
    (B, T) int64 ids -> (B, T, V) logits) on random ids; return the max |delta| when they agree.

    Raises CheckpointMismatchError with the max |delta| and the likely cause when max |delta| > atol + rtol *
    max |student logits| (defaults: atol = rtol = 1e-3 for an fp32 model; 5e-2 and 2e-2 in bf16/fp16). The
    cause: the variant of the same weights that matches (post-norm, NoPE, weightless QK-norm, another norm
    eps), else whether position 0 already differs (weights misplaced) or only later positions do (how
    positions mix: RoPE theta or layout, the causal mask)."""
    _checks.instance("model", model, TransformerLM, "a TransformerLM (from load_cs336_checkpoint)")
    if not callable(student_forward):
        raise TypeError(f"student_forward must be your model or a callable ids -> logits, got "
                        f"{type(student_forward).__name__}")
    cfg = model.config
    seq_len = min(16, cfg.context_length) if seq_len is None else _checks.integer(
        "seq_len", seq_len, 1, cfg.context_length, allowed=f"an int in [1, context_length={cfg.context_length}]")
    _checks.positive_int("batch_size", batch_size)
    half = model.dtype in (torch.bfloat16, torch.float16)
    atol = (5e-2 if half else 1e-3) if atol is None else _checks.non_negative_float("atol", atol)
    rtol = (2e-2 if half else 1e-3) if rtol is None else _checks.non_negative_float("rtol", rtol)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    theirs = _student_logits(student_forward, ids).detach().float().cpu()
    if tuple(theirs.shape) != (batch_size, seq_len, cfg.vocab_size):
        raise ValueError(f"student_forward returned logits of shape {tuple(theirs.shape)} for ids of shape "
                         f"{tuple(ids.shape)}; expected {(batch_size, seq_len, cfg.vocab_size)} (B, T, V)")
    with torch.no_grad():
        ours = model(ids.to(model.device)).float().cpu()
    delta = (ours - theirs).abs()
    tolerance = atol + rtol * float(theirs.abs().max())
    worst = float(delta.max())
    if worst <= tolerance:
        return worst
    cause, suggestion = _likely_cause(model, ids, theirs, tolerance, delta)
    raise CheckpointMismatchError(
        f"the loaded model does not compute what your model computes: max |delta logit| = {worst:.3g} on "
        f"{batch_size}x{seq_len} random ids (tolerance {tolerance:.2g}). {cause}", worst, suggestion)


def _likely_cause(model, ids, theirs, tolerance, delta) -> tuple[str, dict | None]:
    cfg = model.config
    state = model.state_dict()
    best = None
    for change in _variants(cfg):
        other = TransformerLM(cfg.replace(**change), device="meta")   # the same tensors, another forward
        try:
            other.load_state_dict(state, strict=True, assign=True)
        except (RuntimeError, ValueError):   # a quantized or otherwise transformed model: no variants to try
            break
        other.tie_weights()
        other.rope = model.rope
        with torch.no_grad():
            d = float((other(ids.to(model.device)).float().cpu() - theirs).abs().max())
        if best is None or d < best[0]:
            best = (d, change)
        if d <= tolerance:
            fields = ", ".join(f"{k}={v!r}" for k, v in change.items())
            return (f"Your model matches these weights with {fields} (max |delta| {d:.2g}): load the checkpoint "
                    f"with ModelConfig(..., {fields})."), change
    first = float(delta[:, 0].max())
    if first <= tolerance:
        where = (f"Position 0 agrees (max |delta| {first:.2g}) and later positions do not, so the difference is "
                 "in how positions interact: RoPE (rope_theta; the handout rotates adjacent pairs (x[2k], "
                 "x[2k+1])), the causal mask, or attention scaling.")
    else:
        where = ("Position 0 already differs, so weights are in the wrong place or used differently: check the "
                 "key_map (q/k/v, w1 (gate) vs w3 (up), a transposed or fused matrix), d_ff, norm eps, "
                 "tie_embeddings.")
    tried = "" if best is None else (f" None of the handout's variants with the same keys (post-norm, NoPE, "
                                     f"weightless QK-norm, norm eps {list(_EPS_TRIED)}) explains it (closest: "
                                     f"{best[1]}, max |delta| {best[0]:.3g}).")
    return where + tried, None


__all__ = ["CheckpointMismatchError", "verify_checkpoint"]
