"""A serving workload: a request trace (`TraceConfig`'s arrivals, lengths, sampling) and how many
sequences may run at once, under the name of the operating point it stands for.

The lecture's operating points differ in exactly these knobs: interactive chat (requests trickle in,
answers end at the stop token, many behind one system prompt), an offline batch job (every document
queued at once, the biggest batch that fits) and RL rollouts (n samples per prompt at temperature 1).
`requests` makes the trace over real text; `bench inference` sweeps workloads, in process and as a
client of any OpenAI-compatible server.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .. import _checks
from .client import EndpointRequest, arrival_times
from .request import Request
from .trace import TraceConfig, make_chat_trace, make_trace

SYSTEM_PROMPT = ("You are a concise assistant for a course on language-model inference. Answer in one short "
                 "paragraph of plain English.")
INSTRUCTION = "Explain what this text is about in a short paragraph."


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_len: tuple[int, int]       # tokens, uniform in [lo, hi] (before any shared system prompt)
    output_len: int                   # max_new_tokens; exact unless stop_at_eos
    concurrency: int                  # sequences running at once (the engine's max_num_seqs)
    num_requests: int
    rate: float = math.inf            # mean arrivals per second (Poisson); inf = all at t = 0 (offline)
    samples: int = 1                  # n samples per prompt (they share the prompt's KV blocks)
    temperature: float = 0.0          # 0 = greedy
    stop_at_eos: bool = False         # end at the model's stop tokens (else exactly output_len, like
                                      # vLLM's --ignore-eos for synthetic prompts)
    system_prompt_len: int = 0        # a shared prefix in front of a share of the prompts
    system_prompt_fraction: float = 0.0
    chat: bool = False                # real models with a chat template: format as chat messages
    seed: int = 0

    def __post_init__(self):
        _checks.instance("name", self.name, str)
        _checks.positive_ints(output_len=self.output_len, concurrency=self.concurrency,
                              num_requests=self.num_requests, samples=self.samples)
        _checks.non_negative_int("system_prompt_len", self.system_prompt_len)
        _checks.non_negative_float("temperature", self.temperature)
        self.trace_config()   # TraceConfig checks the prompt lengths, the rate and the fraction

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)

    def trace_config(self, stop_tokens: tuple[int, ...] = ()) -> TraceConfig:
        """The trace: every request sampled (n = samples at `temperature`) if either asks for it;
        `stop_tokens` end the answers only if stop_at_eos."""
        sampled = self.samples > 1 or self.temperature > 0
        return TraceConfig(num_requests=self.num_requests, rate=self.rate, prompt_len=tuple(self.prompt_len),
                           max_new_tokens=self.output_len, stop_tokens=tuple(stop_tokens) if self.stop_at_eos else (),
                           system_prompt_fraction=self.system_prompt_fraction,
                           sampled_fraction=1.0 if sampled else 0.0, n_samples=self.samples,
                           temperature=self.temperature if self.temperature > 0 else 1.0, seed=self.seed)

    def requests(self, source: list[int], tokenizer=None, stop_tokens: tuple[int, ...] = ()) -> list[Request]:
        """The trace over `source` (a list of token ids: prompts are slices of it), deterministic in
        `seed`. A chat workload on a tokenizer with a chat template makes each prompt a user message
        (`make_chat_trace`: a share behind SYSTEM_PROMPT); otherwise the first `system_prompt_len`
        tokens of `source` are the shared system prompt."""
        config = self.trace_config(stop_tokens)
        if self.chat and getattr(tokenizer, "chat_template", None):
            return make_chat_trace(tokenizer, source, config, SYSTEM_PROMPT, instruction=INSTRUCTION)
        offset = self.system_prompt_len
        return make_trace(source[offset:], config, system_prompt=list(source[:offset]))

    def text_requests(self, source: list[int], tokenizer, stop_tokens: tuple[int, ...] = (),
                      arrivals: str = "poisson", rate: float | None = None) -> list[EndpointRequest]:
        """The same trace as text, for a server that tokenizes it itself (`serving.client`): arrivals
        at `rate` (default the workload's; "poisson" or "fixed"), exactly output_len tokens
        (`ignore_eos`) unless stop_at_eos, which stops at the text of the non-special stop tokens."""
        trace = self.requests(source, tokenizer, stop_tokens)
        times = arrival_times(len(trace), self.rate if rate is None else rate, arrivals, self.seed)
        special = set(getattr(tokenizer, "stop_ids", []))
        stop = tuple(tokenizer.decode([t]) for t in stop_tokens if t not in special) if self.stop_at_eos else ()
        return [EndpointRequest(tokenizer.decode(list(r.prompt)), r.max_new_tokens, t, n=self.samples,
                                temperature=self.temperature, seed=self.seed * 10_007 + i if self.temperature > 0
                                else None, ignore_eos=not self.stop_at_eos, stop=stop)
                for i, (r, t) in enumerate(zip(trace, times))]


__all__ = ["INSTRUCTION", "SYSTEM_PROMPT", "Workload"]
