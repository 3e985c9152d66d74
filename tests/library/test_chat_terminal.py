"""`python -m cs336_inference chat` in a real terminal (a pty is its controlling terminal, so Ctrl-C is the
kernel's SIGINT to it, and readline is on): Ctrl-C stops an answer and the next message is answered with the
conversation intact; /stats, /help, /reset, an unknown command; Up recalls earlier lines (readline), also in
the next run (the history file); Ctrl-C on a line with text clears it; Ctrl-C on an empty line exits 130,
Ctrl-D exits 0. SmolLM2-135M, eager (--no-compile); every read is bounded and the process is killed by pid."""

import fcntl
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOAD_S = 300        # loading SmolLM2 (the first time: converting it into the cache) on a busy machine
ANSWER_S = 180
UP = b"\x1b[A"


def _take_terminal():
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)   # the pty becomes this new session's controlling terminal


class Terminal:
    def __init__(self, argv: list[str], env: dict):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env,
                                     start_new_session=True, preexec_fn=_take_terminal)
        os.close(slave)
        self.screen, self.pos = b"", 0

    def expect(self, pattern: bytes, timeout: float) -> re.Match:
        """Read until `pattern` appears after what earlier expects consumed; fail with the screen's tail."""
        regex, end = re.compile(pattern, re.S), time.monotonic() + timeout
        while True:
            if match := regex.search(self.screen, self.pos):
                self.pos = match.end()
                return match
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                raise AssertionError(f"no {pattern!r} within {timeout} s (exit status {self.proc.poll()}); the "
                                     f"screen ends:\n{self.screen[-2000:].decode('utf-8', 'replace')}")
            if select.select([self.master], [], [], min(left, 0.2))[0]:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:      # the other side closed
                    pass

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def ctrl_c_at_prompt(self) -> None:
        """Ctrl-C once the chat waits for a key: its main thread asleep in readline's select. CPython's readline
        loop checks signals only when select is interrupted, so a SIGINT that lands after readline echoed a
        key but before it is back in select waits for the next key; a person cannot type that fast, a test
        that answers the echo at once can, when the machine is busy."""
        end, asleep = time.monotonic() + 10, 0
        while asleep < 3 and time.monotonic() < end:
            try:
                state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:      # no /proc: a pause a person would make
                time.sleep(0.5)
                break
            asleep = asleep + 1 if state == "S" else 0
            time.sleep(0.01)
        self.send(b"\x03")

    def exit_status(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            if select.select([self.master], [], [], 0.2)[0]:   # keep draining, so the child never blocks on output
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:
                    time.sleep(0.1)
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        os.close(self.master)


@pytest.mark.slow
def test_the_chat_behaves_like_a_chat_in_a_terminal(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CS336_CHAT_HISTORY": str(tmp_path / "history"),
           "TERM": "xterm", "PYTHONUNBUFFERED": "1"}
    env.pop("CS336_DEBUG", None)
    argv = [sys.executable, "-m", "cs336_inference", "chat", "--no-compile", "--max-new-tokens", "150"]
    chat = Terminal(argv, env)
    try:
        chat.expect(rb"you> ", LOAD_S)
        chat.send(b"Write a long story about a dragon who learns to fly.\r")
        chat.expect(rb"model> \S+ \S+ \S+ ", ANSWER_S)      # the answer has begun
        chat.send(b"\x03")                                  # Ctrl-C mid-answer
        chat.expect(rb"\[stopped by Ctrl-C; the part shown stays in the conversation\]\r\n\[TTFT", 30)
        first = chat.expect(rb"(\d+) tokens, [^\]]*? prefilled (\d+) new tokens", 30)
        chat.expect(rb"you> ", 30)
        assert chat.proc.poll() is None                     # still running
        chat.send(b"What is the dragon's name?\r")
        chat.expect(rb"model> ", ANSWER_S)
        stats = chat.expect(rb"prefilled (\d+) new tokens, (\d+) reused from the KV cache\]", ANSWER_S)
        # reused: the first prompt and (part of) the stopped answer, which the cache kept
        assert int(first[1]) >= 2 and int(stats[2]) > int(first[2])
        chat.expect(rb"you> ", 30)
        chat.send(b"/stats\r")
        chat.expect(rb"turns: 2 \(1 stopped by Ctrl-C\)\r\nconversation: 4 messages, \d+ tokens in the KV cache", 30)
        chat.send(b"/help\r")
        chat.expect(rb"/reset +forget the conversation", 30)
        chat.send(b"/frob\r")
        chat.expect(rb"\[unknown command /frob; /help lists the commands", 30)
        chat.send(b"/reset\r")
        chat.expect(rb"\[the conversation is forgotten\]\r\nyou> ", 30)
        chat.send(UP)                                       # readline recalls the last line...
        chat.expect(rb"/reset", 30)
        chat.send(UP + b"\r")                               # ...and the one before, sent again
        chat.expect(rb"\[unknown command /frob", 30)
        chat.expect(rb"you> ", 30)
        chat.send(b"half a thought")
        chat.expect(rb"half a thought", 30)
        chat.ctrl_c_at_prompt()                             # Ctrl-C on a line with text: the line is discarded
        chat.expect(rb"you> ", 30)
        time.sleep(0.5)
        assert chat.proc.poll() is None
        chat.ctrl_c_at_prompt()                             # Ctrl-C on an empty line: the end, status 130
        assert chat.exit_status(60) == 130
    finally:
        chat.close()
    assert (tmp_path / "history").read_text().splitlines()[-1] == "/frob"   # not the discarded line

    again = Terminal(argv, env)                             # the next run starts with the history
    try:
        again.expect(rb"you> ", LOAD_S)
        again.send(UP)
        again.expect(rb"/frob", 30)
        again.ctrl_c_at_prompt()
        again.expect(rb"you> ", 30)
        again.send(b"\x04")                                 # Ctrl-D on an empty line: the end, status 0
        assert again.exit_status(60) == 0
    finally:
        again.close()
