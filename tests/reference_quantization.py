"""Independent quantization references the tests share (written from the formulas, not the library)."""

import torch


def naive_affine_rtn(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Affine min/max round-to-nearest per group of `group` input columns (per row if None), in float64:
    s = (max - min) / (2^b - 1) with the range widened to include 0, z = round(-min / s),
    w_hat = (clamp(round(w / s) + z, 0, 2^b - 1) - z) * s."""
    out = torch.empty_like(w, dtype=torch.float64)
    g = group or w.shape[1]
    for start in range(0, w.shape[1], g):
        chunk = w[:, start:start + g].double()
        lo, hi = chunk.min(1, keepdim=True).values.clamp(max=0), chunk.max(1, keepdim=True).values.clamp(min=0)
        s = ((hi - lo) / (2**bits - 1)).clamp(min=1e-12)
        z = torch.round(-lo / s)
        out[:, start:start + g] = (torch.clamp(torch.round(chunk / s) + z, 0, 2**bits - 1) - z) * s
    return out
