"""One access-log line per HTTP request, written when its response has ended (a stream included).

uvicorn's own access log writes its line when a response starts: for a stream that is before the
first token, so it can say neither how many tokens came nor how long the answer took. This ASGI
middleware writes the line at the end instead, in uvicorn's shape plus what vLLM logs per request:

    INFO 12-05 08:30:01 127.0.0.1:54321 "POST /v1/completions HTTP/1.1" 200 OK id=cmpl-3f.. prompt_tokens=5
    output_tokens=16 ttft=12.3ms time=210.4ms

(one line). A stream the client left early says `aborted` after its status; a request that raised
(a bug of ours, answered 500 by the error middleware outside this one) is logged as 500. The route
that serves a request fills its `RequestLog` (found in the ASGI scope's `state["access"]`).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from http import HTTPStatus

LOGGER_NAME = "cs336_inference.serving.http.access"


@dataclass
class RequestLog:
    """What one request did, filled in by the route that serves it (times: time.monotonic())."""

    start: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    prompt_tokens: int | None = None     # None: not a generation request
    output_tokens: int = 0
    first_token: float | None = None     # when the first token of any choice reached the server
    aborted: bool = False                # the client left before the answer was complete

    def line(self, scope, status: int | None, end: float) -> str:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        path = scope.get("raw_path", b"").decode("latin-1") or scope.get("path", "")
        query = scope.get("query_string", b"").decode("latin-1")
        target = f"{path}?{query}" if query else path
        request = f'"{scope.get("method", "-")} {target} HTTP/{scope.get("http_version", "1.1")}"'
        parts = [who, request, _status(status)]
        if self.aborted:
            parts.append("aborted")
        if self.request_id is not None:
            parts.append(f"id={self.request_id}")
        if self.prompt_tokens is not None:
            parts += [f"prompt_tokens={self.prompt_tokens}", f"output_tokens={self.output_tokens}"]
            if self.first_token is not None:
                parts.append(f"ttft={_ms(self.first_token - self.start)}")
        parts.append(f"time={_ms(end - self.start)}")
        return " ".join(parts)


def _status(status: int | None) -> str:
    """uvicorn's "200 OK"; 499 is nginx's "client closed request" (what we answer a client that left)."""
    if status is None:
        return "-"
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Client Closed Request" if status == 499 else str(status)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


class AccessLog:
    """ASGI middleware: a `RequestLog` in scope["state"]["access"], one log line when the response ends."""

    def __init__(self, app, logger: logging.Logger | None = None):
        self.app = app
        self.logger = logger or logging.getLogger(LOGGER_NAME)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = RequestLog()
        scope.setdefault("state", {})["access"] = record
        status = None

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            if status is None:          # the error middleware outside answers 500
                status = HTTPStatus.INTERNAL_SERVER_ERROR.value
            raise
        finally:
            if self.logger.isEnabledFor(logging.INFO):
                self.logger.info("%s", record.line(scope, status, time.monotonic()))


def configure_access_log(enabled: bool = True, stream=None) -> logging.Logger:
    """The access logger writing INFO lines (vLLM's prefix: level, month-day time) to `stream`
    (default stderr); `enabled=False` silences it. Called by `run_server`, not on import."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO if enabled else logging.WARNING)
    if enabled:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    return logger


__all__ = ["AccessLog", "RequestLog", "configure_access_log"]
