"""Graded: a language model's loss in bits per byte (bits_per_byte). The reference sums -log softmax by hand."""

import math

import pytest
import torch
from adapters import run_bits_per_byte


@pytest.mark.parametrize("num_bytes", [40, 97])
def test_bits_per_byte_is_the_summed_loss_in_bits_over_the_bytes(num_bytes):
    g = torch.Generator().manual_seed(num_bytes)
    logits, targets = torch.randn(40, 11, generator=g) * 2, torch.randint(0, 11, (40,), generator=g)
    nats = 0.0
    for row, t in zip(logits.tolist(), targets.tolist()):
        m = max(row)
        nats += m + math.log(sum(math.exp(v - m) for v in row)) - row[t]
    got = run_bits_per_byte(logits, targets, num_bytes)
    assert got == pytest.approx(nats / math.log(2) / num_bytes, rel=1e-6), "nats / ln 2 per byte of text"
