"""Streaming generation into a cache that outlives one call, and a chat session built on it.

`extend(model, cache, ids)` appends tokens to whatever the cache already holds (a prompt, or a new
turn of a conversation) and returns the next-token logits; `stream(...)` then yields tokens one at a
time as they are decoded, so a user sees the answer grow. `ChatSession` keeps one conversation's
tokens and KV cache across turns: each turn renders the whole conversation with the model's chat
template, keeps the longest prefix of tokens the cache already holds (usually everything: only the
new user message is prefilled, never the conversation again; `truncate` rolls back where it
differs) and streams the answer, timing each turn (TTFT, decode tokens/s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
           generator: torch.Generator | None = None):
    """Yield up to `max_new_tokens` token ids, sampled from `logits` and then from each decode step.

    Every yielded token except the last is already in the cache when the next one is yielded; a
    stop token (yielded too) ends the stream. The caller may stop iterating at any time.
    """
    _check_sampling_args(temperature, top_k, top_p)
    stop = {int(t) for t in stop_tokens}
    for step in range(max_new_tokens):
        token = int(sample_next_token(logits, temperature, top_k, top_p, generator))
        yield token
        if token in stop or step == max_new_tokens - 1 or cache.length >= cache.max_seq_len:
            return
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


@dataclass
class ChatSession:
    """A conversation with `model`: messages, their tokens in the cache, and per-turn timings.

    Tokenizers with `apply_chat_template` get the model's own format; others (the byte-level toy
    models) see the raw text of each message followed by a newline.
    """

    model: object
    tokenizer: object
    system: str | None = None
    max_seq_len: int | None = None          # cache capacity (default: min(context_length, 2048))
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)   # exactly what the cache holds
    history: list[TurnStats] = field(default_factory=list)

    def __post_init__(self):
        context = self.model.config.context_length
        self.max_seq_len = min(context, 2048) if self.max_seq_len is None else self.max_seq_len
        if not 0 < self.max_seq_len <= context:
            raise ValueError(f"max_seq_len must be in [1, context_length={context}], got {self.max_seq_len}")
        self.cache = self.model.new_cache(1, self.max_seq_len)
        if self.system is not None:
            self.messages.append({"role": "system", "content": self.system})

    def _render(self, messages) -> list[int]:
        if hasattr(self.tokenizer, "apply_chat_template") and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        return self.tokenizer.encode("".join(m["content"] + "\n" for m in messages))

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.ids = []
        self.cache.truncate(0)

    def send(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, generator: torch.Generator | None = None):
        """Add a user message and yield the answer's text pieces as they are generated; its stats land
        in `history`. The answer joins `messages` when the stream is exhausted."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        t0 = time.perf_counter()
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self._render(messages)
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"the conversation ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                             f"the cache's {self.max_seq_len} tokens; reset() the session or ask for fewer tokens")
        reused = 0
        while reused < min(len(ids) - 1, len(self.ids)) and ids[reused] == self.ids[reused]:
            reused += 1
        self.cache.truncate(reused)                      # drop what the new rendering does not share
        logits = extend(self.model, self.cache, ids[reused:])
        stop = list(getattr(self.tokenizer, "stop_ids", []))
        detok, generated, first = TextStream(self.tokenizer), [], None
        for token in stream(self.model, self.cache, logits, max_new_tokens, temperature, top_k, top_p, stop, generator):
            first = first or time.perf_counter()
            generated.append(token)
            piece = "" if token in stop else detok.push(token)
            if piece:
                yield piece
        last = time.perf_counter()
        self.ids = ids + generated[:-1]                  # the last token was sampled, never fed back
        answer = self.tokenizer.decode([t for t in generated if t not in stop])
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.history.append(TurnStats(len(ids) - reused, reused, len(generated), first - t0, last - first))
