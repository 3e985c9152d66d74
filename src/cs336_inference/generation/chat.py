"""Streaming generation into a cache that outlives one call, and what a chat turn reports.

`extend(model, cache, ids)` appends tokens to whatever the cache already holds (a prompt, or a new
turn of a conversation) and returns the next-token logits; `stream(...)` then yields tokens one at a
time as they are decoded, so a user sees the answer grow. `TextStream` detokenizes incrementally;
`TurnStats` times one turn (TTFT, decode tokens/s). The chat session itself runs on the serving
engine, so several conversations share one paged KV cache: `serving.ChatSession`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import _check_sampling_args, sample_next_token


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

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.generated_tokens > 1 and self.decode_s > 0 else 0.0
