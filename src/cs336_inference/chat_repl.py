"""The `chat` command's terminal loop, behaving as the chats people know (llama.cpp's llama-cli, `ollama run`).

- Enter sends the line. When stdin is a terminal, readline edits it (arrows, Ctrl-A/E, Ctrl-R) and keeps a
  history (Up/Down), saved between runs in the user's cache folder (`history_file()`, at most
  HISTORY_LENGTH lines; $CS336_CHAT_HISTORY names another file, or "" for none).
- Ctrl-C during an answer stops that answer and returns to the prompt. The part already shown stays in the
  conversation as the assistant's turn (the model sees what the user saw), and the KV cache keeps exactly the
  tokens computed for it, so the next answer is the one a fresh session given the same messages would give
  (`ChatSession.send`). The stop is checked between tokens; a second Ctrl-C before the answer has stopped
  (during a long prefill) ends the program, status 130.
- At the prompt: Ctrl-C on a line holding text discards the line (as shells do); Ctrl-C on an empty line
  ends the program with status 130 (128 + SIGINT, the shell's convention for a program Ctrl-C ended);
  Ctrl-D on an empty line (end of input), /quit, /exit or /bye end it with status 0.
- /help, /reset, /stats, /quit; any other line starting with "/" is refused with a hint (send "//text" to
  say "/text").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from .cli_args import read_line

EXIT_OK = 0               # /quit, Ctrl-D
EXIT_INTERRUPTED = 130    # Ctrl-C at an empty prompt, or twice during an answer: 128 + SIGINT
HISTORY_LENGTH = 1000
PROMPT = "you> "
COMMANDS = {
    "/help": "list these commands and keys",
    "/reset": "forget the conversation (the system message stays)",
    "/stats": "turns, tokens in the KV cache, the last answer's TTFT and speed",
    "/quit": "end the chat (also /exit, /bye, or Ctrl-D on an empty line)",
}
KEYS = ("Ctrl-C stops an answer; at the prompt it clears the line, or on an empty line ends the chat. "
        "Up/Down recall earlier lines.")


def history_file() -> Path | None:
    """Where readline's history is kept: $CS336_CHAT_HISTORY ("" for nowhere), else chat_history in the
    package's cache folder (`disk_cache.cache_dir()`)."""
    if "CS336_CHAT_HISTORY" in os.environ:
        return Path(os.environ["CS336_CHAT_HISTORY"]) if os.environ["CS336_CHAT_HISTORY"] else None
    from .model.disk_cache import cache_dir

    return cache_dir() / "chat_history"


@contextlib.contextmanager
def line_editing(enabled: bool):
    """readline's editing and history for input() while the block runs (if `enabled` and readline imports);
    yields the readline module or None. The history is read at the start and written back at the end."""
    try:
        import readline
    except ImportError:   # a Python without readline (Windows): plain input()
        readline = None
    if not enabled or readline is None:
        yield None
        return
    path = history_file()
    readline.set_history_length(HISTORY_LENGTH)
    if path is not None:
        with contextlib.suppress(OSError):
            readline.read_history_file(path)
    try:
        yield readline
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(path)


class StopOnInterrupt:
    """While an answer streams: the first SIGINT (Ctrl-C) sets `requested`, which the loop checks between
    tokens; a second one raises KeyboardInterrupt (the program ends). Outside the block, Ctrl-C is Python's
    KeyboardInterrupt again. Off the main thread, where signals cannot be caught, it changes nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        self.requested = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:   # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def stats_line(turn) -> str:
    """The line printed after each answer: a `TurnStats`'s TTFT, tokens and speed, and what was prefilled."""
    return (f"[TTFT {turn.ttft_s:.2f} s | {turn.generated_tokens} tokens, {turn.decode_tokens_per_s:.1f} tok/s | "
            f"prefilled {turn.prompt_tokens} new tokens, {turn.reused_tokens} reused from the KV cache]")


class ChatREPL:
    """The loop: read a line, run a command or send it to `session` (a `serving.ChatSession`) and stream the
    answer to `out`; `run()` returns the exit status. sampling: `ChatSession.send`'s keywords; each turn's
    seed is `seed` plus the turns so far. stats_line(turn) formats a `TurnStats` after each answer."""

    def __init__(self, session, sampling: dict, seed: int, stats_line, out=None, editing: bool | None = None):
        self.session, self.sampling, self.seed, self.stats_line = session, dict(sampling), seed, stats_line
        self.out = out or sys.stdout
        self.editing = sys.stdin.isatty() if editing is None else editing
        self.readline = None

    def print(self, *parts, end="\n") -> None:
        print(*parts, end=end, file=self.out, flush=True)

    def run(self) -> int:
        with line_editing(self.editing) as self.readline:
            while True:
                try:
                    line = read_line(PROMPT)
                except KeyboardInterrupt:
                    typed = self.readline.get_line_buffer() if self.readline is not None else ""
                    self.print()
                    if typed.strip():
                        continue          # the line is discarded, as a shell does
                    return EXIT_INTERRUPTED
                if line is None:          # Ctrl-D, or the end of piped input
                    self.print()
                    return EXIT_OK
                status = self.handle(line)
                if status is not None:
                    return status

    def handle(self, line: str) -> int | None:
        """Run one line: a command, or a message to answer. Returns an exit status to end the loop, else None."""
        text = line.strip()
        if not text:
            return None
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        self.answer(line[line.index("/") + 1:] if text.startswith("//") else line)
        return None

    def command(self, text: str) -> int | None:
        name = text.split()[0].lower()
        if name in ("/quit", "/exit", "/bye"):
            return EXIT_OK
        if name == "/help":
            for command, what in COMMANDS.items():
                self.print(f"  {command:<8} {what}")
            self.print(f"  {KEYS} A line starting with // sends the rest of it after one /.")
        elif name == "/reset":
            self.session.reset()
            self.print("[the conversation is forgotten]")
        elif name == "/stats":
            self.print(self.stats())
        else:
            self.print(f"[unknown command {name}; /help lists the commands. To send a message starting with /, "
                       f"begin it with //]")
        return None

    def stats(self) -> str:
        """What /stats prints: turns (and how many were stopped), the conversation's tokens in the KV cache
        and its room, tokens generated in all, and the last answer's timing."""
        history, session = self.session.history, self.session
        stopped = sum(turn.stopped for turn in history)
        lines = [f"turns: {len(history)}" + (f" ({stopped} stopped by Ctrl-C)" if stopped else ""),
                 f"conversation: {len([m for m in session.messages if m['role'] != 'system'])} messages, "
                 f"{len(session.ids)} tokens in the KV cache (room for {session.max_seq_len})",
                 f"generated: {sum(turn.generated_tokens for turn in history)} tokens in all"]
        if history:
            lines.append("last answer: " + self.stats_line(history[-1]))
        return "\n".join(lines)

    def answer(self, text: str) -> None:
        """Stream the answer to `text`; Ctrl-C stops it (the part shown stays in the conversation)."""
        self.print("model> ", end="")
        turns, stopped = len(self.session.history), False
        pieces = self.session.send(text, seed=self.seed + turns, **self.sampling)
        with StopOnInterrupt() as stop:
            try:
                for piece in pieces:
                    self.print(piece, end="")
                    if stop.requested:
                        stopped = True
                        break
            except ValueError as e:   # the conversation outgrew the cache: say so and keep the chat alive
                self.print(f"\n[{e}; /reset starts a new conversation]")
                return
            finally:
                pieces.close()        # a stopped answer joins the conversation here
        self.print("\n[stopped by Ctrl-C; the part shown stays in the conversation]" if stopped else "")
        if len(self.session.history) > turns:
            self.print(self.stats_line(self.session.history[-1]))
