"""Streaming generation into a cache that outlives one call, and what a chat turn reports.

`extend(model, cache, ids)` appends tokens to whatever the cache already holds (a prompt, or a new
turn of a conversation) and returns the next-token logits; `stream(...)` then yields tokens one at a
time as they are decoded, so a user sees the answer grow. `TextStream` detokenizes incrementally;
`TurnStats` times one turn (TTFT, decode tokens/s). `ConversationCache` keeps one conversation's
contiguous cache between turns and decodes with a compiled step: what the `chat` command runs. The
chat session (`serving.ChatSession`) runs its turns either there or on the serving engine, where
several conversations share one paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .sampling import _check_sampling_args, sample_next_token
from .sampling_params import SamplingParams


@torch.inference_mode()
def extend(model, cache, ids: list[int]) -> torch.Tensor:
    """Append token ids (one sequence) after the cache's contents; return logits (V,) for the next token."""
    if not ids:
        raise ValueError("ids must hold at least one token (the logits come from the last one)")
    x = torch.tensor([ids], device=model.device)
    return model(x, cache=cache, start_pos=cache.length, last_only=True)[0, -1]


@torch.inference_mode()
def stream(model, cache, logits: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, stop_tokens=(),
           generator: torch.Generator | None = None, decode=None):
    """Yield up to `max_new_tokens` token ids, sampled from `logits` and then from each decode step.

    Every yielded token except the last is already in the cache when the next one is yielded; a
    stop token (yielded too) ends the stream. The caller may stop iterating at any time. decode:
    `step(token_ids (1,), cache) -> logits (1, V)` to run each step (a `compile_decode` step), else
    the model's own forward.
    """
    _check_sampling_args(temperature, top_k, top_p)
    stop = {int(t) for t in stop_tokens}
    for step in range(max_new_tokens):
        token = int(sample_next_token(logits, temperature, top_k, top_p, generator))
        yield token
        if token in stop or step == max_new_tokens - 1 or cache.length >= cache.max_seq_len:
            return
        if decode is not None:
            logits = decode(torch.tensor([token], device=model.device), cache)[0]
        else:
            logits = model(torch.tensor([[token]], device=model.device), cache=cache, start_pos=cache.length)[0, -1]


class ConversationCache:
    """One conversation's KV cache, kept between turns: the fast path for a single user.

    Each turn's prompt is the whole conversation so far (re-rendered), so its start is usually in the
    cache already: `generate` keeps the longest cached prefix, rolls back the rest (the cache's
    `truncate`), prefills only the new tokens and streams the answer through `decode` (a compiled step
    from `compile_decode`, or None for the model's forward). A contiguous cache and one sequence: no
    scheduler or block table in the token's path, unlike the serving engine.
    """

    def __init__(self, model, max_seq_len: int, decode=None):
        self.model, self.decode = model, decode
        self.cache = model.new_cache(1, max_seq_len)
        self.tokens: list[int] = []    # the ids whose keys/values the cache holds, in order

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def warm_up(self) -> None:
        """Run one prefill and one decode step (the compile, if `decode` compiles), then forget them."""
        for _ in stream(self.model, self.cache, extend(self.model, self.cache, [0]), 2, decode=self.decode):
            pass
        self.cache.truncate(0)
        self.tokens = []

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[tuple[list[int], int]]:
        """Yield ([token], prompt tokens reused from the cache) for each answer token, as it is decoded."""
        ids = list(prompt_token_ids)
        keep = 0   # the prompt's last token is always recomputed: its logits start the answer
        while keep < min(len(self.tokens), len(ids) - 1) and self.tokens[keep] == ids[keep]:
            keep += 1
        self.cache.truncate(keep)
        self.tokens = ids[:keep]
        logits = extend(self.model, self.cache, ids[keep:])
        self.tokens, generated = ids, []
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.model.device).manual_seed(params.seed)
        try:
            for token in stream(self.model, self.cache, logits, params.max_tokens, params.temperature, params.top_k,
                                params.top_p, params.stop_token_ids, generator, self.decode):
                generated.append(token)
                yield [token], keep
        finally:   # an answer cut short keeps what reached the cache
            self.tokens = (ids + generated)[:self.cache.length]


class TextStream:
    """Incremental detokenization: the text added by each new token, holding back a split UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):          # a multi-byte character is not complete yet
            return ""
        new, self.shown = text[len(self.shown):], text
        return new


@dataclass
class TurnStats:
    prompt_tokens: int          # tokens the turn had to prefill (new ones only)
    reused_tokens: int          # tokens of the conversation already in the cache
    generated_tokens: int
    ttft_s: float               # from the call to the first answer token
    decode_s: float             # from the first to the last answer token
    stopped: bool = False       # the answer was cut short by its reader (Ctrl-C in `chat`)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.generated_tokens > 1 and self.decode_s > 0 else 0.0
