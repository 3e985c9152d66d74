"""`AsyncEngine`: the online `Engine` behind an asyncio API, one token stream per request.

    async with AsyncEngine(engine) as served:
        async for out in served.generate(prompt_ids, SamplingParams(max_tokens=32)):
            print(out.new_token_ids)            # this step's tokens (or several, if we fell behind)

The engine is single-threaded, so exactly one thread drives it: a background thread that drains a
command queue (new requests, aborts) between steps and steps the engine while any request is
unfinished. When nothing is left it sleeps on a condition variable until the next command arrives
(no polling). Each step's deltas cross to the event loop in one `call_soon_threadsafe`, where every
request keeps one slot that merges deltas until its consumer reads them. So a slow consumer never
stalls the engine or the other streams, and what waits for it is bounded by its own `max_tokens`;
the number of requests in flight is bounded by `max_requests`.

Leaving the stream early (the consumer broke out, its task was cancelled, an HTTP client went away)
aborts the request: the engine frees its KV blocks before its next step. Close the generator
deterministically (`contextlib.aclosing`, or `async for` to the end) so that happens at once rather
than when the garbage collector finalizes it. This is vLLM's `AsyncLLM` shape (Kwon et al. 2023),
with a thread where vLLM uses a separate engine process.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import uuid
from typing import AsyncIterator

from .. import _checks


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can be served."""


class EngineOverloadedError(RuntimeError):
    """`max_requests` requests are already in flight; try again later."""


def merge_outputs(older, newer):
    """Two consecutive deltas of one request as one: tokens concatenated, the rest from the newer."""
    return dataclasses.replace(newer, new_token_ids=list(older.new_token_ids) + list(newer.new_token_ids))


class _Stream:
    """One request's mailbox on the event loop: per sample, the deltas not yet read, merged into one."""

    def __init__(self):
        self.pending: dict = {}                    # sample index -> merged RequestOutput
        self.exception: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output) -> None:
        index = getattr(output, "index", 0)
        older = self.pending.get(index)
        self.pending[index] = output if older is None else merge_outputs(older, output)
        self.ready.set()

    def fail(self, exception: BaseException) -> None:
        self.exception = exception
        self.ready.set()

    async def get(self) -> list:
        await self.ready.wait()
        if not self.pending and self.exception is not None:
            raise self.exception
        if self.exception is None:          # else stay ready: the next call raises it
            self.ready.clear()
        outputs = list(self.pending.values())
        self.pending.clear()
        return outputs


class AsyncEngine:
    """Serve `engine` from one background thread; `generate` streams each request's deltas.

    max_requests: requests in flight (admitted, not finished) at most; one more is refused with
    `EngineOverloadedError` instead of queueing without bound.
    """

    def __init__(self, engine, max_requests: int = 4096):
        _checks.positive_int("max_requests", max_requests)
        self.engine = engine
        self.max_requests = max_requests
        self._commands: collections.deque = collections.deque()   # filled by the loop, drained by the thread
        self._wake = threading.Condition()
        self._stopping = False
        self._streams: dict[str, _Stream] = {}                     # internal id -> stream (event loop only)
        self._client_ids: dict = {}                                # caller's request_id -> internal id, while open
        self._serials = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = dict(engine.stats())                         # replaced whole by the thread
        self.error: BaseException | None = None                    # why the thread stopped, if it did

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (bound to the running event loop). `generate` calls it if needed."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the thread and wait for it (at most `timeout` seconds)."""
        if self._thread is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        # a failed step sets `error` before its thread winds down: a caller that has seen the error may
        # find the thread still alive for a moment, and the engine is dead all the same
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    def stats(self) -> dict:
        """The engine's `stats()` as of its last step (or abort), plus the streams open here."""
        return {**self._stats, "open_streams": len(self._streams)}

    # --- the API -------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params,
                       request_id: str | None = None) -> AsyncIterator:
        """Add a request and yield its `RequestOutput` deltas until every sample has finished
        (n > 1: each output's `index` says which sample it belongs to).

        A request the engine refuses at intake raises its `ValueError`/`TypeError` at the first
        `__anext__`; one it rejects later (it can never fit) ends with finish_reason "error".
        Closing the generator before the end aborts the request. `request_id` (default: a fresh
        one) names the outputs; one whose stream is still open is refused, a closed one may be reused.
        """
        self.start()
        if self.error is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        if request_id is not None and request_id in self._client_ids:
            raise ValueError(f"request_id {request_id!r} is already in flight (its stream is still open); "
                             "close that stream first or pick another id")
        if len(self._streams) >= self.max_requests:
            raise EngineOverloadedError(f"{self.max_requests} requests are in flight (max_requests); retry later")
        # the engine sees an id of ours, never reused: outputs of an earlier request under the same client
        # id (closed, its abort still on the way) cannot reach this stream
        serial = next(self._serials)
        client_id = request_id if request_id is not None else uuid.uuid4().hex
        internal_id = f"{client_id}#{serial}"
        stream = _Stream()
        self._streams[internal_id] = stream
        self._client_ids[client_id] = internal_id
        self._submit(("add", internal_id, list(prompt_token_ids), sampling_params))
        unfinished = getattr(sampling_params, "n", 1)
        try:
            while unfinished:
                for output in await stream.get():
                    unfinished -= bool(output.finished)
                    yield dataclasses.replace(output, request_id=client_id)
        finally:
            self._streams.pop(internal_id, None)
            self._client_ids.pop(client_id, None)
            if unfinished and self.error is None and not self._stopping:
                self._submit(("abort", internal_id))

    # --- the engine thread ---------------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _post(self, callback, *args) -> None:
        """Run `callback(*args)` on the event loop (nothing to tell once the loop has closed)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass

    def _run(self) -> None:
        engine, live = self.engine, set()     # live: ids added and not yet finished or aborted
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping or engine.has_unfinished()):
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                if self._stopping:
                    break
                for command in commands:
                    self._apply(command, live)
                if engine.has_unfinished():
                    outputs = engine.step()
                    live.difference_update(o.request_id for o in outputs if o.finished)
                    if outputs:
                        self._post(self._deliver, outputs)
                self._stats = dict(engine.stats())
        except BaseException as error:  # a step raised: every stream learns why, and the thread ends
            self.error = error
            self._post(self._fail_all, EngineDeadError(f"the engine stopped: {error!r}"))
        finally:
            for request_id in live:       # leave the engine clean: no blocks held by orphans
                engine.abort(request_id)
            self._stats = dict(engine.stats())

    def _apply(self, command: tuple, live: set) -> None:
        kind, request_id, *args = command
        if kind == "abort":
            if request_id in live:
                self.engine.abort(request_id)
                live.discard(request_id)
            return
        prompt_token_ids, sampling_params = args
        try:
            self.engine.add_request(prompt_token_ids, sampling_params, request_id=request_id)
        except (ValueError, TypeError) as error:   # refused at intake: only this request fails
            self._post(self._fail_one, request_id, error)
            return
        live.add(request_id)

    # --- back on the event loop ----------------------------------------------------------------
    def _deliver(self, outputs) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:      # None: its consumer left; the abort is on its way
                stream.put(output)

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "merge_outputs"]
