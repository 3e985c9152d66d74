"""One sample being generated for a request: its tokens, where it is in the queue, its clock.

A request with n samples starts as one sequence (the leader) that prefills the prompt once; right
after, the scheduler forks n - 1 siblings that share the prompt's blocks. A preempted sequence loses
its cache and waits again; when re-admitted it prefills prompt + everything it generated so far
(recompute), then continues where it stopped.

The sequence is the one owner of its token ids; its block table only counts the slots it holds.
`num_computed_tokens` (vLLM v1's name) is how many leading tokens have their K/V in the cache: a
prefill (maybe in chunks) raises it to the prompt's length, then each decode step by one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .request import Request


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: Hashable
    request: Request
    sample_index: int = 0
    token_ids: list[int] = field(default_factory=list)   # prompt + generated so far
    generator: torch.Generator | None = None             # None: greedy, or the global RNG
    pending_forks: list = field(default_factory=list)    # leader: its siblings' generators, forked after its prefill
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0   # leading tokens whose K/V are in the cache
    num_cached_tokens: int = 0     # of those, taken from the prefix cache at (first) admission
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    prompt_len: int = field(init=False)   # len(request.prompt), kept: the hot loop reads it every step
    # speculative decoding (`serving/speculative.py`): this step's proposed tokens and the distribution
    # each was drawn from ((k, V), None: one-hot), the proposer's own per-sequence state, and how many
    # tokens the last step appended (1 without speculation)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    proposer_state: object = None
    num_new_tokens: int = 1

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.request.prompt)
        self.prompt_len = len(self.request.prompt)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_samples(self) -> int:
        """Sequences this one becomes once its pending forks happen."""
        return 1 + len(self.pending_forks)

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.request.sampling.max_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model (the prompt's rest, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed_tokens

    def append(self, token: int, time: float) -> bool:
        """Record a sampled token; True if the sequence is now finished (stop token or length)."""
        self.token_ids.append(token)
        self.token_times.append(time)
        if token in self.request.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) - self.prompt_len >= self.request.sampling.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def fork(self, sample_index: int, generator: torch.Generator | None) -> "Sequence":
        """Sibling sample `sample_index`: the same tokens, the same cache, its own generator."""
        return Sequence((self.seq_id, sample_index), self.request, sample_index, list(self.token_ids), generator,
                        status=SequenceStatus.RUNNING, num_computed_tokens=self.num_computed_tokens,
                        num_cached_tokens=self.num_cached_tokens)


__all__ = ["Sequence", "SequenceStatus"]
