"""`chat` over tensor-parallel ranks: the conversation lives here, the engine on rank 0 of N worker processes.

`TensorParallelStreams` has `RequestStreams.generate`'s contract, so a `serving.ChatSession` runs its turns
on it unchanged: each turn's prompt ids and sampling go to rank 0 through a queue; rank 0 serves them on
the tensor-parallel engine (`parallel.engine`: it schedules and broadcasts every step, each rank runs its
shard; prefix caching keeps the earlier turns' blocks) and sends the new tokens back as they are sampled.
The ranks run under `launch` in a background thread of this process: a rank that dies stops the others,
and the next read here raises its `RankFailedError`. The ranks ignore SIGINT (Ctrl-C in the terminal
reaches every process of its group): stopping an answer is this process's business, and it aborts the
request on rank 0. `close()` stops every rank.
"""

from __future__ import annotations

import queue
import signal
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..serving.chat import RequestStreams
from .engine import sharded_engine
from .generate import named_config
from .launch import launch
from .tensor_parallel import check_tensor_parallel

POLL_S = 0.1


def _chat_rank(model: str, dtype, engine_options: dict, requests, replies):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine, runner = sharded_engine(model, dtype, **engine_options)
    if engine is None:
        runner.follow()
        return None
    streams = RequestStreams(engine)
    try:
        while (message := requests.get()) is not None:
            if message[0] != "generate":   # an abort that came after its answer ended
                continue
            _, prompt_ids, params = message
            quit_after = _answer(streams, prompt_ids, params, requests, replies)
            replies.put(("done",))
            if quit_after:
                break
    finally:
        runner.stop()
    return {"communication": runner.communication(), "world_size": dist.get_world_size()}


def _answer(streams: RequestStreams, prompt_ids, params, requests, replies) -> bool:
    """Stream one answer to `replies`; stop early on an ("abort",) or None (quit: returns True)."""
    try:
        stream = streams.stream(streams.add(prompt_ids, params))
    except (ValueError, TypeError) as err:
        replies.put(("error", str(err)))
        return False
    try:
        for out in stream:
            if out.error is not None:
                replies.put(("error", out.error))
                return False
            replies.put(("tokens", out.new_token_ids, out.num_cached_tokens))
            try:
                message = requests.get_nowait()
            except queue.Empty:
                continue
            return message is None   # abort (or quit): closing the stream aborts the request
    finally:
        stream.close()
    return False


class TensorParallelStreams:
    """`generate(prompt_ids, params)` over an engine on rank 0 of `world_size` local ranks (gloo).

    model: a name `load_pretrained` knows. engine_options: the engine's (block_size, num_blocks, ...)."""

    def __init__(self, model: str, world_size: int, dtype: torch.dtype | None = None, timeout_s: float | None = None,
                 **engine_options):
        check_tensor_parallel(named_config(model), world_size)   # refused before any process starts
        ctx = mp.get_context("spawn")
        self._requests, self._replies = ctx.Queue(), ctx.Queue()
        self.result, self._error = None, None
        self._thread = threading.Thread(target=self._run, daemon=True, name="tp-chat-ranks",
                                        args=(model, world_size, dtype, engine_options, timeout_s))
        self._thread.start()

    def _run(self, model, world_size, dtype, engine_options, timeout_s) -> None:
        try:
            self.result = launch(_chat_rank, world_size, model, dtype, engine_options, self._requests,
                                 self._replies, timeout_s=timeout_s)
        except BaseException as err:   # raised to the caller by the next read
            self._error = err

    def _get(self):
        while True:
            try:
                return self._replies.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise self._error or RuntimeError("the tensor-parallel ranks stopped") from None

    def generate(self, prompt_token_ids: list[int], params):
        """Yield (new token ids, prompt tokens found in the prefix cache) as rank 0 samples them."""
        self._requests.put(("generate", list(prompt_token_ids), params))
        done, error = False, None
        try:
            while True:
                reply = self._get()
                if reply[0] == "done":
                    done = True
                    if error is not None:
                        raise ValueError(error)
                    return
                if reply[0] == "error":
                    error = reply[1]
                else:
                    yield reply[1], reply[2]
        finally:
            if not done and self._thread.is_alive():   # stopped early: abort it there, drop what is on its way
                self._requests.put(("abort",))
                while self._get()[0] != "done":
                    pass

    def close(self, timeout_s: float = 30) -> None:
        """Stop every rank (rank 0 tells the others); wait for them."""
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout_s)
        if self._error is not None and not isinstance(self._error, KeyboardInterrupt):
            raise self._error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["TensorParallelStreams"]
