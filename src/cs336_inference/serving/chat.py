"""Chat on the serving engine: several conversations share one paged KV cache.

`RequestStreams` turns the engine's step-wise deltas into one stream per request (a step returns
every live request's tokens; each goes to its own queue). `ChatSession` keeps one conversation:
each turn renders the whole conversation with the model's chat template and sends it as a new
request. Prefix caching finds the blocks the previous turns already computed, so only the new
message (and the part of a block the conversation changed) is prefilled, never the conversation
again; the answer streams as it is decoded, and each turn is timed (TTFT, decode tokens/s).
Sessions given the same `RequestStreams` share its engine, its KV pool and its prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator

from ..generation.chat import TextStream, TurnStats
from ..generation.sampling_params import SamplingParams
from .block_table import blocks_for
from .engine import Engine
from .request import RequestOutput


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's prompt tokens: the model's own chat template, ending with the assistant's
    header; models without one (the byte-level toy models) see each message's text and a newline."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode("".join(m["content"] + "\n" for m in messages))


class RequestStreams:
    """A synchronous stream per request over one `Engine` (single-threaded, like the engine)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[Hashable, deque[RequestOutput]] = {}

    def add(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> Hashable:
        request_id = self.engine.add_request(prompt_token_ids, sampling_params)
        self._queues[request_id] = deque()
        return request_id

    def stream(self, request_id: Hashable) -> Iterator[RequestOutput]:
        """The request's outputs (sample 0) until it finishes, stepping the engine as needed; other
        requests' outputs wait in their own queues. Closing the stream early aborts the request."""
        queue = self._queues[request_id]
        try:
            while True:
                while queue:
                    out = queue.popleft()
                    yield out
                    if out.finished:
                        return
                for out in self.engine.step():
                    if out.request_id in self._queues and out.index == 0:
                        self._queues[out.request_id].append(out)
        finally:
            self.engine.abort(request_id)
            del self._queues[request_id]


@dataclass
class ChatSession:
    """A conversation with `model`: messages, per-turn timings, and a request per turn on `streams`
    (default: a private engine whose pool holds `max_seq_len` tokens).

    Tokenizers with `apply_chat_template` get the model's own format; others (the byte-level toy
    models) see the raw text of each message followed by a newline.
    """

    model: object
    tokenizer: object
    system: str | None = None
    max_seq_len: int | None = None          # longest conversation (default: min(context_length, 2048))
    streams: RequestStreams | None = None   # shared by several sessions to share one KV cache
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)   # the last turn's tokens whose K/V were computed
    history: list[TurnStats] = field(default_factory=list)

    def __post_init__(self):
        context = self.model.config.context_length
        self.max_seq_len = min(context, 2048) if self.max_seq_len is None else self.max_seq_len
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) \
                or not 0 < self.max_seq_len <= context:
            raise ValueError(f"max_seq_len must be an int in [1, context_length={context}], got {self.max_seq_len!r}")
        if self.streams is None:
            block_size = 16
            self.streams = RequestStreams(Engine(self.model, block_size=block_size, max_num_seqs=1, watermark_blocks=0,
                                                 num_blocks=blocks_for(self.max_seq_len, block_size)))
        if self.system is not None:
            self.messages.append({"role": "system", "content": self.system})

    def _render(self, messages) -> list[int]:
        return render_chat(self.tokenizer, messages)

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.ids = []

    def send(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None):
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
        stop = tuple(getattr(self.tokenizer, "stop_ids", []))
        params = SamplingParams(temperature, top_k, top_p, max_tokens=max_new_tokens, stop_token_ids=stop, seed=seed)
        request_id = self.streams.add(ids, params)
        detok, generated, first, reused = TextStream(self.tokenizer), [], None, 0
        for out in self.streams.stream(request_id):
            if out.error is not None:
                raise ValueError(out.error)
            if first is None:
                first, reused = time.perf_counter(), out.num_cached_tokens
            for token in out.new_token_ids:
                generated.append(token)
                piece = "" if token in stop else detok.push(token)
                if piece:
                    yield piece
        last = time.perf_counter()
        self.ids = ids + generated[:-1]                  # the last token was sampled, never fed back
        answer = self.tokenizer.decode([t for t in generated if t not in stop])
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.history.append(TurnStats(len(ids) - reused, reused, len(generated), first - t0, last - first))


__all__ = ["ChatSession", "RequestStreams", "render_chat"]
