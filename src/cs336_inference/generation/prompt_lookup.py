"""Prompt-lookup drafting: propose tokens by copying from the context (no draft model).

When the output copies its input (editing, summarising, answering from a document, code edits),
the last few generated tokens usually occur earlier in the context, and what followed them there is
a good guess for what comes next. Find the most recent earlier occurrence of the last n tokens
(n = max_ngram down to min_ngram) and propose the tokens after it (Saxena 2023, "prompt lookup
decoding"; the same idea as LLMA, Yang et al. 2023).

A proposal is deterministic, so its draft distribution is one-hot: the target accepts token x with
probability q(x) and otherwise samples from q with x removed, which keeps the output exact.
Drafting costs a search, not a forward, so the cost ratio c is ~0 and every accepted token is profit.
"""

from __future__ import annotations

import torch

from .. import _checks
from .drafters import SamplingParams


def prompt_lookup_propose(sequence: list[int], n: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to n tokens continuing `sequence`, copied from after the most recent earlier occurrence of
    its last `ngram` tokens (longest ngram first). Empty when nothing matches (or n = 0)."""
    sequence = _checks.token_list("sequence", sequence)
    _checks.non_negative_int("n", n)
    _checks.positive_ints(max_ngram=max_ngram, min_ngram=min_ngram)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
    return _continuation(sequence, n, max_ngram, min_ngram) if n else []


def _continuation(sequence: list[int], n: int, max_ngram: int, min_ngram: int) -> list[int]:
    """`prompt_lookup_propose` on checked arguments (n >= 1). It runs once per speculative step, so it is
    one scan in plain Python: the places where the last token occurred earlier, then, longest n-gram first,
    the most recent of them that the whole n-gram precedes."""
    N = len(sequence)
    if N < 2:
        return []
    last = sequence[-1]
    ends = [i + 1 for i in range(N - 1) if sequence[i] == last]   # an earlier copy of the n-gram would end here
    for size in range(min(max_ngram, N - 1), min_ngram - 1, -1):
        pattern = sequence[N - size:]
        for end in reversed(ends):
            if end >= size and sequence[end - size:end] == pattern:
                return sequence[end:end + n]
    return []


class PromptLookupDrafter:
    """The `Drafter` protocol for prompt lookup: no cache, nothing to roll back."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        _checks.positive_ints(max_ngram=max_ngram, min_ngram=min_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.forwards = 0  # never runs a model

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None:
        pass

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], None]:
        # the speculative loop's sequence is checked token ids; a full check per step would cost more than the search
        if not isinstance(sequence, list):
            raise TypeError(f"sequence must be a list of int token ids, got {type(sequence).__name__}")
        if _checks.non_negative_int("n", n) == 0:
            return [], None
        return _continuation(sequence, n, self.max_ngram, self.min_ngram), None

    def rollback(self, length: int) -> None:
        pass
