"""`SamplingParams`: how one request turns logits into tokens, and when it stops.

One dataclass for every user: the serving engine (a request's limits, stop tokens and samples) and
speculative decoding (draft and target sample the same filtered distribution, `probs`). The fields
follow vLLM's names. Checks that need the model (token ids < vocab_size, max_tokens within the
context) happen where the model is known: the engine's `add_request`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .. import _checks
from .sampling import _check_sampling_args, logits_to_probs

MAX_SEED = 2**64 - 1                       # the largest seed torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0               # 0 = greedy
    top_k: int | None = None               # keep the k most likely tokens
    top_p: float | None = None             # keep the smallest set holding this much probability
    _: KW_ONLY
    max_tokens: int = 16                   # most tokens generated per sample (vLLM's default)
    stop_token_ids: tuple[int, ...] = ()   # a sample ends at the first of these (included in its output)
    n: int = 1                             # samples per prompt: they share the prompt's KV blocks (fork)
    seed: int | None = None                # sample i draws from torch.Generator seeded seed + i

    def __post_init__(self):
        _check_sampling_args(self.temperature, self.top_k, self.top_p)
        _checks.positive_int("max_tokens", self.max_tokens)
        _checks.positive_int("n", self.n)
        if self.seed is not None:   # torch.Generator takes a 64-bit unsigned seed; sample i uses seed + i
            _checks.integer("seed", self.seed, 0, MAX_SEED - (self.n - 1),
                            allowed=f"None or an int in [0, 2**64 - n] (sample i seeds seed + i; n = {self.n})")
        stop = self.stop_token_ids
        if isinstance(stop, int) and not isinstance(stop, bool):
            stop = (stop,)
        if not isinstance(stop, (list, tuple, set, frozenset)):
            raise TypeError(f"stop_token_ids must be a sequence of int token ids, got {type(stop).__name__} {stop!r}")
        for t in stop:
            _checks.integer("stop_token_ids", t, 0, allowed="non-negative int token ids")
        object.__setattr__(self, "stop_token_ids", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from (..., V): temperature, then top-k, then top-p."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)


__all__ = ["MAX_SEED", "SamplingParams"]
