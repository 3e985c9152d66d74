"""A streaming client of any OpenAI-compatible server, and what `bench inference --endpoint` measures.

Each request is one streamed `POST /v1/completions` (ours, vLLM, SGLang or llama.cpp's server all
speak it), timed on this side of the network exactly as vLLM's `vllm bench serve` times it:

    TTFT  = first chunk that carries text - request sent
    E2EL  = last chunk that carries text  - request sent
    ITL   = gaps between consecutive text chunks (of one choice), pooled over every request
    TPOT  = (E2EL - TTFT) / (output tokens - 1), requests with more than one output token
    throughput = output tokens / run duration (and prompt + output tokens, requests, per second)

Output tokens are the server's own count (`usage`, asked for with `stream_options.include_usage`);
beside it we count the streamed text again with a tokenizer (vLLM's fallback for servers without
usage), so the two can be compared. Requests arrive on a schedule (Poisson or fixed rate, or all at
once) and at most `concurrency` are in flight; a request's clock starts when it is sent, so time
spent waiting for a free slot on the client is not part of its TTFT (as in vLLM's benchmark).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

from .metrics import distribution


@dataclass(frozen=True)
class EndpointRequest:
    """One request of a benchmark run, as text (any server tokenizes it with its own tokenizer)."""

    prompt: str
    max_tokens: int
    arrival_time: float = 0.0          # seconds after the run starts
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True            # exactly max_tokens tokens (vLLM's --ignore-eos); False: stop at the end token
    stop: tuple[str, ...] = ()


@dataclass
class StreamResult:
    """What one streamed request delivered and when (times: time.perf_counter seconds)."""

    sent: float
    chunk_times: dict[int, list[float]] = field(default_factory=dict)   # choice -> time of each text chunk
    text: dict[int, str] = field(default_factory=dict)
    usage: dict | None = None
    error: str | None = None
    status: int | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    counted_output_tokens: int | None = None    # the streamed text tokenized again (see count_tokens)
    counted_prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and any(self.chunk_times.values())

    @property
    def output_tokens(self) -> int:
        """The server's count if it reported one, else our count of its text."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.counted_output_tokens or 0

    @property
    def prompt_tokens(self) -> int:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return self.counted_prompt_tokens or 0

    @property
    def ttft(self) -> float:
        return min(times[0] for times in self.chunk_times.values() if times) - self.sent

    @property
    def e2el(self) -> float:
        return max(times[-1] for times in self.chunk_times.values() if times) - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for times in self.chunk_times.values() for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) per token after the first, over the longest choice (choices decode side by side)."""
        per_choice = self.output_tokens / max(1, len(self.chunk_times))
        return (self.e2el - self.ttft) / (per_choice - 1) if per_choice > 1 else None


def base_url(endpoint: str) -> str:
    """http://host:port or http://host:port/v1 -> http://host:port/v1."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {endpoint!r}")
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def served_models(url: str, timeout: float = 10) -> list[dict]:
    """GET {url}/models: the model cards the server lists (a clear error if nothing answers)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/models", timeout=timeout) as response:
            return json.loads(response.read())["data"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"no OpenAI-compatible server answered GET {url}/models ({error})") from None


def request_payload(model: str, r: EndpointRequest) -> dict:
    """The JSON body of a streamed completion (`ignore_eos` is the extension vLLM, SGLang and llama.cpp share)."""
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": r.temperature,
            "n": r.n, "stream": True, "stream_options": {"include_usage": True}}
    if r.seed is not None:
        body["seed"] = r.seed
    if r.ignore_eos:
        body["ignore_eos"] = True
    if r.stop:
        body["stop"] = list(r.stop)
    return body


async def stream_completion(session, url: str, payload: dict) -> StreamResult:
    """POST `payload` to `url` with an aiohttp.ClientSession and read its server-sent events to [DONE]."""
    result = StreamResult(sent=time.perf_counter())
    try:
        async with session.post(url, json=payload) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text(errors='replace'))[:500]}"
                return result
            done = False
            async for line in response.content:    # one line at a time (aiohttp splits on newlines)
                if not line.startswith(b"data:"):
                    continue                       # blank separators, comments, keep-alives
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    break
                if chunk.get("usage"):
                    result.usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    i = choice.get("index", 0)
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        result.chunk_times.setdefault(i, []).append(now)
                        result.text[i] = result.text.get(i, "") + piece
                    if choice.get("finish_reason"):
                        result.finish_reasons[i] = choice["finish_reason"]
            if not done and result.error is None:
                result.error = "the stream ended before data: [DONE]"
    except Exception as error:  # the network, a malformed event: this request failed, the run goes on
        result.error = f"{type(error).__name__}: {error}"
    return result


def arrival_times(num_requests: int, rate: float, arrivals: str = "poisson", seed: int = 0) -> list[float]:
    """Send times in seconds after the start: Poisson (exponential gaps, mean 1 / rate), fixed (every
    1 / rate s), or all at 0 for rate = inf."""
    if arrivals not in ("poisson", "fixed"):
        raise ValueError(f"arrivals must be 'poisson' or 'fixed', got {arrivals!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if arrivals == "fixed":
        return [i / rate for i in range(num_requests)]
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_load(send, requests: list[EndpointRequest], concurrency: int | None = None) -> tuple[list, float]:
    """Send each request at its arrival time, at most `concurrency` in flight; (results, duration s).

    send: an async function request -> StreamResult (an HTTP stream, or the in-process engine's)."""
    limit = asyncio.Semaphore(concurrency or len(requests) or 1)
    start = time.perf_counter()

    async def one(r: EndpointRequest):
        delay = start + r.arrival_time - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            return await send(r)

    results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), time.perf_counter() - start


def open_session(concurrency: int, timeout_s: float = 6 * 3600):
    """An aiohttp session for `concurrency` streams at once (vLLM's benchmark client is aiohttp too:
    its C parser costs a fraction of a pure-Python client's per chunk, which a benchmark must not
    spend on itself)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=concurrency))


def http_sender(session, base_url: str, model: str):
    """`send` for `run_load`: stream each request from `base_url` (e.g. http://127.0.0.1:8000/v1)."""
    url = base_url.rstrip("/") + "/completions"

    async def send(r: EndpointRequest) -> StreamResult:
        return await stream_completion(session, url, request_payload(model, r))

    return send


def serve_over_http(base_url: str, model: str, requests: list[EndpointRequest],
                    concurrency: int) -> tuple[list[StreamResult], float]:
    """`run_load` of `requests` against the server at `base_url` (its model `model`), at most
    `concurrency` streams at once, on a fresh event loop: (results, duration s)."""
    async def serve():
        async with open_session(concurrency) as session:
            return await run_load(http_sender(session, base_url, model), requests, concurrency)

    return asyncio.run(serve())


def count_tokens(results: list[StreamResult], requests: list[EndpointRequest], tokenizer) -> None:
    """Fill each result's counted tokens: its prompt and streamed text, tokenized with `tokenizer`."""
    for result, r in zip(results, requests):
        result.counted_prompt_tokens = len(tokenizer.encode(r.prompt))
        result.counted_output_tokens = sum(len(tokenizer.encode(t)) for t in result.text.values())


def stream_metrics(results: list[StreamResult], duration: float) -> dict:
    """vLLM's aggregate over the completed requests: counts, throughputs and for TTFT, TPOT, ITL and
    E2EL a {mean, median, p99} dict in seconds (see `serving.metrics.distribution`)."""
    done = [r for r in results if r.ok]
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
            "input_tokens": input_tokens, "output_tokens": output_tokens,
            "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
            "total_token_throughput": (input_tokens + output_tokens) / duration,
            "ttft": distribution([r.ttft for r in done]),
            "tpot": distribution([r.tpot for r in done if r.tpot is not None]),
            "itl": distribution([gap for r in done for gap in r.itls]),
            "e2el": distribution([r.e2el for r in done])}


__all__ = ["EndpointRequest", "StreamResult", "arrival_times", "base_url", "count_tokens", "http_sender",
           "open_session", "request_payload", "run_load", "serve_over_http", "served_models", "stream_completion",
           "stream_metrics"]
