"""One HTTP request's choices, each an engine request, as one stream of text deltas.

A completion asks for `n` answers to each of its prompts: choice `i` is engine request `i`, so
they run side by side in the batch and prefix caching shares the prompt's blocks. `run_choice`
turns one engine stream into text deltas (and stops it at a stop string); `merge` interleaves
several in the order their deltas arrive. Closing either aborts every engine request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from .detokenizer import IncrementalDetokenizer
from .protocol import OpenAIError, param_of


@dataclass
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None          # "stop" | "length" once the choice has ended, else None
    num_tokens: int                    # tokens generated so far by this choice


@dataclass
class Choice:
    index: int
    prompt_token_ids: list[int]
    sampling_params: object
    stop: list[str]


async def run_choice(engine, choice: Choice, tokenizer, request_id: str,
                     on_tokens: Callable[[int, int], None] | None = None) -> AsyncIterator[ChoiceDelta]:
    """The text deltas of one engine request. A request the engine refuses raises OpenAIError(400).
    on_tokens(choice index, k) is called as each batch of k tokens arrives (the server's latency metrics)."""
    detok = IncrementalDetokenizer(tokenizer, choice.stop, choice.sampling_params.stop_token_ids)
    try:
        outputs = engine.generate(choice.prompt_token_ids, choice.sampling_params, request_id=request_id)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.finish_reason == "error":
                    raise OpenAIError(out.error or "the engine could not serve this request", param="max_tokens")
                if on_tokens is not None and out.new_token_ids:
                    on_tokens(choice.index, len(out.new_token_ids))
                text = detok.push(out.new_token_ids, final=out.finished)
                if detok.stopped:                  # a stop string: leaving the loop aborts the request
                    yield ChoiceDelta(choice.index, text, "stop", detok.num_tokens)
                    return
                reason = ("length" if out.finish_reason == "length" else "stop") if out.finished else None
                if text or reason:
                    yield ChoiceDelta(choice.index, text, reason, detok.num_tokens)
    except (ValueError, TypeError) as error:       # refused at the engine's intake
        raise OpenAIError(str(error), param=param_of(error)) from None


async def merge(streams: list) -> AsyncIterator[ChoiceDelta]:
    """Deltas of several choice streams as they come; the first error ends all of them."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for delta in streams[0]:
                yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    queue.put_nowait(delta)      # bounded: a choice yields at most max_tokens deltas
            queue.put_nowait(done)
        except Exception as error:  # handed to the consumer, which re-raises it
            queue.put_nowait(error)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Choice", "ChoiceDelta", "merge", "run_choice"]
