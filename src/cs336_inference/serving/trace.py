"""Request traces: live traffic in miniature.

Requests arrive at random times (a Poisson process: independent exponential gaps, `rate` requests
per second on average), with prompts and outputs of different lengths, many of them behind the same
system prompt, and some asking for n > 1 samples of one prompt. Those are the three reasons a
serving engine cannot simply batch and pad: arrival times, lengths and shared prefixes differ.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from .. import _checks
from .request import Request, SamplingParams


@dataclass(frozen=True)
class TraceConfig:
    num_requests: int = 64
    rate: float = 20.0                     # mean arrivals per second (inf: all at time 0)
    prompt_len: tuple[int, int] = (16, 96)  # user part of the prompt, uniform in [lo, hi]
    max_new_tokens: int = 128              # the client's limit (outputs may stop earlier)
    stop_tokens: tuple[int, ...] = ()      # e.g. newline: an answer ends with its line
    system_prompt_fraction: float = 0.5    # share of requests that start with the system prompt
    sampled_fraction: float = 0.0          # share of requests asking for n_samples at temperature
    n_samples: int = 4
    temperature: float = 0.8
    seed: int = 0

    def __post_init__(self):
        _checks.positive_ints(num_requests=self.num_requests, max_new_tokens=self.max_new_tokens,
                              n_samples=self.n_samples)
        if not _checks._is_number(self.rate) or not self.rate > 0:  # inf: everything arrives at 0
            raise ValueError(f"rate must be a number > 0 (requests per second; inf: all at once), got {self.rate!r}")
        _checks.non_negative_float("temperature", self.temperature)
        _checks.integer("seed", self.seed)
        lo_hi = self.prompt_len
        if (not isinstance(lo_hi, (tuple, list)) or len(lo_hi) != 2 or not all(_checks._is_int(x) for x in lo_hi)
                or not 1 <= lo_hi[0] <= lo_hi[1]):
            raise ValueError(f"prompt_len must be (lo, hi) ints with 1 <= lo <= hi, got {self.prompt_len!r}")
        for name in ("system_prompt_fraction", "sampled_fraction"):
            _checks.probability(name, getattr(self, name))


def poisson_arrivals(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process: cumulative sums of exponential gaps with mean 1 / rate."""
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def make_trace(source_ids, config: TraceConfig = TraceConfig(), system_prompt=()) -> list[Request]:
    """Requests whose user prompts are slices of `source_ids` (a 1-D token sequence: real text makes
    the outputs real), some prefixed by `system_prompt`. Deterministic in `config.seed`."""
    source = [int(t) for t in source_ids]
    lo, hi = config.prompt_len
    if len(source) <= hi:
        raise ValueError(f"source_ids has {len(source)} tokens, need more than prompt_len[1] = {hi}")
    rng = random.Random(config.seed)
    requests = []
    for i, arrival in enumerate(poisson_arrivals(config.num_requests, config.rate, rng)):
        length = rng.randint(lo, hi)
        start = rng.randrange(len(source) - length)
        prompt = source[start:start + length]
        if system_prompt and rng.random() < config.system_prompt_fraction:
            prompt = list(system_prompt) + prompt
        if rng.random() < config.sampled_fraction:
            sampling = SamplingParams(temperature=config.temperature, n=config.n_samples,
                                      seed=config.seed * 100_003 + i, stop_token_ids=config.stop_tokens)
        else:
            sampling = SamplingParams(stop_token_ids=config.stop_tokens)
        requests.append(Request(i, tuple(prompt), config.max_new_tokens, arrival, sampling))
    return requests



def make_chat_trace(tokenizer, source_ids, config: TraceConfig = TraceConfig(), system_prompt: str | None = None,
                    instruction: str = "Summarize this text in one sentence.") -> list[Request]:
    """Chat requests for an instruction-tuned model: `make_trace`'s arrivals, lengths and sampling,
    each user message = `instruction` + a slice of `source_ids` (decoded), formatted with the
    tokenizer's chat template; a share `config.system_prompt_fraction` of them carry `system_prompt`
    (the others get the template's default one). Answers end at the tokenizer's stop tokens."""
    raw = make_trace(source_ids, TraceConfig(**{**config.__dict__, "system_prompt_fraction": 0.0}))
    rng = random.Random(config.seed + 1)
    stop = tuple(tokenizer.stop_ids)
    requests = []
    for r in raw:
        messages = [{"role": "user", "content": f"{instruction}\n\n{tokenizer.decode(list(r.prompt))}"}]
        if system_prompt is not None and rng.random() < config.system_prompt_fraction:
            messages.insert(0, {"role": "system", "content": system_prompt})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        sampling = dataclasses.replace(r.sampling, stop_token_ids=stop)
        requests.append(Request(r.request_id, tuple(prompt), r.max_new_tokens, r.arrival_time, sampling))
    return requests


__all__ = ["TraceConfig", "make_chat_trace", "make_trace", "poisson_arrivals"]
