"""The command line's mistakes: every one is a single line on stderr naming the option (or what the
library refused), no traceback, exit status 2. Most cases run `cli.main` in this process (argv arrives
as Python decodes it: bytes that are not UTF-8 become lone surrogates); one runs the real
`python -m cs336_inference` with non-UTF-8 bytes in argv, so the whole path is checked once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_inference import cli

ROOT = Path(__file__).resolve().parents[2]
NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")     # what Python makes of Latin-1 bytes in argv

CASES = {   # argv -> what the one line must contain
    "empty prompt": (["generate", "--prompt", ""], "--prompt: must not be empty"),
    "blank prompt": (["generate", "--prompt", "   "], "--prompt: must not be empty"),
    "non-UTF-8 prompt": (["generate", "--prompt", NOT_UTF8], "--prompt: is not valid UTF-8 (byte e9"),
    "zero new tokens": (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be a pos"),
    "negative new tokens": (["generate", "--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens: must be a"),
    "text new tokens": (["generate", "--prompt", "hi", "--max-new-tokens", "ten"], "--max-new-tokens: must be an int"),
    "chat zero new tokens": (["chat", "--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer"),
    "negative temperature": (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature: must be >= 0"),
    "nan temperature": (["chat", "--temperature", "nan"], "--temperature: must be a finite number"),
    "top-k zero": (["generate", "--prompt", "hi", "--top-k", "0"], "--top-k: must be a positive integer"),
    "top-p above one": (["chat", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    "top-p zero": (["chat", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    "negative seed": (["chat", "--seed", "-1"], "--seed: must be an integer >= 0"),
    "bad device": (["generate", "--prompt", "hi", "--device", "gpu"], "--device: must be cpu, cuda, cuda:N or mps"),
    "bad dtype": (["chat", "--dtype", "int8"], "--dtype: invalid choice"),
    "empty model": (["chat", "--model", ""], "--model: must not be empty"),
    "empty system": (["chat", "--system", ""], "--system: must not be empty"),
    "unknown model": (["generate", "--prompt", "hi", "--model", "gpt-17"], "unknown pretrained model 'gpt-17'"),
    "bench unknown": (["bench", "nope"], "argument which: invalid choice"),
    "bench inference unknown model": (["bench", "inference", "--model", "gpt-17"], "unknown model 'gpt-17'"),
    "bench option not taken": (["bench", "roofline", "--preset", "chat"], "does not take --preset"),
    "bench concurrency": (["bench", "inference", "--concurrency", "0"], "--concurrency: must be a positive"),
    "bench output len": (["bench", "inference", "--output-len", "x"], "--output-len: must be an integer"),
    "bench endpoint": (["bench", "inference", "--endpoint", "localhost:8000"], "--endpoint: must be an http"),
    "bench arrivals": (["bench", "inference", "--arrivals", "burst"], "--arrivals: invalid choice"),
    "train steps": (["train", "--preset", "target", "--steps", "0"], "--steps: must be a positive integer"),
    "train preset": (["train", "--preset", "huge"], "--preset: invalid choice"),
    "train no preset": (["train"], "the following arguments are required: --preset"),
    "serve port": (["serve", "--port", "70000"], "--port: must be a port number in [0, 65535]"),
    "serve seqs": (["serve", "--max-num-seqs", "0"], "--max-num-seqs: must be a positive integer"),
    "serve blocks": (["serve", "--num-blocks", "-2"], "--num-blocks: must be a positive integer"),
    "figures device": (["figures", "--device", "tpu"], "--device: must be cpu, cuda, cuda:N or mps"),
    "homework empty dir": (["homework", "init", ""], "dir: must not be empty"),
    "homework no action": (["homework"], "the following arguments are required: action"),
    "lecture two files": (["lecture", "--class", "--path", "x.py"], "--path and --class name two lecture files"),
    "unknown command": (["fly"], "invalid choice: 'fly'"),
    "unknown option": (["chat", "--colour"], "unrecognized arguments: --colour"),
}


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:          # argparse's errors exit
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", CASES)
def test_every_mistake_is_one_line_naming_it_and_exit_status_2(name, capsys, monkeypatch):
    monkeypatch.delenv("CS336_DEBUG", raising=False)
    argv, text = CASES[name]
    code, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, f"{name}: exit status {code}; stderr: {err!r}"
    assert len(lines) == 1 and "Traceback" not in err, f"{name}: want one line, got {err!r}"
    assert text in lines[0], f"{name}: {lines[0]!r} does not say {text!r}"


def test_homework_init_errors_name_what_is_wrong(tmp_path, capsys):
    code, err = run_cli(["homework", "init", str(tmp_path / "torch")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "shadows" in err


def test_a_real_process_with_non_utf8_bytes_in_argv(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("CS336_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "cs336_inference", "generate", "--prompt", b"caf\xe9"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=300)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "--prompt: is not valid UTF-8" in err and "Traceback" not in err


def test_chat_reads_past_a_line_that_is_not_utf8(monkeypatch, capsys):
    from cs336_inference import cli_args

    lines = iter([UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "hello", EOFError()])

    def fake_input(prompt):
        item = next(lines)
        if isinstance(item, BaseException):
            raise item
        return item
    monkeypatch.setattr("builtins.input", fake_input)
    assert cli_args.read_line("you> ") == "hello"
    assert "not valid UTF-8 (byte ff)" in capsys.readouterr().err
    assert cli_args.read_line("you> ") is None
