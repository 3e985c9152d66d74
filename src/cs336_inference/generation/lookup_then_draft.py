"""Copy where the context repeats itself, draft where it does not: prompt lookup with a drafter behind it.

Prompt lookup (`prompt_lookup`) proposes nothing when the last few tokens occur nowhere earlier, and
a learned drafter (an EAGLE draft, Medusa heads, a small model) rarely guesses a long copied span
as well as the copy itself. `LookupThenDraft` asks lookup first and, in the passes where it finds no
earlier occurrence, asks the fallback drafter: copied answers get lookup's long runs, free text
gets the drafter's guesses (the probe behind it: docs/log.md, 2026-12-05).

Why the output stays exact: the rule (`speculative_rule`) needs, for each draft token, the
distribution it was drawn from given the tokens before it. Which source proposes is decided from the
sequence alone, before anything is drawn, so within a pass the drafts come from one source and that
source's distribution is what goes to the rule: one-hot for lookup's copy (probabilities None), the
fallback's own probabilities for its samples. Greedy decoding needs even less (the target's argmax
decides); sampled decoding is exact for either source, and so for the pass whichever it was.

The fallback must not lose track while lookup proposes: `observe`, `rollback` and `start` always go
to it. An EAGLE draft keeps the target's features it has not read (`pending`) and reads them all at
its next `propose`, however many passes went by; a model drafter feeds the tokens its cache lacks.
"""

from __future__ import annotations

import torch

from .drafters import Drafter, SamplingParams
from .prompt_lookup import PromptLookupDrafter


class LookupThenDraft:
    """The `Drafter` protocol: prompt lookup's continuation where the last `min_ngram`..`max_ngram`
    tokens occur earlier in the sequence, the `fallback` drafter's proposal otherwise.

    lookup_passes / draft_passes: how many passes (since `start`) each source proposed in.
    `forwards`, and `observe` and `target` where the fallback reads the target's features, are the
    fallback's (the loop computes features only for a drafter that has `observe`).
    """

    def __init__(self, fallback: Drafter, max_ngram: int = 4, min_ngram: int = 2):
        if not isinstance(fallback, Drafter):
            raise TypeError(f"fallback must be a Drafter (start/propose/rollback/forwards: EagleDrafter, "
                            f"MedusaDrafter, ModelDrafter), got {type(fallback).__name__}")
        self.lookup = PromptLookupDrafter(max_ngram, min_ngram)   # checks the n-gram sizes
        self.fallback = fallback
        self.lookup_passes, self.draft_passes = 0, 0

    @property
    def forwards(self) -> int:
        return self.fallback.forwards

    @property
    def observe(self):
        """The fallback's `observe` (AttributeError where it reads no features: then the loop computes none)."""
        return self.fallback.observe

    @property
    def target(self):
        """The model whose features the fallback reads (AttributeError where it reads none)."""
        return self.fallback.target

    @property
    def model(self):
        """The fallback's draft model, where it has one (the loop checks it fits the sequence)."""
        return self.fallback.model

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None:
        self.fallback.start(prompt, max_seq_len, max_rollback)
        self.lookup_passes, self.draft_passes = 0, 0

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        if n == 0:
            return [], None
        copied, _ = self.lookup.propose(sequence, n, sampling)
        if copied:   # one-hot: the copy is a function of the sequence
            self.lookup_passes += 1
            return copied, None
        self.draft_passes += 1
        return self.fallback.propose(sequence, n, sampling, generator)

    def rollback(self, length: int) -> None:
        self.fallback.rollback(length)
