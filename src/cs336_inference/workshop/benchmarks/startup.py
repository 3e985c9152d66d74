"""`bench startup`: how long `generate --chat`, `chat` and `serve` take to start, cold and warm, phase by phase.

Each start is a real process (`python -m cs336_inference ...`), timed from its launch:
- generate: until the first byte of the answer on stdout;
- chat: one message written to its stdin, until the first character of the reply after "model> ";
- serve: until GET /health on 127.0.0.1 answers 200.
chat and serve then run on until their background compile ends ("compiled"), so that the next start
finds it in the cache, and are stopped by their pid.
The process marks its phases in a log (`progress.mark`, $CS336_STARTUP_LOG): "imported" (torch and the
package), "loaded" (weights read or converted), "tuned" (our CPU kernels and the CPU tuning), "compiled"
(where a compile finished; in the background for chat and generate), "first_token". Every chunk of
output is stamped too, so the longest silence before the first token is measured ("never silent for
more than 5 s").

Cold: every cache folder is a fresh, empty one ($CS336_CACHE_DIR: converted weights, our C++ kernels,
inductor's kernels); warm: the second start with the same folders. A `--quick` run takes the toy
target and times a cold start of `generate` only, then the warm starts (not `chat`: the toy models have
no chat template).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from ...progress import STARTUP_LOG, read_marks
from ...tables import format_table
from .base import Benchmark

NAME = "startup"
COMMANDS = ("generate", "chat", "serve")
PROMPT = "What is the capital of France?"
PHASES = ("imported", "loaded", "tuned", "compiled", "first_token")
TIMEOUT_S = 900.0


class Watched:
    """A child process whose stdout and stderr are read as they come, each chunk stamped (time.time())."""

    def __init__(self, argv: list[str], env: dict, stdin: bool = False):
        self.t0 = time.time()
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.chunks: list[tuple[float, str, bytes]] = []   # (time, "out" or "err", bytes)
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(pipe, name), daemon=True)
                         for pipe, name in ((self.process.stdout, "out"), (self.process.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, name: str) -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            with self._lock:
                self.chunks.append((time.time(), name, chunk))

    def text(self, name: str) -> str:
        with self._lock:
            return b"".join(c for _, n, c in self.chunks if n == name).decode(errors="replace")

    def first_time(self, name: str, predicate) -> float | None:
        """The stamp of the first chunk after which `predicate(all of `name`'s output so far)` holds."""
        with self._lock:
            seen = b""
            for t, n, chunk in self.chunks:
                if n == name:
                    seen += chunk
                    if predicate(seen.decode(errors="replace")):
                        return t
        return None

    def longest_silence(self, until: float) -> float:
        """The longest stretch between the launch and `until` with nothing written to stdout or stderr."""
        with self._lock:
            stamps = sorted(t for t, _, _ in self.chunks if t <= until)
        edges = [self.t0, *stamps, until]
        return max(b - a for a, b in zip(edges, edges[1:]))

    def stop(self) -> int | None:
        """SIGINT (a server drains), then SIGKILL after 15 s; stdin closed. The exit status."""
        with contextlib.suppress(OSError):
            if self.process.stdin:
                self.process.stdin.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        for reader in self._readers:
            reader.join(timeout=5)
        return self.process.returncode


def _argv(command: str, model: str, chat_template: bool, port: int | None) -> list[str]:
    base = [sys.executable, "-m", "cs336_inference", command, "--model", model]
    if command == "generate":
        return [*base, *(["--chat"] if chat_template else []), "--prompt", PROMPT, "--max-new-tokens", "16"]
    if command == "chat":
        return [*base, "--max-new-tokens", "16"]
    return [*base, "--host", "127.0.0.1", "--port", str(port)]


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    return False


def _reply_started(out: str) -> bool:
    """chat's stdout holds "model> " and at least one character of the reply after it."""
    at = out.find("model> ")
    return at >= 0 and len(out) > at + len("model> ")


def start_once(command: str, model: str, cache_root: str, chat_template: bool = True,
               timeout: float = TIMEOUT_S) -> dict:
    """Start `command` once with every cache in `cache_root`; what it took (seconds from the launch)."""
    from ...serving.http.launch import free_port

    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    with tempfile.TemporaryDirectory(prefix="cs336-startup-") as scratch:
        log = os.path.join(scratch, "marks.jsonl")
        env = {**os.environ, "CS336_CACHE_DIR": cache_root, STARTUP_LOG: log, "PYTHONUNBUFFERED": "1"}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)   # inductor's too: the fast path puts it under CS336_CACHE_DIR
        port = free_port() if command == "serve" else None
        child = Watched(_argv(command, model, chat_template, port), env, stdin=command == "chat")
        if command == "chat":
            child.process.stdin.write((PROMPT + "\n").encode())
            child.process.stdin.flush()
        deadline = time.monotonic() + timeout
        ready = _wait_until_ready(child, command, port, deadline)
        if ready is not None:
            _run_on(child, command, log, deadline, timeout)
        end = time.time()
        rc = child.stop()
        marks = {m["phase"]: m["t"] - child.t0 for m in read_marks(log)}
    result = dict(command=command, model=model, ready_s=None if ready is None else ready - child.t0,
                  total_s=end - child.t0, returncode=rc,
                  phases={p: marks[p] for p in PHASES if p in marks},
                  longest_silence_s=child.longest_silence(ready if ready is not None else end))
    if ready is None or rc not in (0, None):
        result["error"] = child.text("err")[-2000:]
    return result


def _wait_until_ready(child: Watched, command: str, port: int | None, deadline: float) -> float | None:
    """The time (time.time()) `child` was ready: serve's /health answers, chat's reply or generate's answer
    began on stdout; None if it exited or `deadline` (time.monotonic()) passed first."""
    started = _reply_started if command == "chat" else bool
    while time.monotonic() < deadline:
        if command == "serve":
            ready = time.time() if _healthy(f"http://127.0.0.1:{port}/health") else None
        else:
            ready = child.first_time("out", started)
        if ready is not None:
            return ready
        if child.process.poll() is not None:
            return child.first_time("out", started)   # a last read
        time.sleep(0.05)
    return None


def _run_on(child: Watched, command: str, log: str, deadline: float, timeout: float) -> None:
    """After the first token: generate ends by itself (how long the whole command took); chat and serve run
    until the background compile ends, so that the next start finds it cached."""
    if command == "generate":
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=timeout)
        return
    while (time.monotonic() < deadline and child.process.poll() is None
           and not any(m["phase"] == "compiled" for m in read_marks(log))):
        time.sleep(0.2)


def measure(run, model: str | None = None) -> dict:
    from ...model import REAL_MODELS, load_tokenizer
    from ...model.disk_cache import cache_dir

    model = model or ("target" if run.quick else "smollm2-135m")
    chat_template = bool(getattr(load_tokenizer(model), "chat_template", None))
    runs = []
    root = tempfile.mkdtemp(prefix="cs336-startup-caches-")
    try:
        shared = None
        for command in COMMANDS:
            if command == "chat" and not chat_template:   # chat refuses a model without a chat template
                print(f"chat skipped: {model} has no chat template", flush=True)
                continue
            if run.quick and shared is not None:
                folder, modes = shared, ("warm",)   # --quick: one cold start (generate), then warm ones
            else:
                folder, modes = tempfile.mkdtemp(dir=root), ("cold", "warm")
            shared = shared or folder
            for mode in modes:
                print(f"{command} {mode}...", flush=True)
                result = start_once(command, model, folder, chat_template) | {"mode": mode}
                ready = "never" if result["ready_s"] is None else f"{result['ready_s']:.1f} s"
                print(f"  ready after {ready}; phases {', '.join(f'{k} {v:.1f}' for k, v in result['phases'].items())}",
                      flush=True)
                runs.append(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(model=model, real_model=model in REAL_MODELS, prompt=PROMPT, runs=runs,
                user_cache_dir=str(cache_dir()))


COLUMNS = [("command", "command", None), ("mode", "start", None), ("imported", "imported", "{:.1f}"),
           ("loaded", "loaded", "{:.1f}"), ("tuned", "tuned", "{:.1f}"), ("compiled", "compiled", "{:.1f}"),
           ("ready_s", "ready", "{:.1f}"), ("longest_silence_s", "longest silence", "{:.1f}"),
           ("total_s", "total", "{:.1f}")]


def print_table(result: dict) -> None:
    rows = [{**r, **r["phases"]} for r in result["runs"]]
    print(format_table(rows, COLUMNS, title=f"start-up of {result['model']}: seconds from launch ('ready': the "
                                           f"first token, or /health for serve; 'compiled': where a compile ended)"))


def plot(result: dict):
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(runs) + 1.5))
    labels, colors = [], {"import": "C0", "load": "C1", "tuning": "C2", "to ready": "C3"}
    for i, r in enumerate(runs):
        p, last = r["phases"], 0.0
        for name, key in (("import", "imported"), ("load", "loaded"), ("tuning", "tuned"), ("to ready", None)):
            end = r["ready_s"] if key is None else p.get(key)
            if end is None:
                continue
            ax.barh(i, end - last, left=last, color=colors[name], label=name if i == 0 else None)
            last = end
        if p.get("compiled") is not None:
            ax.plot([p["compiled"]], [i], "k|", markersize=14, label="compiled" if "compiled" not in labels else None)
            labels.append("compiled")
    ax.set_yticks(range(len(runs)), [f"{r['command']} {r['mode']}" for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from launch")
    ax.set_title(f"{result['model']}: start-up phases (ready: first token, or /health for serve)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


BENCHMARK = Benchmark(NAME, measure, table=print_table, plots={"{name}": plot})
