"""LLM.int8(): vector-wise int8 matmul with mixed-precision outlier decomposition.

Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale".
Y = X W^T with X (T, I) and W (O, I):
- vector-wise quantization: each row of X (token) and each row of W (output channel) gets its own
  absmax scale; the int8 x int8 product accumulates in int32 and is rescaled by the outer product
  of the two scale vectors;
- outlier decomposition: from ~6.7B parameters on, a few hidden *feature dimensions* carry
  activations of magnitude 20-100, and one such value in a row stretches that row's absmax scale
  so far that every other entry rounds to 0. Columns of X where any |x| exceeds `threshold`
  (6.0 in the paper) are multiplied in high precision instead, the rest in int8.
"""

from __future__ import annotations

import torch

from .. import _checks
from .core import check_finite


def absmax_int8(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise (along `dim`) absmax int8: x ~ q * scale, q in [-127, 127], scale keeps dim as size 1."""
    scale = x.float().abs().amax(dim, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 result of a (M, K) @ b (K, N) for int8 inputs (what int8 tensor cores compute)."""
    if a.device.type == "cpu":
        return a.to(torch.int32) @ b.to(torch.int32)
    if a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:
        return torch._int_mm(a.contiguous(), b.contiguous())
    return (a.double() @ b.double()).to(torch.int32)  # exact: |sum| < 2^31 < 2^53


def vectorwise_int8_matmul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (T, I) float times int8 weights w_q (O, I) with per-row scales w_scale (O, 1) -> (T, O) fp32."""
    x_q, x_scale = absmax_int8(x, dim=-1)                          # (T, I), (T, 1)
    acc = int8_matmul(x_q, w_q.t())                                # (T, O) int32
    return acc.float() * x_scale * w_scale.reshape(1, -1).float()  # outer product of the scales


def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """Feature dims (columns of x (..., I)) holding any |value| > threshold -> bool (I,)."""
    return (x.abs() > threshold).reshape(-1, x.shape[-1]).any(0)


def llm_int8_matmul(x: torch.Tensor, weight: torch.Tensor | None = None, threshold: float | None = 6.0, *,
                    w_q: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Y = x W^T, x (..., I), W (O, I) -> (..., O) in x's dtype.

    Pass a float `weight` (quantized here, row-wise absmax) or its int8 codes `w_q` (O, I) and scales
    `w_scale` (O, 1). `threshold=None` disables decomposition (plain vector-wise absmax int8).
    The outlier columns use the weight as stored (dequantized int8 when only codes are given, as in
    bitsandbytes' inference path), times the activations in full precision.
    """
    if weight is not None:
        check_finite("weight", weight)
        w_q, w_scale = absmax_int8(weight, dim=-1)
    if w_q is None or w_scale is None:
        raise ValueError("give either weight, or both w_q and w_scale")
    if threshold is not None:
        _checks.finite_positive_float("threshold", threshold)
    if x.shape[-1] != w_q.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight has {w_q.shape[-1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                # (T, I)
    if threshold is None:
        return vectorwise_int8_matmul(x2, w_q, w_scale).to(x.dtype).reshape(*lead, -1)
    outliers = outlier_columns(x2, threshold)                      # (I,)
    regular = ~outliers
    if regular.any():
        y = vectorwise_int8_matmul(x2[:, regular], w_q[:, regular], w_scale)
    else:  # every feature dim is an outlier somewhere in this batch: all of it runs in high precision
        y = x2.new_zeros(x2.shape[0], w_q.shape[0], dtype=torch.float32)
    if outliers.any():
        w_hi = (weight if weight is not None else w_q.float() * w_scale)[:, outliers]
        y = y + x2[:, outliers].float() @ w_hi.float().t()
    return y.to(x.dtype).reshape(*lead, -1)


def planted_outlier_demo(tokens: int = 64, d_in: int = 512, d_out: int = 256, num_outliers: int = 4,
                         magnitude: float = 60.0, seed: int = 0) -> dict:
    """Activations ~N(0, 1) with `num_outliers` feature dims scaled to ~magnitude (as in the paper).

    Returns relative output errors ||Y_hat - Y|| / ||Y|| of plain vector-wise int8 and of LLM.int8().
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g)
    cols = torch.randperm(d_in, generator=g)[:num_outliers]
    x[:, cols] *= magnitude
    w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    y = x @ w.t()
    err = lambda y_hat: float((y_hat - y).norm() / y.norm())  # noqa: E731
    x_q, x_s = absmax_int8(x)
    return {
        "outlier_columns": sorted(cols.tolist()),
        "plain_int8_rel_error": err(llm_int8_matmul(x, w, threshold=None)),
        "llm_int8_rel_error": err(llm_int8_matmul(x, w, threshold=6.0)),
        # fraction of ordinary entries that absmax rounds to zero because of the outliers' scale
        "plain_int8_zeroed_fraction": float((x_q == 0).float().mean()),
    }


# The inputs of a TransformerLM block's linears, by where they come from (q/k/v share ln1's output,
# w1/w3 share ln2's): attention in, attention out (into output_proj), MLP in, MLP down (into w2).
BLOCK_INPUTS = {"attn_in": "attn.q_proj", "attn_out": "attn.output_proj", "mlp_in": "ffn.w1", "mlp_down": "ffn.w2"}


@torch.no_grad()
def count_activation_outliers(model, batches, threshold: float = 6.0) -> list[dict]:
    """What LLM.int8() would see in a real model: per layer and per linear input (`BLOCK_INPUTS`), the
    entries with |x| > threshold, the feature dims holding any (the columns it keeps in high
    precision) and the largest |x|, over `batches` of token ids (B, T)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    stats = [{k: dict(count=0, total=0, dims=set(), max_abs=0.0) for k in BLOCK_INPUTS} for _ in model.layers]
    hooks = []
    for i, block in enumerate(model.layers):
        for kind, name in BLOCK_INPUTS.items():
            def hook(module, args, s=stats[i][kind]):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                s["count"] += int((x.abs() > threshold).sum())
                s["total"] += x.numel()
                s["dims"].update(outlier_columns(x, threshold).nonzero().flatten().tolist())
                s["max_abs"] = max(s["max_abs"], float(x.abs().max()))
            hooks.append(block.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for batch in batches:
            model(torch.as_tensor(batch).to(model.device))
    finally:
        for h in hooks:
            h.remove()
    return [{k: dict(count=s["count"], fraction=s["count"] / max(1, s["total"]), outlier_dims=len(s["dims"]),
                     max_abs=s["max_abs"]) for k, s in layer.items()} for layer in stats]
