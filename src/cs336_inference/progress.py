"""Progress for long work at start-up, and machine-readable marks of where a start spends its time.

- `ticker(what)`: while a block runs (building our C++ kernels, compiling a step), a line on stderr that
  counts the seconds, rewritten in place every `TICK_S` seconds: a start is never silent for long.
- `mark(phase)`: with $CS336_STARTUP_LOG naming a file, append one JSON line {"phase", "t" (Unix time),
  "pid"} to it; without it (the default) nothing happens. `bench startup` sets it to time each phase of
  a real `generate`, `chat` or `serve` process (import, load, tuning, compile, first token).

Standard library only, so every part of the package may use it; importing it changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

STARTUP_LOG = "CS336_STARTUP_LOG"
TICK_S = 2.0   # seconds between two progress updates (the promise: never silent for more than 5)


def mark(phase: str, **extra) -> None:
    """Record that this process reached `phase` now, where $CS336_STARTUP_LOG asks for it (else nothing).
    A log that cannot be written is ignored: marks never change what a command does."""
    path = os.environ.get(STARTUP_LOG)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"phase": str(phase), "t": time.time(), "pid": os.getpid(), **extra}) + "\n")
    except OSError:
        pass


def read_marks(path) -> list[dict]:
    """The marks in a log `mark` wrote, in order (a torn last line, from a process killed mid-write, is skipped)."""
    marks = []
    try:
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    marks.append(json.loads(line))
    except FileNotFoundError:
        pass
    return marks


_active: list = []            # the tickers running now, innermost last: only that one writes
_lock = threading.Lock()


class Ticker:
    """A daemon thread that writes "{what}... N s" to `stream` every `every` seconds until stopped."""

    def __init__(self, what: str, every: float = TICK_S, stream=None, quiet_for: float = 0.0):
        if not isinstance(what, str) or not what:
            raise ValueError(f"what must be a non-empty string, got {what!r}")
        if not isinstance(every, (int, float)) or not every > 0:
            raise ValueError(f"every must be a positive number of seconds, got {every!r}")
        if not isinstance(quiet_for, (int, float)) or not 0 <= quiet_for <= every:
            raise ValueError(f"quiet_for must be a number of seconds in [0, every={every}], got {quiet_for!r}")
        self.what, self.every, self.stream, self.quiet_for = what, float(every), stream, float(quiet_for)
        self.shown = False   # whether its line was written (work done within quiet_for writes none)
        self.t0 = time.perf_counter()
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ticker: {what}", daemon=True)

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        with contextlib.suppress(Exception):   # a closed stream must not kill the work it reports on
            stream.write(text)
            stream.flush()

    def _newline(self) -> str:
        """"\r" on a terminal (the line is rewritten in place), "\n" in a log or a pipe (a line per update)."""
        try:
            return "\r" if (self.stream or sys.stderr).isatty() else "\n"
        except Exception:   # noqa: BLE001 - a stream without isatty is not a terminal
            return "\n"

    def _show(self) -> None:
        # a ticker started inside another one (building our kernels while loading a model) takes over:
        # the outer one's line ends, and it writes again (on a line of its own) once the inner one ends
        outer = any(t.shown for t in _active if t is not self)
        self._write(f"{chr(10) if outer else ''}{self.what}...")
        self.shown = True

    def _run(self) -> None:
        wait = self.quiet_for or self.every
        while not self._stop.wait(wait):
            wait = self.every
            with _lock:
                if _active and _active[-1] is not self:   # an inner ticker has the line now
                    continue
                if not self.shown:                        # its quiet time is over
                    self._show()
                    continue
                self.ticks += 1
                self._write(f"{self._newline()}{self.what}... {time.perf_counter() - self.t0:.0f} s")

    def start(self) -> Ticker:
        with _lock:
            if not self.quiet_for:
                self._show()
            _active.append(self)
        self._thread.start()
        return self

    def stop(self, outcome: str = "done") -> float:
        """Stop ticking and end the line ("{what}... done (N s)"); the seconds it ran. Work that ended
        within `quiet_for` ends without a word."""
        self._stop.set()
        self._thread.join()
        seconds = time.perf_counter() - self.t0
        with _lock:
            inner = _active[-1] is not self if _active else False
            if self in _active:
                _active.remove(self)
            if self.shown:
                self._write(f"{chr(10) if inner else self._newline()}{self.what}... {outcome} ({seconds:.1f} s)\n")
        return seconds


@contextlib.contextmanager
def ticker(what: str, every: float = TICK_S, stream=None, quiet_for: float = 0.0):
    """Run the block with a `Ticker` counting its seconds on stderr (or `stream`); the line ends with
    "done (N s)", or "failed (N s)" when the block raises. quiet_for: say nothing for that long (a
    block that ends sooner, a quick refusal say, writes no line at all)."""
    t = Ticker(what, every, stream, quiet_for).start()
    try:
        yield t
    except BaseException:
        t.stop("failed")
        raise
    t.stop()


__all__ = ["STARTUP_LOG", "TICK_S", "Ticker", "mark", "read_marks", "ticker"]
