"""The reference solution, sampling: turning logits into the next token (temperature, top-k, top-p, sampling).

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...generation import sampling as _sampling
from ..registry import graded


@graded("sampling")
def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    """The distribution the next token is drawn from.

    logits: (..., V) float. Returns probs (..., V) float32, summing to 1 over V.
    In this order: temperature 0 means greedy (a one-hot on the argmax, nothing else applies); otherwise
    divide the logits by `temperature`; top_k keeps the k largest logits (every logit equal to the k-th
    largest stays); softmax; top_p keeps the smallest set of most likely tokens whose probability reaches
    top_p: a token is dropped exactly when the tokens ranked before it (sorted by probability, descending)
    already sum to >= top_p; renormalise what is kept. None disables a filter.
    """
    return _sampling.logits_to_probs(logits, temperature, top_k, top_p)


@graded("sampling")
def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw the next token of each row.

    logits: (B, V) or (V,) float. Returns token ids (B,) or () int64, each drawn independently from
    `logits_to_probs(logits, temperature, top_k, top_p)` using `generator` (torch.multinomial takes one);
    temperature 0 returns the argmax.
    """
    return _sampling.sample_next_token(logits, temperature, top_k, top_p, generator)
