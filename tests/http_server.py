"""Start `python -m cs336_inference serve` on a free loopback port for the tests, and stop it by pid.

Everything here talks to 127.0.0.1 only, every wait is bounded, and the process is terminated (then
killed, if it does not stop within 10 s) however the tests end.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str            # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: str
    model: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        return request(self.url + path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 30) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, text = request(self.url + path, data, timeout)
        return status, json.loads(text) if text.strip() else {}

    def metrics(self) -> dict[str, float]:
        from cs336_inference.serving.http.prometheus import parse_metrics

        status, text = self.get("/metrics")
        assert status == 200, text
        return parse_metrics(text)


def request(url: str, data: bytes | None = None, timeout: float = 30) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def start_server(model: str, *args: str) -> Server:
    """Launch a `serve` process for `model` (extra CLI `args`) on a free port; `wait_ready` before use."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="cs336-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "cs336_inference", "serve", "--model", model, "--host", HOST, "--port", str(port),
           *args]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    return Server(f"http://{HOST}:{port}", process, log.name, model)


def wait_ready(server: Server, timeout: float = 120) -> Server:
    """Return once /health answers 200; raise (with the server's log) if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"serve exited with {server.process.returncode} before it was ready:\n{server.log()}")
        with contextlib.suppress(OSError):
            if server.get("/health", timeout=2)[0] == 200:
                return server
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve was not ready within {timeout} s:\n{server.log()}")
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    """SIGTERM by pid (uvicorn drains, the engine thread stops), SIGKILL after 10 s; remove the log."""
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(server.log_path)


@contextlib.contextmanager
def running_server(model: str, *args: str, startup_timeout: float = 120):
    """A ready `serve` process for `model`, stopped when the block ends."""
    server = start_server(model, *args)
    try:
        yield wait_ready(server, startup_timeout)
    finally:
        stop_server(server)
