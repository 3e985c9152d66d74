"""The OpenAI-compatible HTTP server (`python -m cs336_inference serve`); needs the `[serve]` extra.

`protocol` (request bodies, OpenAI's error format), `detokenizer` (token ids -> streamed text, stop
strings), `choices` (one HTTP request's engine requests as one stream), `server` (the FastAPI app),
`prometheus` (`/metrics`: gauges, counters, latency histograms), `access_log` (one line per request)
and `body_limit` (413 for a body over the limit, before it is read).
"""

from .server import OpenAIServer, build_app, listen_socket, run_server

__all__ = ["OpenAIServer", "build_app", "listen_socket", "run_server"]
