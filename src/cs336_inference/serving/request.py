"""What a client sends (`Request`, `SamplingParams`) and what it gets back (`RequestOutput`).

Times are seconds on the engine's clock, which starts at 0 with the trace. Per request we record
arrival, when it was first scheduled (queueing time = that minus arrival), when every token
existed on the host (the first one gives the time to first token, TTFT), and when it finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from ..generation.sampling import _check_sampling_args


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    n: int = 1                        # samples per prompt: they share the prompt's KV blocks (fork)
    seed: int | None = None           # sample i draws from torch.Generator seeded seed + i
    stop_tokens: tuple[int, ...] = ()  # a sample ends at the first of these (included in the output)

    def __post_init__(self):
        _check_sampling_args(self.temperature, self.top_k, self.top_p)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (samples per prompt), got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclass(frozen=True)
class Request:
    request_id: Hashable
    prompt: tuple[int, ...]            # token ids
    max_new_tokens: int                # the client's limit (what a contiguous allocator must reserve)
    arrival_time: float = 0.0          # seconds after the trace starts
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self):
        prompt = tuple(self.prompt)
        if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt):
            raise ValueError(f"request {self.request_id!r}: prompt must be a non-empty sequence of "
                             f"non-negative int token ids, got {self.prompt!r:.80}")
        object.__setattr__(self, "prompt", prompt)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be an int >= 1, "
                             f"got {self.max_new_tokens!r}")
        if not isinstance(self.arrival_time, (int, float)) or not self.arrival_time >= 0:
            raise ValueError(f"request {self.request_id!r}: arrival_time must be a number >= 0, "
                             f"got {self.arrival_time!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")


@dataclass
class RequestOutput:
    request_id: Hashable
    prompt_len: int
    arrival_time: float
    tokens: list[list[int]]                  # per sample
    token_times: list[list[float]]           # per sample, when each token existed
    finish_reasons: list[str]                # per sample: "stop" or "length"
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    cached_prompt_tokens: int = 0            # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0

    @property
    def queueing_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float:
        """Arrival to the first token of the first sample that has one."""
        return min(times[0] for times in self.token_times if times) - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for times in self.token_times for a, b in zip(times, times[1:])]

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time


__all__ = ["Request", "RequestOutput", "SamplingParams"]
