"""The command line's argument checks: every mistake is one line naming the option, and exit status 2.

`Parser` is argparse's parser with a one-line `error` (argparse prints the whole usage first); the
type functions below refuse a bad value while the arguments are parsed, before anything heavy is
imported or loaded, each saying what was given and what is allowed. `one_line` turns an error the
library raised at run time into the same one line (`main` prints it instead of a traceback; set
CS336_DEBUG=1 to see the traceback).
"""

from __future__ import annotations

import argparse
import math
import sys


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default: "(default: X)" is appended unless the help already
    says what the default is in words (the options whose default is None, a choice made at run time, do)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or any(
                action.default is unset for unset in (None, False, argparse.SUPPRESS)):   # `is`: 0 == False
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: argument --OPTION: what is wrong`; its help (and every
    subcommand's: they are Parsers too) shows each option's default (`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def package_version() -> str:
    """This package's version, as installed (`importlib.metadata`)."""
    from importlib import metadata

    try:
        return metadata.version("cs336-inference")
    except metadata.PackageNotFoundError:
        return "unknown (the package is not installed: pip install -e .)"


def one_line(message) -> str:
    """A message (or an exception) as one line: its lines joined, at most 500 characters."""
    text = " ".join(str(message).split()) or type(message).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def _type(name: str, check):
    """An argparse type function named `name` (argparse's own messages say "invalid NAME value")."""
    def parse(text: str):
        return check(text)
    parse.__name__ = name
    return parse


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _within(parse, ok, allowed: str):
    """A check that parses with `parse` and refuses values outside `ok`, saying what is `allowed`."""
    def check(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value
    return check


_positive = _within(_int, lambda v: v >= 1, "a positive integer (>= 1)")
_non_negative = _within(_int, lambda v: v >= 0, "an integer >= 0")
_port = _within(_int, lambda v: 0 <= v <= 65535, "a port number in [0, 65535]")
_temperature = _within(_float, lambda v: v >= 0, ">= 0 (0 = greedy)")
_positive_float = _within(_float, lambda v: v > 0, "a number > 0")
_probability = _within(_float, lambda v: 0 < v <= 1, "in (0, 1]")


def _text(text: str) -> str:
    """Non-empty, valid UTF-8 (arguments that were not UTF-8 arrive holding lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text[err.start:err.end].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 (byte {raw.hex(' ')} at position {err.start}); "
                                         f"pass UTF-8 text") from None
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _device(text: str) -> str:
    """cpu, mps, cuda or cuda:N (whether it is present is checked when the model loads)."""
    kind, _, index = _text(text).partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def _url(text: str) -> str:
    if not _text(text).startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text!r}")
    return text


positive_int = _type("positive_int", _positive)
non_negative_int = _type("non_negative_int", _non_negative)
port = _type("port", _port)
temperature = _type("temperature", _temperature)
probability = _type("probability", _probability)
positive_float = _type("positive_float", _positive_float)
text = _type("text", _text)
device = _type("device", _device)
url = _type("url", _url)


def read_line(prompt: str) -> str | None:
    """input(prompt), or None at the end of input; a line that is not valid UTF-8 is reported (one line)
    and asked for again, so one bad paste does not end a conversation."""
    while True:
        try:
            line = input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError as err:
            print(f"[that line is not valid UTF-8 (byte {err.object[err.start:err.end].hex(' ')}); type it again]",
                  file=sys.stderr)
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            print("[that line is not valid UTF-8; type it again]", file=sys.stderr)
            continue
        return line
