"""The tests' handle on a `serve` process (cs336_inference.serving.http.launch): plain-HTTP helpers
to call it and read its /metrics. 127.0.0.1 only; every call has a timeout."""

from __future__ import annotations

import json
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
