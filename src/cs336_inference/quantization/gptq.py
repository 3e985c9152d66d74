"""GPTQ: quantize a weight matrix column by column, pushing each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss.

Frantar, Ashkboos, Hoefler & Alistarh 2023, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (building on Optimal Brain Quantization, Frantar & Alistarh 2022).
For a linear layer with calibration inputs X (n, I), the loss ||X W^T - X W_hat^T||^2 has Hessian
H = 2 X^T X / n (I, I), the same for every output row. Quantizing column j to q_j and updating the
remaining columns by  -(w_j - q_j) / [H^-1]_jj * [H^-1]_{j, j+1:}  is the optimal compensation (OBS).
Implementation choices from the paper: dampening (add `damp` x mean diag(H) for stability), the
upper Cholesky factor of H^-1 (numerically stable, no re-inversion per column), lazy blocked updates
(`block_size` columns at a time, then one matmul for the rest), optional act-order (quantize columns
with the largest diag(H), i.e. the most active inputs, first) and groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _checks
from .core import QuantizedTensor, check_bits, check_finite, compute_scale_zero_point, dequantize, quantize, qrange


def hessian_from_inputs(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / n (I, I) in float64 from calibration inputs x (..., I)."""
    check_finite("calibration inputs", x)
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * x.t() @ x / x.shape[0]


@dataclass
class GPTQResult:
    quantized: QuantizedTensor   # codes (O, I) in the original column order, scales (O, I/g)
    perm: torch.Tensor | None    # act-order permutation used (None without act-order)


def _qdq(w: torch.Tensor, scale, zero, bits, symmetric) -> torch.Tensor:
    """Quantize-dequantize columns w (O, k) with per-row scale/zero (O, 1)."""
    qmin, qmax = qrange(bits, symmetric)
    return (torch.clamp(torch.round(w / scale) + zero, qmin, qmax) - zero) * scale


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | None = None, *, inputs: torch.Tensor | None = None,
                  bits: int = 4, group_size: int | None = None, symmetric: bool = False,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False) -> GPTQResult:
    """Quantize weight (O, I) with GPTQ given H (I, I) (or the calibration `inputs` (..., I) to build it).

    group_size None means one scale per output row (per channel). Returns codes with scales/zero
    points in the same layout as `quantize_tensor`, so `result.quantized.dequantize()` gives W_hat.
    """
    check_bits(bits)
    check_finite("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (O, I), got shape {tuple(weight.shape)}")
    O, I = weight.shape
    if hessian is None:
        if inputs is None:
            raise ValueError("give the Hessian or the calibration inputs")
        if inputs.numel() == 0:
            raise ValueError("calibration inputs are empty; GPTQ needs at least one input row")
        hessian = hessian_from_inputs(inputs)
    if hessian.shape != (I, I):
        raise ValueError(f"hessian must be ({I}, {I}) for a weight with {I} input features, got {tuple(hessian.shape)}")
    check_finite("hessian", hessian)
    g = I if group_size is None else group_size
    _checks.positive_int("group_size", g)
    if I % g != 0:
        raise ValueError(f"group_size {group_size!r} must divide the input dimension {I}")
    _checks.finite_positive_float("damp", damp)
    _checks.positive_int("block_size", block_size)

    W = weight.detach().double().clone()
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0                 # inputs that never fire: any value is exact
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    if act_order:
        # Groups stay contiguous in the *original* order so storage needs no index map: their
        # scales are fixed up front from the (unmodified) weights ("static groups").
        static_scale, static_zero = compute_scale_zero_point(W, bits, symmetric, "group", g)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(I, dtype=H.dtype, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros_like(W)
    scales = torch.zeros(O, I // g, dtype=torch.float64, device=W.device)
    zeros = torch.zeros_like(scales)
    col_of = perm if act_order else torch.arange(I, device=W.device)   # original index of column j
    for start in range(0, I, block_size):
        end = min(start + block_size, I)
        W1, Hinv1 = W[:, start:end].clone(), Hinv[start:end, start:end]
        Err1 = torch.zeros_like(W1)
        for i in range(end - start):
            j = start + i
            group = int(col_of[j]) // g
            if act_order:
                scale, zero = static_scale[:, group:group + 1].double(), static_zero[:, group:group + 1].double()
            else:
                if j % g == 0:  # a new group: its scale comes from the error-updated weights, including
                    # its columns past this block, which get this block's errors only at the block's end
                    past = W[:, end:j + g] - Err1[:, :i] @ Hinv[start:start + i, end:j + g]
                    s, z = compute_scale_zero_point(torch.cat([W1[:, i:], past], 1)[:, :g],
                                                    bits, symmetric, "channel")
                    scales[:, group], zeros[:, group] = s[:, 0].double(), z[:, 0].double()
                scale, zero = scales[:, group:group + 1], zeros[:, group:group + 1]
            w = W1[:, i:i + 1]
            q = _qdq(w, scale, zero, bits, symmetric)
            Q[:, j:j + 1] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err @ Hinv1[i:i + 1, i:]             # compensate inside the block
            Err1[:, i:i + 1] = err
        W[:, end:] -= Err1 @ Hinv[start:end, end:]             # lazy batch update of the rest

    if act_order:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        scales, zeros = static_scale.double(), static_zero.double()
    scales, zeros = scales.float(), zeros.float()
    codes = quantize(Q.float(), scales, zeros, bits, symmetric)   # Q is on the grid: exact codes
    return GPTQResult(QuantizedTensor(codes, scales, zeros, bits, symmetric, g), perm)


def layer_output_error(weight: torch.Tensor, weight_hat: torch.Tensor, inputs: torch.Tensor) -> float:
    """||X W^T - X W_hat^T||_F over calibration inputs X (..., I)."""
    x = inputs.reshape(-1, inputs.shape[-1]).double()
    return float((x @ (weight.double() - weight_hat.double()).t()).norm())


__all__ = ["GPTQResult", "dequantize", "gptq_quantize", "hessian_from_inputs", "layer_output_error"]
