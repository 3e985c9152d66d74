"""One sample being generated for a request: its tokens, where it is in the queue, its clock.

A request with n samples starts as one sequence (the leader) that prefills the prompt once; right
after, the engine forks n - 1 siblings that share the prompt's blocks. A preempted sequence loses
its cache and waits again; when re-admitted it prefills prompt + everything it generated so far
(recompute), then continues where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .request import Request


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    sample_index: int = 0
    token_ids: list[int] = field(default_factory=list)   # prompt + generated so far
    num_forks_pending: int = 0                           # leader: siblings to fork after its prefill
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0          # leading tokens whose K/V are in the cache
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.request.prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_samples(self) -> int:
        """Sequences this one becomes once its pending forks happen."""
        return 1 + self.num_forks_pending

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.request.max_new_tokens

    def append(self, token: int, time: float) -> bool:
        """Record a sampled token; True if the sequence is now finished (stop token or length)."""
        self.token_ids.append(token)
        self.token_times.append(time)
        if token in self.request.sampling.stop_tokens:
            self.finish_reason = "stop"
        elif len(self.output) >= self.request.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


__all__ = ["Sequence", "SequenceStatus"]
