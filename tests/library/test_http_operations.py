"""Operating `serve`, on real server processes on 127.0.0.1 (the session's `toy_server`, and one
uvicorn in a thread of this process): one access-log line per request, a busy port refused before the
model loads, a body limit (413) that reads nothing it refuses, tokenizing off the event loop, latency
histograms and token counters in /metrics. References are computed here: token counts from the
tokenizer, latencies bounded by what the client measured, buckets recounted from the text."""

import contextlib
import json
import math
import re
import select
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")

from http_server import request as http_request  # noqa: E402

from cs336_inference.model import ByteTokenizer, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GOOD = {"model": "target", "prompt": "The cat", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("target")


def parse_log_line(line: str):
    """(request line, status, bare words after the status, key=value fields) of one access-log line."""
    head, request, tail = line.split('"')
    assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d 127\.0\.0\.1:\d+ ", head), line
    words = tail.split()
    fields = dict(w.split("=", 1) for w in words if "=" in w)
    return request, int(words[0]), [w for w in words[1:] if "=" not in w], fields


def seconds(value: str) -> float:
    assert value.endswith("ms"), value
    return float(value[:-2]) / 1e3


def sse_lines(server, path: str, body: dict, events: int | None = None) -> list[str]:
    """The `data:` payloads of a streamed response (the first `events` of them, then the connection closes)."""
    host, port = server.url.split("//")[1].split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    out, stream = [], connection.makefile("rb")
    with contextlib.closing(connection), contextlib.closing(stream):
        assert stream.readline().startswith(b"HTTP/1.1 200")
        for line in iter(stream.readline, b""):
            if line.startswith(b"data: "):
                out.append(line[6:].decode().strip())
                if out[-1] == "[DONE]" or (events is not None and len(out) == events):
                    break
    return out


def test_every_request_gets_one_access_log_line_with_its_tokens_and_times(toy_server, tokenizer):
    t0 = time.monotonic()
    status, body = toy_server.post("/v1/completions?probe=ok", GOOD)
    elapsed = time.monotonic() - t0
    assert status == 200
    request, code, words, fields = parse_log_line(toy_server.log_line("probe=ok "))
    assert request == "POST /v1/completions?probe=ok HTTP/1.1" and code == 200 and words == ["OK"]
    assert fields["id"] == body["id"]
    assert int(fields["prompt_tokens"]) == len(tokenizer.encode("The cat")) == body["usage"]["prompt_tokens"]
    assert int(fields["output_tokens"]) == 6
    assert 0 < seconds(fields["ttft"]) <= seconds(fields["time"]) <= elapsed + 0.01
    # refusals are logged too: a sampling value the engine cannot take (400), an unknown route (404)
    assert toy_server.post("/v1/completions?probe=bad", {**GOOD, "stop_token_ids": [-1]})[0] == 400
    request, code, words, fields = parse_log_line(toy_server.log_line("probe=bad "))
    assert code == 400 and words == ["Bad", "Request"] and "output_tokens" not in fields and "time" in fields
    assert toy_server.post("/v1/nowhere?probe=lost", GOOD)[0] == 404
    assert parse_log_line(toy_server.log_line("probe=lost "))[1] == 404
    # a stream the client leaves: its line says so, with the tokens it got
    events = sse_lines(toy_server, "/v1/completions?probe=gone", {**GOOD, "max_tokens": 400, "stream": True}, 3)
    assert len(events) == 3
    request, code, words, fields = parse_log_line(toy_server.log_line("probe=gone "))
    assert code == 200 and words == ["OK", "aborted"] and 3 <= int(fields["output_tokens"]) < 400
    # one line each: uvicorn's own access log (written when a response starts) is off
    log = toy_server.full_log()
    assert [log.count(f"probe={p} ") for p in ("ok", "bad", "lost", "gone")] == [1, 1, 1, 1], log[-2000:]


def test_a_busy_port_is_refused_before_the_model_loads(monkeypatch, capsys):
    from cs336_inference import cli
    import cs336_inference.serving.http  # noqa: F401 (imported before the clock starts, as it is at a CLI start)

    def load_model(args):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(cli, "_load_model", load_model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        code = cli.main(["serve", "--model", "target", "--host", "127.0.0.1", "--port", str(port)])
        elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and "in use" in err, err
    assert elapsed < 5, elapsed            # a bind, not a model load


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


def _response(sock: socket.socket) -> tuple[int, dict]:
    sock.settimeout(10)
    stream = sock.makefile("rb")
    status = int(stream.readline().split()[1])
    length = 0
    for line in iter(stream.readline, b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return status, json.loads(stream.read(length))


def test_a_body_over_the_limit_is_refused_with_413_without_reading_it(toy_server):
    limit = 4 * 1024 * 1024                                  # serve's default --max-body-bytes
    host, port = toy_server.url.split("//")[1].split(":")
    rss_before = _rss_bytes(toy_server.process.pid)
    head = f"POST /v1/completions?probe={{}} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    # 1. Content-Length says 50 MB: refused at once, after the headers and one KB
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall((head.format("declared") + f"Content-Length: {50 << 20}\r\n\r\n").encode() + b"x" * 1024)
        status, error = _response(sock)
    assert status == 413 and error["error"]["code"] == "request_too_large" and str(limit) in error["error"]["message"]
    assert time.monotonic() - t0 < 10
    # 2. a chunked body, counted as it arrives: /health answers while it uploads, and past the limit it is refused
    chunk = b"x" * (256 << 10)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent, status = 0, None
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall((head.format("chunked") + "Transfer-Encoding: chunked\r\n\r\n").encode())
        while sent < 50 << 20:
            if select.select([sock], [], [], 0)[0]:          # the server answered before the body ended
                break
            try:
                sock.sendall(framed)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            if sent == 1 << 20:                              # under the limit: the upload is in progress
                assert http_request(toy_server.url + "/health", timeout=5)[0] == 200
        status, error = _response(sock)
    assert status == 413 and error["error"]["code"] == "request_too_large", (status, error)
    assert limit < sent < 50 << 20, sent                      # refused once over the limit, long before the end
    assert _rss_bytes(toy_server.process.pid) - rss_before < 64 << 20
    assert parse_log_line(toy_server.log_line("probe=chunked "))[1] == 413
    assert parse_log_line(toy_server.log_line("probe=declared "))[1] == 413
    assert toy_server.post("/v1/completions", GOOD)[0] == 200  # and the server serves on


class GatedTokenizer:
    """A ByteTokenizer whose `encode` of a prompt starting with "GATE" waits until the test opens the gate."""

    def __init__(self):
        self.inner, self.entered, self.gate = ByteTokenizer(), threading.Event(), threading.Event()

    def encode(self, text):
        if text.startswith("GATE"):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tokenizing_runs_off_the_event_loop(target_model):
    import uvicorn

    from cs336_inference.serving import Engine
    from cs336_inference.serving.async_engine import AsyncEngine
    from cs336_inference.serving.http import OpenAIServer, build_app
    from cs336_inference.serving.http.launch import free_port

    tokenizer = GatedTokenizer()
    engine = Engine(target_model, clock=time.monotonic, max_num_seqs=4)
    app = build_app(OpenAIServer(AsyncEngine(engine), tokenizer, "target", target_model.config.context_length))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gated: dict = {}
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                if http_request(url + "/health", timeout=1)[0] == 200:
                    break
            time.sleep(0.05)
        body = json.dumps({**GOOD, "prompt": "GATE open"}).encode()
        waiter = threading.Thread(target=lambda: gated.update(r=http_request(url + "/v1/completions", body, 30)))
        waiter.start()
        assert tokenizer.entered.wait(10)                     # its prompt is being tokenized now
        assert http_request(url + "/health", timeout=5)[0] == 200
        other = json.dumps(GOOD).encode()
        assert http_request(url + "/v1/completions", other, timeout=10)[0] == 200   # another request is served
        assert waiter.is_alive()                              # while the first still waits in its tokenizer
        tokenizer.gate.set()
        waiter.join(30)
        assert gated["r"][0] == 200 and json.loads(gated["r"][1])["usage"]["completion_tokens"] == 6
    finally:
        tokenizer.gate.set()
        server.should_exit = True
        thread.join(15)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def target_model():
    from cs336_inference.model import load_pretrained

    return load_pretrained("target").eval()


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(bucket bounds with their cumulative counts, sum, count) of histogram `name`, read from the text."""
    full = f"cs336:{name}"
    assert f"# TYPE {full} histogram" in text
    buckets, values = [], {}
    for line in text.splitlines():
        if line.startswith(full + "_bucket{"):
            bound = re.search(r'le="([^"]+)"', line).group(1)
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
        for suffix in ("_sum", "_count"):
            if line.startswith(full + suffix + "{"):
                values[suffix] = float(line.rsplit(" ", 1)[1])
    bounds, counts = [b for b, _ in buckets], [c for _, c in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf and counts == sorted(counts)
    assert counts[-1] == values["_count"]
    return buckets, values["_sum"], values["_count"]


def test_metrics_histograms_and_token_counters_count_every_request(toy_server, tokenizer):
    """TTFT once per choice, ITL per later token; usage and the token counters right after a stream
    that asked for no usage."""
    before_text, before = toy_server.metrics_text(), toy_server.metrics()
    t0 = time.monotonic()
    status, plain = toy_server.post("/v1/completions", GOOD)                                   # 1 choice
    t1 = time.monotonic()
    events = sse_lines(toy_server, "/v1/completions", {**GOOD, "prompt": "A dog", "n": 2, "stream": True})
    t2 = time.monotonic()
    chat = {"model": "target", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with_usage = sse_lines(toy_server, "/v1/chat/completions", chat)                              # 1 choice
    t3 = time.monotonic()
    after_text, after = toy_server.metrics_text(), toy_server.metrics()

    assert status == 200 and plain["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])
    usage = json.loads(with_usage[-2])["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    prompts = len(tokenizer.encode("The cat")) + len(tokenizer.encode("A dog")) + usage["prompt_tokens"]
    assert after["cs336:prompt_tokens_total"] - before["cs336:prompt_tokens_total"] == prompts
    assert after["cs336:generation_tokens_total"] - before["cs336:generation_tokens_total"] == 6 + 2 * 6 + 6
    assert after["cs336:request_success_total"] - before["cs336:request_success_total"] == 3

    _, ttft_sum0, ttft_count0 = histogram(before_text, "time_to_first_token_seconds")
    _, ttft_sum1, ttft_count1 = histogram(after_text, "time_to_first_token_seconds")
    assert ttft_count1 - ttft_count0 == 4                                       # one per choice
    assert 0 < ttft_sum1 - ttft_sum0 <= (t1 - t0) + 2 * (t2 - t1) + (t3 - t2)   # each within its request
    _, itl_sum0, itl_count0 = histogram(before_text, "inter_token_latency_seconds")
    _, itl_sum1, itl_count1 = histogram(after_text, "inter_token_latency_seconds")
    assert 1 <= itl_count1 - itl_count0 <= 4 * 5                                # at most 5 gaps per choice
    assert 0 < itl_sum1 - itl_sum0 <= (t1 - t0) + 2 * (t2 - t1) + (t3 - t2)


def test_sampling_values_the_engine_cannot_take_are_400s_naming_the_field(toy_server):
    cases = [({"stop_token_ids": [-1]}, "stop_token_ids.0"), ({"stop_token_ids": [999]}, "stop_token_ids"),
             ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"), ({"seed": 2**64 - 1, "n": 2}, "seed"),
             ({"prompt": [1, 999]}, "prompt")]
    for extra, param in cases:
        status, error = toy_server.post("/v1/completions", {**GOOD, **extra})
        assert (status, error["error"]["param"]) == (400, param), (extra, error)
        assert "Overflow" not in error["error"]["message"] and param.split(".")[0] in error["error"]["message"]
    status, out = toy_server.post("/v1/completions", {**GOOD, "temperature": 1.0, "seed": 2**64 - 2, "n": 2})
    assert status == 200 and len(out["choices"]) == 2                           # the largest seeds still work


def test_the_real_tokenizer_lets_other_threads_run_while_it_encodes():
    """SmolLM2's BPE (HF tokenizers, in Rust) encodes without holding the GIL, so the worker thread that
    tokenizes a long prompt leaves the server's event loop free; the ids are those of a plain encode."""
    from cs336_inference.model.real_models import real_model_missing

    if real_model_missing("smollm2-135m"):
        pytest.skip(real_model_missing("smollm2-135m"))
    bpe = load_tokenizer("smollm2-135m")
    text = "The quick brown fox jumps over the lazy dog. " * (1 << 14)              # 737 kB
    result, wakeups = {}, 0
    worker = threading.Thread(target=lambda: result.update(ids=bpe.encode(text)))
    worker.start()
    while worker.is_alive():                 # with the GIL held by the encode this loop would stall
        time.sleep(0.005)
        wakeups += 1
    worker.join()
    assert result["ids"] == bpe._tok.encode(text, add_special_tokens=False).ids
    assert wakeups >= 5, wakeups
