"""A limit on request bodies, enforced before a byte of JSON is parsed.

Without one, a client can send any size: the server buffers it whole, parses it and tokenizes it
before it can say the prompt is too long. This ASGI middleware refuses a body over `max_bytes` with
HTTP 413 (OpenAI's error body, code "request_too_large") as soon as that is known: at once when the
Content-Length header says so (nothing is read), and as soon as a chunked body's bytes, counted as
they arrive, pass the limit (what was read is dropped). uvicorn stops reading the socket while the
app is not asking for more, so memory holds at most the limit plus one read, never the whole body.
The refusal is raised where the route reads the body, so the app's error handlers answer it.
"""

from __future__ import annotations

from .protocol import OpenAIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024   # far above any prompt that fits a context (text or token ids)


class BodyTooLarge(OpenAIError):
    """HTTP 413: the request body is over the server's limit."""

    def __init__(self, max_bytes: int, size: str):
        super().__init__(f"the request body is {size}; this server takes at most {max_bytes} bytes "
                         "(serve --max-body-bytes)", status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware: bodies over `max_bytes` raise `BodyTooLarge` when the app reads them."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            async def refuse():                 # the body is never read: uvicorn closes the connection
                raise BodyTooLarge(self.max_bytes, f"{declared} bytes (Content-Length)")
            return await self.app(scope, refuse, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes, f"over {self.max_bytes} bytes ({received} read so far)")
            return message

        await self.app(scope, counted, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimit", "BodyTooLarge"]
