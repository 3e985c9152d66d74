"""Drafters: whatever proposes the next few tokens for the target to verify.

The speculative loop only needs four things from a drafter (the `Drafter` protocol):
  start(prompt, max_seq_len, max_rollback)  prepare for a new sequence (a model drafter prefills its
                                    cache, sized to roll back up to max_rollback positions at once)
  propose(sequence, n, sampling)    up to n tokens that may follow `sequence`, with the distribution
                                    each was drawn from ((n, V) probabilities, or None when the
                                    drafts are deterministic: one-hot, as in greedy or n-gram lookup)
  rollback(length)                  the first `length` tokens of the sequence are final; forget the rest
  forwards                          how many draft forwards it has run (statistics)

A drafter that reads the target's hidden states also has
  observe(features)                 features (T, D): the target's last-block outputs at the T positions
                                    that just became final (after the prefill, and after each pass)
and the loop then runs the target with `return_hidden=True` to hand them over.

`ModelDrafter` wraps a small `TransformerLM` with its own KV cache (the classic draft model);
`prompt_lookup.PromptLookupDrafter` copies from the context and needs no model at all;
`medusa.MedusaDrafter` (heads on the target's last feature) and `eagle.EagleDrafter` (one layer
extrapolating the target's features, with its own cache) read the target's features.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..model.transformer import TransformerLM
from .sampling import draw_from
from .sampling_params import SamplingParams  # the one shared with serving


@runtime_checkable
class Drafter(Protocol):
    forwards: int

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None: ...

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]: ...

    def rollback(self, length: int) -> None: ...


def draw_draft(logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens from logits (..., V): the argmax when greedy (probabilities None: one-hot), else one
    sample of `sampling.probs` per row, returned with those probabilities (..., V), the q the rule needs.
    Tokens (...,) on the logits' device; the draw uses `generator` on its own device."""
    if sampling.greedy:
        return logits.argmax(-1), None
    p = sampling.probs(logits)
    return draw_from(p, generator), p


class ModelDrafter:
    """A draft `TransformerLM` decoding autoregressively with its own KV cache.

    The cache holds a prefix of the sequence; `propose` first feeds whatever the draft has not seen
    (the last emitted token, plus the last draft token when every draft was accepted), then runs one
    forward per further proposed token.
    """

    def __init__(self, model: TransformerLM):
        if not isinstance(model, TransformerLM):
            raise TypeError(f"draft model must be a TransformerLM, got {type(model).__name__}")
        self.model = model
        self.cache = None
        self.forwards = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None:
        self.cache = self.model.new_cache(1, max_seq_len, max_rollback=max_rollback)
        self.forwards = 0
        self.model(torch.tensor([prompt], device=self.model.device), cache=self.cache, last_only=True)  # prefill

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        tokens, probs = [], []
        if n == 0:
            return [], None
        unseen = sequence[self.cache.length:]  # (1 or 2 tokens in steady state)
        ids = torch.tensor([unseen], device=self.model.device)
        for _ in range(n):
            logits = self.model(ids, cache=self.cache, last_only=True)[0, -1]                  # (V,)
            self.forwards += 1
            token, p = draw_draft(logits, sampling, generator)
            if p is not None:
                probs.append(p)
            tokens.append(token)
            ids = token.reshape(1, 1)
        token_list = torch.stack(tokens).tolist() if tokens else []  # one device sync for all n
        return token_list, (torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        if self.cache.length > length:
            self.cache.truncate(length)
