"""What a client sends (`Request`, with its `SamplingParams`) and what it gets back: a stream of
`RequestOutput` deltas while it runs (what `Engine.step` returns), and one `RequestRecord` per
request once a whole trace is served (what `Engine.run` returns and the metrics read).

Times are seconds on the engine's clock (see engine.py). Per request we record arrival, when it was
first scheduled (queueing time = that minus arrival), when every token existed on the host (the
first one gives the time to first token, TTFT), and when it finished.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Hashable

from ..generation.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Request:
    """One request of a trace. `max_new_tokens` is the client's limit (what a contiguous allocator
    must reserve); it is written into `sampling.max_tokens`, which the engine reads."""

    request_id: Hashable
    prompt: tuple[int, ...]            # token ids
    max_new_tokens: int
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
        if (isinstance(self.arrival_time, bool) or not isinstance(self.arrival_time, (int, float))
                or not math.isfinite(self.arrival_time) or self.arrival_time < 0):
            raise ValueError(f"request {self.request_id!r}: arrival_time must be a finite number >= 0 "
                             f"(seconds), got {self.arrival_time!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.sampling.max_tokens != self.max_new_tokens:
            object.__setattr__(self, "sampling", dataclasses.replace(self.sampling, max_tokens=self.max_new_tokens))


@dataclass(kw_only=True)
class RequestOutput:
    """What one engine step produced for one sample of a request: its new tokens and whether it ended.

    A request with n samples gets one output per sample (`index`, as OpenAI's `choices[i].index`);
    an output comes whenever a sample got tokens or finished. `finish_reason`: "stop" (a stop token,
    included in the tokens), "length" (max_tokens), "abort" (`Engine.abort`) or "error" (refused:
    `error` says why, e.g. it can never fit in the KV pool).
    """

    request_id: Hashable
    new_token_ids: list[int]           # this step's tokens of this sample, in order
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0                     # which sample (0 .. n - 1)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0         # this sample's tokens so far, these included
    num_cached_tokens: int = 0         # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0           # this sample's, so far
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    time: float = 0.0                  # when these tokens existed (engine clock)


@dataclass(kw_only=True)
class RequestRecord:
    """A whole request after a run: every sample's tokens and the time each token existed."""

    request_id: Hashable
    prompt_len: int
    arrival_time: float
    tokens: list[list[int]]                  # per sample
    token_times: list[list[float]]           # per sample, when each token existed
    finish_reasons: list[str]                # per sample: one of FINISH_REASONS
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    cached_prompt_tokens: int = 0            # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0
    error: str | None = None                 # why the request was refused (finish reason "error")

    @property
    def completed(self) -> bool:
        """Served (not refused or aborted) with at least one token."""
        return self.error is None and "abort" not in self.finish_reasons and any(self.token_times)

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


__all__ = ["FINISH_REASONS", "Request", "RequestOutput", "RequestRecord", "SamplingParams"]
