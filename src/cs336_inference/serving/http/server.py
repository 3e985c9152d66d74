"""`serve`: an OpenAI-compatible HTTP server on the online engine (FastAPI + uvicorn, as vLLM).

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, then data: [DONE])
    GET  /v1/models, /health, /metrics           (Prometheus text: running, waiting, KV blocks, latencies)

The path of one request: a body over the limit is refused with 413 before it is read (`body_limit`);
the body is validated (`protocol`) and the prompt tokenized with the model's own tokenizer (a chat
through its own chat template) on a worker thread, so a large prompt stalls neither /health nor the
other streams; each choice becomes an engine request on the `AsyncEngine`, and its token deltas come
back as text (`detokenizer`) in OpenAI's chunk format. A client that disconnects aborts its requests,
which frees their KV blocks. Every bad request is a 4xx with OpenAI's error body; only a bug of ours
is a 500. Each request, whatever its status, leaves one access-log line when its response ends
(`access_log`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from ..chat import render_chat
from .access_log import AccessLog, RequestLog, configure_access_log
from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .choices import Choice, merge, run_choice
from .prometheus import latency_histograms, prometheus_text
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, param_of, parse_body


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generators are closed however the response ends (a disconnect
    included), so the engine requests behind them are aborted at once, not when they are collected."""

    def __init__(self, events, source, **kwargs):
        super().__init__(events, **kwargs)
        self.source = source

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.source.aclose()


class OpenAIServer:
    """The endpoints' logic for one model served by `async_engine` (see `build_app`)."""

    def __init__(self, async_engine: AsyncEngine, tokenizer, model_name: str, context_length: int):
        self.engine, self.tokenizer, self.model_name = async_engine, tokenizer, model_name
        self.context_length = context_length
        self.stop_token_ids = list(getattr(tokenizer, "stop_ids", []))
        self.created = int(time.time())
        self.counters = {"requests_ok": 0, "requests_refused": 0, "requests_aborted": 0,
                         "prompt_tokens": 0, "generation_tokens": 0}
        self.histograms = latency_histograms()

    # --- from a request body to engine requests ------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                              status=404, param="model", code="model_not_found")

    def _max_tokens(self, req, prompt_len: int, prompt_param: str) -> int:
        room = self.context_length - prompt_len
        if room < 1:
            raise OpenAIError(f"the prompt has {prompt_len} tokens; {self.model_name} holds {self.context_length} "
                              "(prompt + max_tokens), so no token is left to generate", param=prompt_param)
        if req.max_tokens is None:
            return room
        if req.max_tokens > room:
            raise OpenAIError(f"max_tokens ({req.max_tokens}) + the prompt's {prompt_len} tokens exceed the model's "
                              f"context of {self.context_length} tokens; ask for at most {room}", param="max_tokens")
        return req.max_tokens

    def _choices(self, req, prompts: list[list[int]], prompt_param: str) -> list[Choice]:
        choices = []
        for p, ids in enumerate(prompts):
            if not ids:
                raise OpenAIError("the prompt is empty (it has no tokens)", param=prompt_param)
            max_tokens = self._max_tokens(req, len(ids), prompt_param)
            for k in range(req.n):
                index = p * req.n + k
                try:
                    params = req.sampling_params(max_tokens, self.stop_token_ids, index)
                except (ValueError, TypeError) as error:   # SamplingParams' own checks: the client's values
                    raise OpenAIError(str(error), param=param_of(error)) from None
                choices.append(Choice(index, ids, params, req.stop))
        return choices

    def completion_choices(self, req: CompletionRequest) -> list[Choice]:
        self._check_model(req.model)
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompt]
        return self._choices(req, prompts, "prompt")

    def chat_choices(self, req: ChatCompletionRequest) -> list[Choice]:
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            ids = render_chat(self.tokenizer, messages)
        except (ValueError, TypeError) as error:   # e.g. a template that refuses this order of roles
            raise OpenAIError(f"messages: {error}", param="messages") from None
        return self._choices(req, [ids], "messages")

    def completion_request(self, body: bytes) -> tuple[CompletionRequest, list[Choice]]:
        """A /v1/completions body parsed and tokenized (the server runs this off the event loop)."""
        req = parse_body(CompletionRequest, body)
        return req, self.completion_choices(req)

    def chat_request(self, body: bytes) -> tuple[ChatCompletionRequest, list[Choice]]:
        """A /v1/chat/completions body parsed, rendered with the chat template and tokenized (off the loop)."""
        req = parse_body(ChatCompletionRequest, body)
        return req, self.chat_choices(req)

    # --- responses -----------------------------------------------------------------------------
    async def respond(self, http: Request, req, choices: list[Choice], chat: bool) -> Response:
        """Run `choices` on the engine: SSE chunks if req.stream, else one JSON body. A client that
        leaves before its answer is complete aborts it (the engine frees its blocks)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        record = _request_log(http)
        on_tokens = self._token_clock(record)
        source = merge([run_choice(self.engine, c, self.tokenizer, f"{rid}-{c.index}", on_tokens) for c in choices])
        kind = ("chat.completion.chunk" if req.stream else "chat.completion") if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}
        prompt_tokens = sum(len(c.prompt_token_ids) for c in choices[::req.n])   # each prompt once
        record.request_id, record.prompt_tokens = rid, prompt_tokens
        streaming = False
        try:
            # the first token, or a refusal (still an HTTP error here), unless the client leaves first
            deltas = _prepend(await _unless_disconnected(http, _first(source)), source)
            if req.stream:
                streaming = True
                events = self._events(head, deltas, choices, prompt_tokens, req.include_usage, chat, record)
                return _EventStream(events, source, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})
            return await _unless_disconnected(http, self._collect(head, deltas, choices, prompt_tokens, chat))
        except _ClientGone:
            self.counters["requests_aborted"] += 1
            record.aborted = True
            return Response(status_code=499)       # nginx's "client closed request"; nobody reads it
        finally:
            if not streaming:                      # (an event stream closes it when its response ends)
                await source.aclose()

    def _token_clock(self, record: RequestLog):
        """on_tokens for one request's choices: the access log's TTFT and token count, and the histograms
        (TTFT from the request's arrival per choice; k tokens that arrive together share the interval)."""
        last: dict[int, float] = {}

        def on_tokens(index: int, k: int) -> None:
            now = time.monotonic()
            if index in last:
                self.histograms["itl"].observe((now - last[index]) / k, k)
            else:
                self.histograms["ttft"].observe(now - record.start)
                record.first_token = now if record.first_token is None else record.first_token
            last[index] = now
            record.output_tokens += k

        return on_tokens

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        self.counters["requests_ok"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["generation_tokens"] += completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def _events(self, head, deltas, choices, prompt_tokens, include_usage, chat, record):
        """SSE chunks: (chat: each choice's role first) text pieces, each choice's finish, usage, [DONE]."""
        usage_field = {"usage": None} if include_usage else {}   # OpenAI: null on every chunk but the last

        def chunk(index, delta, finish_reason=None):
            body = {"index": index, ("delta" if chat else "text"): delta, "logprobs": None,
                    "finish_reason": finish_reason}
            return _sse({**head, "choices": [body], **usage_field})

        tokens, completed = {c.index: 0 for c in choices}, False
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, {"role": "assistant", "content": ""})
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    tokens[d.index] = d.num_tokens
                    if d.text:
                        yield chunk(d.index, {"content": d.text} if chat else d.text)
                    if d.finish_reason:
                        yield chunk(d.index, {} if chat else "", d.finish_reason)
            completed = True
        except OpenAIError as error:               # a later choice was refused: say so in the stream
            yield _sse(error.body())
            completed = True
        finally:
            if not completed:                      # the client went away: its requests were aborted
                self.counters["requests_aborted"] += 1
                record.aborted = True
        if include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage(prompt_tokens, sum(tokens.values()))})
        else:
            self._usage(prompt_tokens, sum(tokens.values()))
        yield "data: [DONE]\n\n"

    async def _collect(self, head, deltas, choices, prompt_tokens, chat) -> JSONResponse:
        text, tokens, reasons = {c.index: [] for c in choices}, {c.index: 0 for c in choices}, {}
        async with contextlib.aclosing(deltas):
            async for d in deltas:
                text[d.index].append(d.text)
                tokens[d.index] = d.num_tokens
                if d.finish_reason:
                    reasons[d.index] = d.finish_reason
        out = []
        for c in choices:
            content = "".join(text[c.index])
            body = {"message": {"role": "assistant", "content": content}} if chat else {"text": content}
            out.append({"index": c.index, **body, "logprobs": None, "finish_reason": reasons.get(c.index, "stop")})
        return JSONResponse({**head, "choices": out, "usage": self._usage(prompt_tokens, sum(tokens.values()))})


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _unless_disconnected(http: Request, awaitable):
    """`await awaitable`, unless the client disconnects first: then cancel it and raise _ClientGone."""
    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():                        # the client left (or we were cancelled): stop the work
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _first(deltas):
    """The first delta of `deltas` (None if there is none)."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


async def _prepend(first, deltas):
    """`first` (unless None), then the rest of `deltas`; closing this closes `deltas`."""
    async with contextlib.aclosing(deltas):
        if first is not None:
            yield first
        async for delta in deltas:
            yield delta


def _request_log(http: Request) -> RequestLog:
    """The access log's record of this request (a fresh one where the app runs without `AccessLog`)."""
    record = http.scope.get("state", {}).get("access")
    return record if isinstance(record, RequestLog) else RequestLog()


async def _off_loop(function, *args):
    """`function(*args)` on a worker thread: parsing, chat templates and tokenizing a large prompt must not
    stop the event loop (every other stream, /health) meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def _error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(server: OpenAIServer, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application: routes, OpenAI-style errors, the engine thread's lifetime, a body
    limit (413 over `max_body_bytes`) and one access-log line per request."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with server.engine:
            yield

    app = FastAPI(title="cs336-inference", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AccessLog)           # added last: outermost, so it sees the body limit's 413 too

    @app.exception_handler(OpenAIError)
    async def openai_error(request, error: OpenAIError):
        server.counters["requests_refused"] += 1
        return _error(error)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):   # unknown route, wrong method
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(OpenAIError(f"{request.method} {request.url.path}: {error.detail}", error.status_code, kind))

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request, error):
        return _error(OpenAIError(str(error), 503, "overloaded_error", code="overloaded"))

    @app.exception_handler(EngineDeadError)
    async def dead(request, error):
        return _error(OpenAIError(str(error), 503, "server_error", code="engine_dead"))

    @app.exception_handler(Exception)
    async def bug(request, error):                 # ours, not the client's
        logging.getLogger(__name__).error("%s %s failed", request.method, request.url.path, exc_info=error)
        return _error(OpenAIError(f"internal error: {error!r}", 500, "server_error"))

    @app.get("/health")
    async def health():
        ok = server.engine.is_running
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server._check_model(name)
        return _model_card(server)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(server), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: Request):
        req, choices = await _off_loop(server.completion_request, await http.body())
        return await server.respond(http, req, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        req, choices = await _off_loop(server.chat_request, await http.body())
        return await server.respond(http, req, choices, chat=True)

    return app


def _model_card(server: OpenAIServer) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "cs336-inference",
            "max_model_len": server.context_length}


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening), or a ValueError naming the port if it cannot be:
    `serve` binds before it loads the model, so a busy port is refused in a second, not after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r}: cannot resolve it ({error.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        hint = " (another server is listening there; pick another --port)" if error.errno == errno.EADDRINUSE else ""
        raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {error.strerror}{hint}") from None
    return sock


def run_server(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
               switch_interval_s: float = 0.001, sock: socket.socket | None = None, access_log: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn then drains the connections and the engine stops).

    sock: a socket from `listen_socket` (host and port then only name it in messages).
    access_log: one line per request on stderr (`access_log.py`); uvicorn's own access log stays off.
    switch_interval_s: how long the engine thread may hold the GIL while the event loop waits for it
    (Python's default is 5 ms). Each request's intake and each step's token delivery wakes the loop,
    which then waits up to this long for the GIL while the engine thread runs Python; shorter lets
    it run sooner, at the price of more switches."""
    import sys

    import uvicorn

    sys.setswitchinterval(switch_interval_s)
    configure_access_log(access_log)
    config = uvicorn.Config(build_app(server, max_body_bytes), host=host, port=port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=5)   # open streams get 5 s, then are cut
    if sock is not None:
        port = sock.getsockname()[1]
    print(f"serving {server.model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    uvicorn.Server(config).run(sockets=None if sock is None else [sock])


__all__ = ["OpenAIServer", "build_app", "listen_socket", "run_server"]
