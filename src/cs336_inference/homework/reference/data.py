"""The reference solution, data: the training batch sampler and bits per byte.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...data import corpus as _corpus
from ...data import evaluation as _evaluation
from ..registry import graded


@graded("data")
def get_batch(data: torch.Tensor, batch_size: int, seq_len: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B = batch_size random training windows of a 1-D token stream `data` (numel >= seq_len + 1).

    Each start s is drawn uniformly from every valid start 0 .. numel - seq_len - 1 (with `generator`).
    Returns (x, y), both (B, T = seq_len) int64: x = data[s : s + T], y = data[s + 1 : s + T + 1].
    """
    return _corpus.get_batch(data, batch_size, seq_len, generator)


@graded("data")
def bits_per_byte(logits: torch.Tensor, targets: torch.Tensor, num_bytes: int) -> float:
    """A language model's loss in bits per byte of text: how the lecture compares models across tokenizers.

    logits: (N, V) next-token logits at N positions; targets: (N,) int64, the tokens that came next;
    num_bytes: the bytes of text those N target tokens encode (N for a byte-level tokenizer). Returns the
    summed cross-entropy of the targets in bits (natural-log nats divided by ln 2) over num_bytes.
    """
    nats = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum")
    return _evaluation.bits_per_byte(float(nats), num_bytes)
