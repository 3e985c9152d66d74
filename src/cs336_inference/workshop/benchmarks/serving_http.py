"""`bench serving_http`: what the HTTP server costs, measured against the same engine in process.

One trace of the toy target (`ignore_eos`: exact output lengths), served three ways at the same load
and timed as `bench inference --endpoint` times a server (`serving/client.py`): "engine" steps the
`Engine` in a plain loop here, "async" goes through `AsyncEngine`, "http" through `serve` in another
process (FastAPI + uvicorn, SSE chunks, detokenized text). Closed loop and Poisson arrivals, runs
interleaved over `repeats` rounds (the median-duration run kept); all greedy texts must match.
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from functools import partial

import torch

from ...data.corpus import load_corpus
from ...model.checkpoints import load_pretrained
from ...model.tokenizer import load_tokenizer
from ...serving import Engine, Workload
from ...serving.async_engine import AsyncEngine
from ...serving.client import EndpointRequest, StreamResult, run_load, serve_over_http, stream_metrics
from ...serving.http.launch import running_server
from ...serving.request import SamplingParams
from ...tables import format_table
from ...device import load_avg
from .base import Benchmark, alternate, grouped_bars, median_repeat

NAME = "serving_http"
MODES = ("engine", "async", "http")


def _params(r: EndpointRequest) -> SamplingParams:
    return SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens)


def drive_engine(engine: Engine, requests: list[EndpointRequest], concurrency: int,
                 tokenizer) -> tuple[list[StreamResult], float]:
    """Serve `requests` on `engine` in real time from one loop: add each at its arrival time while
    fewer than `concurrency` are in flight, step, and stamp each token when `step` returns it."""
    order = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_time))
    results, tokens, inflight = {}, {}, {}
    start = time.perf_counter()
    while order or inflight:
        now = time.perf_counter()
        while order and len(inflight) < concurrency and start + requests[order[0]].arrival_time <= now:
            i = order.popleft()
            results[i], tokens[i] = StreamResult(sent=time.perf_counter()), []
            ids = tokenizer.encode(requests[i].prompt)
            results[i].usage = {"prompt_tokens": len(ids)}
            inflight[engine.add_request(ids, _params(requests[i]), request_id=str(i))] = i
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
                results[i].usage["completion_tokens"] = len(tokens[i])
                del inflight[out.request_id]
    duration = time.perf_counter() - start
    for i, result in results.items():
        result.text[0] = tokenizer.decode(tokens[i])
    return [results[i] for i in range(len(requests))], duration


def async_sender(served: AsyncEngine, tokenizer):
    """`send` for `run_load` through the AsyncEngine in this process."""

    async def send(r: EndpointRequest) -> StreamResult:
        result, tokens, ids = StreamResult(sent=time.perf_counter()), [], tokenizer.encode(r.prompt)
        async for out in served.generate(ids, _params(r)):
            if out.new_token_ids:
                result.chunk_times.setdefault(0, []).append(time.perf_counter())
                tokens += out.new_token_ids
        result.text[0] = tokenizer.decode(tokens)
        result.usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}
        return result

    return send


def one_run(mode: str, model, url: str, requests, concurrency: int, tokenizer) -> tuple[dict, list]:
    """Serve `requests` one way (MODES); vLLM's metrics of the run and the texts it returned."""
    async def in_process():
        async with AsyncEngine(Engine(model, clock=time.monotonic, max_num_seqs=concurrency)) as served:
            return await run_load(async_sender(served, tokenizer), requests, concurrency)

    if mode == "engine":
        results, duration = drive_engine(Engine(model, clock=time.monotonic, max_num_seqs=concurrency), requests,
                                         concurrency, tokenizer)
    else:
        results, duration = (serve_over_http(url, "target", requests, concurrency) if mode == "http"
                             else asyncio.run(in_process()))
    if failed := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{mode}: {len(failed)} requests failed, e.g. {failed[0]}")
    return stream_metrics(results, duration), [r.text.get(0, "") for r in results]


def measure(run, concurrency: int = 32, repeats: int | None = None) -> dict:
    """Serve the same load in process and over HTTP (one thread: the scaffold's policy for the toy model)."""
    if run.device.type != "cpu":
        raise ValueError("bench serving_http runs the toy target on the CPU (the server process picks its device)")
    repeats = repeats or (1 if run.quick else 3)
    num_requests, output_len = (2 * concurrency, 16) if run.quick else (4 * concurrency, 64)
    model, tokenizer, source = load_pretrained("target").eval(), load_tokenizer("target"), load_corpus("val").tolist()
    load = Workload(NAME, (32, 96), output_len, concurrency, num_requests, seed=1)   # ignore_eos: exact lengths
    load_before, rows = load_avg(), []
    with running_server("target", "--max-num-seqs", str(concurrency)) as server:
        def modes(requests):
            return {m: partial(one_run, m, model, server.v1, requests, concurrency, tokenizer) for m in MODES}

        warm = load.replace(num_requests=concurrency, output_len=8, seed=99).text_requests(source, tokenizer)
        alternate(modes(warm), 1)
        for name, rate in (("closed loop", math.inf), ("poisson", None)):
            if rate is None:        # under capacity: 60% of the closed loop's measured request rate
                rate = 0.6 * next(r["request_throughput"] for r in rows if r["mode"] == "engine")
            runs = alternate(modes(load.text_requests(source, tokenizer, rate=rate)), repeats)
            same = len({tuple(results[-1][1]) for results in runs.values()}) == 1   # the last repeat's texts
            rows += [{"load": name, "rate": None if math.isinf(rate) else rate, "mode": mode,
                      "concurrency": concurrency, "num_requests": num_requests, "output_len": output_len,
                      "same_text_as_engine": same, **median_repeat([m for m, _ in results], "duration_s"),
                      "ttft_p99_per_repeat": [m["ttft"]["p99"] for m, _ in results]} for mode, results in runs.items()]
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
        grouped_bars(ax, [label for _, _, label in metrics],
                     {mode: [1e3 * rows[mode][m][s] for m, s, _ in metrics] for mode in MODES})
        rate = f", {rows['engine']['rate']:.1f} req/s" if rows["engine"]["rate"] else ""
        ax.set(ylabel="ms", title=f"{load}{rate}: p99 TTFT x{result['p99_ttft_ratio_http_to_engine'][load]:.2f} "
                                  "over HTTP")
        ax.legend(title="served by", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"the engine in process vs behind HTTP: toy target, {result['rows'][0]['concurrency']} in flight")
    fig.tight_layout()
    return fig


BENCHMARK = bench_serving_http = Benchmark(NAME, measure, print_serving_http, plots={NAME: plot_serving_http})

__all__ = ["bench_serving_http", "drive_engine", "plot_serving_http"]
