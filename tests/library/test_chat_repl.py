"""The `chat` command as people expect a chat to behave (chat_repl.py), in this process: Ctrl-C (a real SIGINT)
stops an answer and the conversation goes on, the next answer equal to a fresh session's given the same
messages; the exit statuses; /help, /reset, /stats and the hint for an unknown command; the readline history
file; a model without a chat template refused before it loads; and every option's default in --help, plus
--version. test_chat_terminal.py drives the real program through a terminal (pty)."""

import argparse
import copy
import io
import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from adapters import make_chat_session, make_conversation_cache
from chat_tokenizers import ChatMLBytes

from cs336_inference import chat_repl, cli
from cs336_inference.model import checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    return checkpoints.load_pretrained("target")


class Screen(io.StringIO):
    """The terminal: what the chat printed. After `ctrl_c_after` answer pieces it sends this process a real
    SIGINT (what the terminal sends on Ctrl-C), `times` times in a row."""

    def __init__(self, ctrl_c_after=None, times=1):
        super().__init__()
        self.ctrl_c_after, self.times, self.pieces, self.answering = ctrl_c_after, times, 0, False

    def write(self, text):
        n = super().write(text)
        if text == "model> ":
            self.answering, self.pieces = True, 0
        elif self.answering and text and self.ctrl_c_after is not None:
            self.pieces += 1
            if self.pieces == self.ctrl_c_after:
                self.ctrl_c_after = None
                for _ in range(self.times):
                    signal.raise_signal(signal.SIGINT)
        return n


def feed(monkeypatch, *lines):
    """input() returns `lines` one by one; an exception in them is raised instead (EOFError is Ctrl-D)."""
    items = iter(lines)

    def fake_input(prompt=""):
        item = next(items)
        if isinstance(item, BaseException):
            raise item
        return item
    monkeypatch.setattr("builtins.input", fake_input)


def streams(kind, model):
    """What runs a session's turns: one contiguous cache (the `chat` command's), or a private serving engine."""
    return make_conversation_cache(model, 512) if kind == "conversation cache" else None


def repl(model, screen, max_new_tokens=60, kind="conversation cache"):
    session = make_chat_session(model, ChatMLBytes(), max_seq_len=512, streams=streams(kind, model))
    return chat_repl.ChatREPL(session, dict(max_new_tokens=max_new_tokens), seed=0, stats_line=chat_repl.stats_line,
                              out=screen, editing=False)


@pytest.mark.parametrize("kind", ["conversation cache", "engine"])
def test_ctrl_c_stops_the_answer_keeps_it_and_the_next_answer_is_a_fresh_sessions(target, monkeypatch, kind):
    screen = Screen(ctrl_c_after=8)
    loop = repl(target, screen, kind=kind)
    feed(monkeypatch, "Tell me a story", "And then?", EOFError())
    before = signal.getsignal(signal.SIGINT)
    assert loop.run() == chat_repl.EXIT_OK
    assert signal.getsignal(signal.SIGINT) is before   # Ctrl-C is the program's own again at the prompt
    printed = screen.getvalue()
    first = printed.split("model> ", 1)[1].split("\n[stopped by Ctrl-C", 1)[0]
    session = loop.session
    stopped, second = session.history
    assert stopped.stopped and not second.stopped and stopped.generated_tokens < 60   # it did stop early
    # the part shown is the assistant's turn: exactly what the user saw
    assert session.messages[:2] == [{"role": "user", "content": "Tell me a story"},
                                     {"role": "assistant", "content": first}]
    assert len(first) == 8 and second.reused_tokens > len(ChatMLBytes().encode("[user] Tell me a story"))
    # the next answer is the one a fresh session (a fresh cache, the whole conversation prefilled) gives
    fresh = make_chat_session(target, ChatMLBytes(), max_seq_len=512, messages=copy.deepcopy(session.messages[:2]),
                              streams=streams(kind, target))
    want = "".join(fresh.send("And then?", max_new_tokens=60, seed=1))
    assert session.messages[3] == {"role": "assistant", "content": want} and want in printed
    assert printed.count("TTFT") == 2


def test_a_second_ctrl_c_during_an_answer_ends_the_program_with_130(target, monkeypatch, capsys):
    screen = Screen(ctrl_c_after=3, times=2)
    loop = repl(target, screen)
    feed(monkeypatch, "Tell me a story")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):   # `cli.main` turns it into exit status 130
        loop.run()
    assert loop.session.history[-1].stopped and loop.session.messages[-1]["role"] == "assistant"
    assert signal.getsignal(signal.SIGINT) is before


def test_exit_statuses_and_commands(target, monkeypatch):
    screen = Screen()
    loop = repl(target, screen, max_new_tokens=5)
    feed(monkeypatch, "/help", "/stats", "Hello", "/stats", "/frobnicate", "/reset", "/stats", "//x is a path",
         "/quit", "never read")
    assert loop.run() == chat_repl.EXIT_OK
    out = screen.getvalue()
    for command in ("/help", "/reset", "/stats", "/quit"):
        assert f"  {command}" in out                     # /help lists every command
    stats = re.findall(r"turns: .*\nconversation: .*\ngenerated: .*", out)
    assert stats[0].startswith("turns: 0") and "0 messages, 0 tokens in the KV cache (room for 512)" in stats[0]
    generated = loop.session.history[0].generated_tokens
    assert stats[1].startswith("turns: 1") and "2 messages" in stats[1] and f"generated: {generated} tokens" in stats[1]
    assert "last answer: [TTFT" in out
    assert "[unknown command /frobnicate; /help lists the commands" in out
    assert stats[2].startswith("turns: 1") and "0 messages, 0 tokens" in stats[2]   # /reset forgot it
    assert loop.session.messages[0] == {"role": "user", "content": "/x is a path"}   # "//" sends one "/"
    # Ctrl-D (end of input) ends with 0; Ctrl-C at the prompt (no line editor: nothing typed is known) with 130
    feed(monkeypatch, EOFError())
    assert repl(target, Screen()).run() == chat_repl.EXIT_OK
    feed(monkeypatch, KeyboardInterrupt())
    assert repl(target, Screen()).run() == chat_repl.EXIT_INTERRUPTED


def test_ctrl_c_on_a_line_with_text_discards_it_on_an_empty_one_exits(target, monkeypatch):
    class Readline:   # what readline.get_line_buffer() holds when Ctrl-C arrives
        buffer = ""

        def get_line_buffer(self):
            return self.buffer

    fake = Readline()
    lines = iter(["half a sentence", ""])

    def ctrl_c(prompt=""):
        fake.buffer = next(lines)
        raise KeyboardInterrupt
    monkeypatch.setattr("builtins.input", ctrl_c)
    monkeypatch.setattr(chat_repl, "line_editing", lambda enabled: _yield(fake))
    screen = Screen()
    assert repl(target, screen).run() == chat_repl.EXIT_INTERRUPTED
    assert screen.getvalue() == "\n\n"          # the first Ctrl-C only cleared the line


def _yield(value):
    import contextlib

    @contextlib.contextmanager
    def manager():
        yield value
    return manager()


def test_history_is_kept_in_a_bounded_file(tmp_path, monkeypatch):
    readline = pytest.importorskip("readline")
    path = tmp_path / "state" / "history"
    monkeypatch.setenv("CS336_CHAT_HISTORY", str(path))
    assert chat_repl.history_file() == path
    readline.clear_history()
    with chat_repl.line_editing(True) as module:
        assert module is readline
        for i in range(chat_repl.HISTORY_LENGTH + 5):
            readline.add_history(f"line {i}")
    lines = [line for line in path.read_text().splitlines() if line.startswith("line")]
    assert len(lines) == chat_repl.HISTORY_LENGTH and lines[-1] == f"line {chat_repl.HISTORY_LENGTH + 4}"
    readline.clear_history()
    with chat_repl.line_editing(True):          # the next run starts with it
        assert readline.get_history_item(readline.get_current_history_length()) == lines[-1]
    readline.clear_history()
    monkeypatch.setenv("CS336_CHAT_HISTORY", "")
    assert chat_repl.history_file() is None
    monkeypatch.delenv("CS336_CHAT_HISTORY")
    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path / "cache"))
    assert chat_repl.history_file() == tmp_path / "cache" / "chat_history"


def test_chat_refuses_a_model_without_a_chat_template_before_loading_it(monkeypatch, capsys):
    from cs336_inference import model_source

    def no_loading(self, *args, **kwargs):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(model_source.ModelSource, "load", no_loading)
    monkeypatch.delenv("CS336_DEBUG", raising=False)
    assert cli.main(["chat", "--model", "target", "--no-compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "target has no chat template" in err and "generate --model target" in err
    assert cli.main(["generate", "--model", "draft", "--chat", "--prompt", "hi", "--no-compile"]) == 2
    assert "--chat: draft has no chat template" in capsys.readouterr().err


def test_the_chat_command_runs_the_loop_on_a_toy_model_with_a_template(monkeypatch, capsys):
    import cs336_inference.model as model_package

    monkeypatch.setattr(model_package, "load_tokenizer", lambda name: ChatMLBytes())
    feed(monkeypatch, "Hello there", "/stats", "Again", EOFError())
    assert cli.main(["chat", "--model", "target", "--max-new-tokens", "10", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.count("TTFT") == 3 and "reused from the KV cache" in out and "turns: 1" in out   # 2 answers + /stats
    assert "/help lists the commands, Ctrl-C stops an answer" in out


def _options(parser):
    """(subcommand parser, action) for every option of every subcommand (nested ones too)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser, action


def test_every_option_shows_its_default_in_help():
    seen = 0
    for parser, action in _options(cli.build_parser()):
        shown = " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
        name = f"{parser.prog} {action.option_strings[0]}"
        if action.required or action.default is False:
            continue                     # required, or a flag: nothing to show
        # decided at run time (None), or a value better said in words: the help says what happens
        assert "default" in shown.lower(), f"{name}: help does not say its default: {shown!r}"
        if action.default is not None and "default" not in action.help.lower():
            assert f"(default: {action.default})" in shown, f"{name}: help does not show {action.default!r}"
            seen += 1
    assert seen >= 10   # --max-new-tokens 256, --temperature 0.0, --port 8000, --max-num-seqs 32, ...
    serve = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "--port PORT the port to listen on (default: 8000)" in serve and "at most (default: 32)" in serve
    chat = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["chat"].format_help().split())
    assert "in tokens (default: 256)" in chat and "0 = greedy (default: 0.0)" in chat
    assert "ends the chat with exit status 130" in chat and "/quit ends it with status 0" in chat   # the keys


def test_version_prints_the_package_version_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cs336_inference", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"cs336-inference {metadata.version('cs336-inference')}"
