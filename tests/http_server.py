"""The tests' handle on a `serve` process (cs336_inference.serving.http.launch): plain-HTTP helpers
to call it and read its /metrics. 127.0.0.1 only; every call has a timeout."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from cs336_inference.serving.http.launch import ServerProcess


class Server(ServerProcess):
    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        return request(self.url + path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 30) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, text = request(self.url + path, data, timeout)
        return status, json.loads(text) if text.strip() else {}

    def full_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_line(self, *words: str, timeout: float = 10) -> str:
        """The first line of the server's log holding every one of `words` (waited for: a line is written
        when its response has ended, which the client may see first)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.full_log().splitlines():
                if all(w in line for w in words):
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line with {words} within {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def metrics_text(self) -> str:
        status, text = self.get("/metrics")
        assert status == 200, text
        return text

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
