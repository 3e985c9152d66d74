"""`bench serving_http`: what the HTTP server costs, measured against the same engine in process.

One trace (the toy target, prompts cut from held-out text, `ignore_eos` so every answer is exactly
`output_len` tokens) is served three ways at the same load, each timed the way `bench inference
--endpoint` times a remote server (`serving/client.py`: a request's clock starts when it is sent,
TTFT at its first token, TPOT, ITL, E2E), with at most `concurrency` requests in flight:

  engine  the `Engine` stepped in a plain loop in this process; a token counts when `step` returns it
  async   the same behind `AsyncEngine` (its thread, the asyncio hand-off); a token counts when the
          consumer coroutine receives it
  http    the same behind `serve` in another process (FastAPI + uvicorn, SSE chunks, JSON, detokenized
          text), read by the streaming client here; a token counts when its chunk is parsed

Two loads: closed loop (every request queued at t = 0, `concurrency` in flight at all times) and
Poisson arrivals at a rate under the engine's capacity. Runs are interleaved over `repeats` rounds and
the median-duration run of each is kept. The greedy texts of all three modes must be identical.
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time

import torch

from ..data.corpus import load_corpus
from ..model.checkpoints import load_pretrained
from ..model.tokenizer import load_tokenizer
from ..serving import Engine
from ..serving.async_engine import AsyncEngine
from ..serving.http.launch import running_server
from ..serving.client import (EndpointRequest, StreamResult, arrival_times, http_sender, open_session, run_load,
                              stream_metrics)
from ..serving.request import SamplingParams
from ..tables import format_table
from .base import Benchmark, load_avg

NAME = "serving_http"
MODES = ("engine", "async", "http")


def make_load(num_requests: int, prompt_len: tuple[int, int], output_len: int, rate: float,
              seed: int = 0) -> tuple[list[EndpointRequest], list[list[int]]]:
    """Requests (as text, for the HTTP client) and their token ids (for the in-process modes)."""
    source = load_corpus("val").tolist()
    gen = torch.Generator().manual_seed(seed)
    tokenizer = load_tokenizer("target")
    times = arrival_times(num_requests, rate, "poisson", seed)
    requests, ids = [], []
    for i in range(num_requests):
        length = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        start = int(torch.randint(0, len(source) - length, (1,), generator=gen))
        piece = [t for t in source[start:start + length] if t < 256]       # bytes only: text round-trips
        text = bytes(piece).decode("utf-8", errors="ignore") or "The"
        requests.append(EndpointRequest(text, output_len, times[i]))
        ids.append(tokenizer.encode(text))
    return requests, ids


def _params(r: EndpointRequest) -> SamplingParams:
    return SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens)


def drive_engine(engine: Engine, requests: list[EndpointRequest], ids: list[list[int]],
                 concurrency: int) -> tuple[list[StreamResult], float]:
    """Serve `requests` on `engine` in real time from one loop: add each at its arrival time while
    fewer than `concurrency` are in flight, step, and stamp each token when `step` returns it."""
    order = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_time))
    results, tokens, inflight = {}, {}, {}
    start = time.perf_counter()
    while order or inflight:
        now = time.perf_counter()
        while order and len(inflight) < concurrency and start + requests[order[0]].arrival_time <= now:
            i = order.popleft()
            results[i] = StreamResult(sent=time.perf_counter())
            tokens[i] = []
            inflight[engine.add_request(ids[i], _params(requests[i]), request_id=str(i))] = i
        if not inflight:
            time.sleep(max(0.0, start + requests[order[0]].arrival_time - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = inflight[out.request_id]
            if out.new_token_ids:
                results[i].chunk_times.setdefault(0, []).append(now)
                tokens[i] += out.new_token_ids
            if out.finished:
                results[i].usage = {"prompt_tokens": len(ids[i]), "completion_tokens": len(tokens[i])}
                del inflight[out.request_id]
    duration = time.perf_counter() - start
    tokenizer = load_tokenizer("target")
    for i, result in results.items():
        result.text[0] = tokenizer.decode(tokens[i])
    return [results[i] for i in range(len(requests))], duration


def async_sender(served: AsyncEngine, ids_of: dict, tokenizer):
    """`send` for `run_load` through the AsyncEngine in this process."""

    async def send(r: EndpointRequest) -> StreamResult:
        result, tokens, ids = StreamResult(sent=time.perf_counter()), [], ids_of[id(r)]
        async for out in served.generate(ids, _params(r)):
            if out.new_token_ids:
                result.chunk_times.setdefault(0, []).append(time.perf_counter())
                tokens += out.new_token_ids
        result.text[0] = tokenizer.decode(tokens)
        result.usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}
        return result

    return send


async def _async_run(model, requests, ids, concurrency):
    engine = Engine(model, clock=time.monotonic, max_num_seqs=concurrency)
    ids_of = {id(r): i for r, i in zip(requests, ids)}
    async with AsyncEngine(engine) as served:
        return await run_load(async_sender(served, ids_of, load_tokenizer("target")), requests, concurrency)


async def _http_run(url, requests, concurrency):
    async with open_session(concurrency) as session:
        return await run_load(http_sender(session, url, "target"), requests, concurrency)


def one_run(mode: str, model, url: str, requests, ids, concurrency: int) -> tuple[dict, list]:
    if mode == "engine":
        results, duration = drive_engine(Engine(model, clock=time.monotonic, max_num_seqs=concurrency), requests,
                                         ids, concurrency)
    elif mode == "async":
        results, duration = asyncio.run(_async_run(model, requests, ids, concurrency))
    else:
        results, duration = asyncio.run(_http_run(url, requests, concurrency))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{mode}: {len(failed)} requests failed, e.g. {failed[0]}")
    return stream_metrics(results, duration), [r.text.get(0, "") for r in results]


def measure(run, concurrency: int = 32, repeats: int | None = None) -> dict:
    """Serve the same load in process and over HTTP (one thread: the scaffold's policy for the toy model)."""
    if run.device.type != "cpu":
        raise ValueError("bench serving_http runs the toy target on the CPU (the server process picks its device)")
    quick = run.quick
    repeats = repeats or (1 if quick else 3)
    num_requests, output_len = (2 * concurrency, 16) if quick else (4 * concurrency, 64)
    model = load_pretrained("target").eval()
    loads = {"closed loop": math.inf}
    load_before = load_avg()
    rows = []
    with running_server("target", "--max-num-seqs", str(concurrency)) as server:
        url = server.v1
        warm, warm_ids = make_load(concurrency, (32, 96), 8, math.inf, seed=99)
        for mode in MODES:
            one_run(mode, model, url, warm, warm_ids, concurrency)
        for load, rate in list(loads.items()) + [("poisson", None)]:
            if rate is None:        # under capacity: 60% of the closed loop's measured request rate
                closed = [r for r in rows if r["load"] == "closed loop" and r["mode"] == "engine"]
                rate = 0.6 * closed[0]["request_throughput"]
            requests, ids = make_load(num_requests, (32, 96), output_len, rate, seed=1)
            runs, texts = {m: [] for m in MODES}, {}
            for _ in range(repeats):
                for mode in MODES:
                    metrics, texts[mode] = one_run(mode, model, url, requests, ids, concurrency)
                    runs[mode].append(metrics)
            same = texts["engine"] == texts["async"] == texts["http"]
            for mode in MODES:
                best = sorted(runs[mode], key=lambda m: m["duration_s"])[(len(runs[mode]) - 1) // 2]
                rows.append({"load": load, "rate": None if math.isinf(rate) else rate, "mode": mode,
                             "concurrency": concurrency, "num_requests": num_requests, "output_len": output_len,
                             "same_text_as_engine": same, "repeats": repeats, **best,
                             "ttft_p99_per_repeat": [m["ttft"]["p99"] for m in runs[mode]]})
    return {"benchmark": NAME, "model": "target", "device": "cpu", "threads": torch.get_num_threads(),
            "load_avg_before": load_before, "load_avg_after": load_avg(), "rows": rows,
            "p99_ttft_ratio_http_to_engine": {
                load: _ratio(rows, load) for load in dict.fromkeys(r["load"] for r in rows)}}


def _ratio(rows, load) -> float:
    """Median over the repeats of HTTP's p99 TTFT over the median of the in-process engine's (a p99
    of one run rests on its one or two slowest requests, so the repeats' median is the steadier)."""
    by = {r["mode"]: statistics.median(r["ttft_p99_per_repeat"]) for r in rows if r["load"] == load}
    return by["http"] / by["engine"]


def print_serving_http(result: dict) -> None:
    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
    rows = [{**r, "ttft50": r["ttft"]["median"], "ttft99": r["ttft"]["p99"], "tpot50": r["tpot"]["median"],
             "itl50": r["itl"]["median"], "itl99": r["itl"]["p99"]} for r in result["rows"]]
    print(f"\nbench serving_http: the toy target, concurrency {rows[0]['concurrency']}, {rows[0]['num_requests']} "
          f"requests x {rows[0]['output_len']} tokens; load average {result['load_avg_before']} -> "
          f"{result['load_avg_after']}")
    print(format_table(rows, [("load", "load", None), ("mode", "served by", None), ("ttft50", "TTFT p50 ms", ms),
                              ("ttft99", "TTFT p99 ms", ms), ("tpot50", "TPOT p50 ms", ms),
                              ("itl50", "ITL p50 ms", ms), ("itl99", "ITL p99 ms", ms),
                              ("output_throughput", "out tok/s", "{:,.0f}"),
                              ("same_text_as_engine", "same text", None)]))
    for load, ratio in result["p99_ttft_ratio_http_to_engine"].items():
        print(f"{load}: p99 TTFT over HTTP / in-process engine = {ratio:.2f}")


def plot_serving_http(result: dict):
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r["load"] for r in result["rows"]))
    metrics = [("ttft", "median", "TTFT p50"), ("ttft", "p99", "TTFT p99"), ("tpot", "median", "TPOT p50"),
               ("itl", "p99", "ITL p99")]
    fig, axes = plt.subplots(1, len(loads), figsize=(6.5 * len(loads), 4.5), squeeze=False)
    for ax, load in zip(axes[0], loads):
        rows = {r["mode"]: r for r in result["rows"] if r["load"] == load}
        width = 0.8 / len(MODES)
        for k, mode in enumerate(MODES):
            values = [1e3 * rows[mode][m][s] for m, s, _ in metrics]
            ax.bar([j + (k - 1) * width for j in range(len(metrics))], values, width, label=mode, color=f"C{k}")
        ax.set_xticks(range(len(metrics)), [label for _, _, label in metrics])
        ax.set_ylabel("ms")
        r = rows["engine"]
        rate = f", {r['rate']:.1f} req/s" if r["rate"] else ""
        ax.set_title(f"{load}{rate}: p99 TTFT x{result['p99_ttft_ratio_http_to_engine'][load]:.2f} over HTTP")
        ax.legend(title="served by", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"the engine in process vs behind HTTP: toy target, {result['rows'][0]['concurrency']} in flight")
    fig.tight_layout()
    return fig


BENCHMARK = bench_serving_http = Benchmark(NAME, measure, print_serving_http, plots={NAME: plot_serving_http})

__all__ = ["bench_serving_http", "drive_engine", "make_load", "plot_serving_http"]
