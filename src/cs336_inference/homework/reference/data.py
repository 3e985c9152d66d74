"""The reference solution, data: the training batch sampler.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...data import corpus as _corpus
from ..registry import graded


@graded("data")
def get_batch(data: torch.Tensor, batch_size: int, seq_len: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B = batch_size random training windows of a 1-D token stream `data` (numel >= seq_len + 1).

    Each start s is drawn uniformly from every valid start 0 .. numel - seq_len - 1 (with `generator`).
    Returns (x, y), both (B, T = seq_len) int64: x = data[s : s + T], y = data[s + 1 : s + T + 1].
    """
    return _corpus.get_batch(data, batch_size, seq_len, generator)
