"""`python -m cs336_inference serve` as a child process on a free 127.0.0.1 port (benchmarks, tests).

    with running_server("target", "--max-num-seqs", "32") as server:
        ...  # server.v1 = "http://127.0.0.1:PORT/v1"

Only the loopback address, every wait bounded, and the process stopped by its pid however the block
ends: SIGTERM (uvicorn drains, the engine thread stops), SIGKILL if it is still there after 15 s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str                    # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: str               # its stdout and stderr
    model: str

    @classmethod
    def start(cls, model: str, *args: str) -> "ServerProcess":
        """Launch `serve --model MODEL` (extra CLI `args`) without waiting; `wait_ready` before use."""
        port = free_port()
        with tempfile.NamedTemporaryFile("w", prefix="cs336-serve-", suffix=".log", delete=False) as log:
            cmd = [sys.executable, "-m", "cs336_inference", "serve", "--model", model, "--host", HOST,
                   "--port", str(port), *args]
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(f"http://{HOST}:{port}", process, log.name, model)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def wait_ready(self, timeout: float = 120) -> "ServerProcess":
        """Return once /health answers 200; raise (with the server's log) if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode} before it was ready:\n{self.log()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve was not ready within {timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after 15 s; the log file is removed."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)


@contextlib.contextmanager
def running_server(model: str, *args: str, timeout: float = 120, server_class: type = ServerProcess):
    """A ready `serve` process for `model` (extra CLI `args`), stopped when the block ends
    (`server_class`: a ServerProcess subclass with more helpers, as the tests use)."""
    server = server_class.start(model, *args)
    try:
        yield server.wait_ready(timeout)
    finally:
        server.stop()


__all__ = ["ServerProcess", "free_port", "running_server"]
