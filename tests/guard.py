"""Every call into the implementation under test goes through here (tests/adapters.py's `_graded`).

A graded call:
- names itself while it runs (`current()`), so a timeout says which function never returned;
- turns what a student's code may raise to steer pytest (pytest.skip / pytest.exit / pytest.fail,
  SystemExit, a KeyboardInterrupt it raised itself, an exception type of its own whose message runs
  its code) into a plain failure of that test: skipping would drop the test from the total, exiting
  would end the run;
- checks what comes back: plain `torch.Tensor`s (no subclass, whose methods it could override),
  Python ints / floats / bools / strings, sympy expressions, and lists, tuples and dicts of those. A
  result of the wrong kind fails with a message naming the function, what it returned and what was
  expected (tests never call a method of a student's object they did not ask for);
- class instances (BlockAllocator, RollingKVCache, ...) come back wrapped (`GuardedObject`): each
  method call and attribute read is a graded call of its own.
"""

from __future__ import annotations

__mutable__ = ("_calls", "_user_interrupts")   # bookkeeping tests/tamper.py skips

import numbers
import signal

import torch

from _pytest.outcomes import Exit, OutcomeException

_calls: list[str] = []          # the graded calls in progress, innermost last
_user_interrupts = 0            # SIGINTs delivered by the terminal (a KeyboardInterrupt the code raised is not one)
MAX_DEPTH = 8                   # nesting of lists/dicts in a result


class GradedCallError(AssertionError):
    """A graded call misbehaved (a control-flow exception, an exception type of its own, a bad result)."""


class GradedTimeout(Exception):
    """A graded test ran past --graded-timeout (SIGALRM in-process; the test's deadline in a worker process)."""


def current() -> str | None:
    """The innermost graded call in progress (None between calls)."""
    return _calls[-1] if _calls else None


def install_interrupt_handler() -> None:
    """Count real Ctrl-Cs so a KeyboardInterrupt raised by graded code can be told apart from one."""
    def handler(signum, frame):
        global _user_interrupts
        _user_interrupts += 1
        signal.default_int_handler(signum, frame)
    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:   # not the main thread: leave Ctrl-C alone
        pass


def _ordinary(err: BaseException, depth: int = 0) -> bool:
    """An exception pytest can print without running graded code: a builtin or library type whose
    arguments are plain strings and numbers, and whose cause / context chain is ordinary too."""
    if depth > 8 or str(getattr(type(err), "__module__", "")).split(".")[0] not in _TRUSTED_MODULES:
        return False
    if not all(type(a) in (str, int, float, bool) or a is None for a in err.args):
        return False
    return all(_ordinary(e, depth + 1) for e in (err.__cause__, err.__context__) if e is not None)


def _as_builtin(err: Exception) -> Exception:
    """An exception of graded code's own type (say `class OutOfBlocks(RuntimeError)`), re-raised as its
    nearest builtin base class (still caught by `pytest.raises(RuntimeError)`) with its message as text, so
    pytest never runs the package's code when it prints the failure. Its traceback is kept."""
    try:
        text = str(err)[:500]
    except BaseException:   # noqa: B036  (a __str__ that raises, even SystemExit)
        text = "<its message could not be printed>"
    message = f"{type(err).__qualname__}: {text}" if text else type(err).__qualname__
    base = next((c for c in type(err).__mro__ if c.__module__ == "builtins"), Exception)
    try:
        new = base(message)
    except Exception:       # bases with other signatures (UnicodeDecodeError, ...)
        new = GradedCallError(message)
    return new.with_traceback(err.__traceback__)


_TRUSTED_MODULES = ("builtins", "torch", "numpy", "sympy", "einops", "implementation", "guard", "grading", "tamper")


def call(name: str, fn, args=(), kwargs=None, returns="any"):
    """fn(*args, **kwargs) as the graded call `name`, its result checked against `returns`."""
    if not callable(fn):
        raise GradedCallError(f"{name} must be a function or class, got {_kind(fn)}")
    interrupts = _user_interrupts
    _calls.append(name)
    try:
        result = fn(*args, **(kwargs or {}))
    except KeyboardInterrupt:
        if _user_interrupts != interrupts:
            raise                                     # the user pressed Ctrl-C: stop the run
        raise GradedCallError(f"{name} raised KeyboardInterrupt (graded code must not)") from None
    except (OutcomeException, Exit, SystemExit, GeneratorExit) as err:
        raise GradedCallError(f"{name} raised {type(err).__name__}: graded code must not skip, fail, exit or "
                              f"end the run") from None
    except Exception as err:
        if _ordinary(err):
            raise                                     # an ordinary failure: keep its message and traceback
        raise _as_builtin(err) from None
    finally:
        _calls.pop()
    return check(name, result, returns)


def private_copies(args: tuple) -> tuple:
    """The arguments with every tensor cloned (also inside lists, tuples and dicts): graded code cannot
    change the test's own inputs, from which the test may compute its reference afterwards."""
    def copy(a, depth=0):
        if isinstance(a, torch.Tensor):
            return a.clone()
        if depth < MAX_DEPTH and type(a) in (list, tuple):
            return type(a)(copy(x, depth + 1) for x in a)
        if depth < MAX_DEPTH and type(a) is dict:
            return {k: copy(v, depth + 1) for k, v in a.items()}
        return a
    return tuple(copy(a) for a in args)


def check(name: str, value, returns="any"):
    """value if it is what `returns` describes (see the module docstring), else GradedCallError."""
    if returns == "raw":
        return value
    if isinstance(returns, dict):                    # an object with these members
        return GuardedObject(name, value, returns)
    if isinstance(returns, tuple):
        if type(value) not in (tuple, list) or len(value) != len(returns):
            raise GradedCallError(f"{name} must return a tuple of {len(returns)} ({', '.join(map(str, returns))}), "
                                  f"got {_kind(value)}")
        return tuple(check(f"{name}[{i}]", v, r) for i, (v, r) in enumerate(zip(value, returns)))
    value = _plain(name, value, 0)
    if returns == "any":
        return value
    if returns == "tensor":
        if type(value) is not torch.Tensor:
            raise GradedCallError(f"{name} must return a torch.Tensor, got {_kind(value)}")
        return value
    if returns == "int":
        if type(value) is torch.Tensor and value.dim() == 0 and not value.dtype.is_floating_point \
                and value.dtype != torch.bool:
            return int(value)
        if type(value) is not int:
            raise GradedCallError(f"{name} must return an int, got {_kind(value)}")
        return value
    if returns == "number":
        if type(value) not in (int, float):
            raise GradedCallError(f"{name} must return a number (int or float), got {_kind(value)}")
        return value
    if returns == "bool":
        if type(value) is not bool:
            raise GradedCallError(f"{name} must return True or False, got {_kind(value)}")
        return value
    if returns == "dict":
        if type(value) is not dict:
            raise GradedCallError(f"{name} must return a dict, got {_kind(value)}")
        return value
    if returns == "list":
        if type(value) not in (list, tuple):
            raise GradedCallError(f"{name} must return a list, got {_kind(value)}")
        return list(value)
    raise ValueError(f"unknown result kind {returns!r}")


def _plain(name: str, value, depth: int):
    """value itself if it is built only of the plain types the tests may compare; else GradedCallError."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str, torch.Tensor):
        return value
    if kind in (list, tuple):
        if depth >= MAX_DEPTH:
            raise GradedCallError(f"{name} returned lists nested deeper than {MAX_DEPTH}")
        return kind(_plain(name, v, depth + 1) for v in value)
    if kind is dict:
        if depth >= MAX_DEPTH:
            raise GradedCallError(f"{name} returned dicts nested deeper than {MAX_DEPTH}")
        out = {}
        for k, v in value.items():
            if type(k) not in (str, int):
                raise GradedCallError(f"{name} returned a dict with a {_kind(k)} key; use str keys")
            out[k] = _plain(name, v, depth + 1)
        return out
    if str(getattr(kind, "__module__", "")).startswith("sympy.") or kind.__module__ == "sympy":
        return value                                   # a sympy expression (its own classes only)
    if isinstance(value, torch.Tensor):
        raise GradedCallError(f"{name} returned a torch.Tensor subclass ({kind.__qualname__}); return a plain "
                              f"torch.Tensor")
    if isinstance(value, numbers.Number) and kind.__module__ == "numpy":
        return value.item()                            # a numpy scalar: its Python value
    raise GradedCallError(f"{name} returned {_kind(value)}; return plain tensors, numbers, lists, tuples and dicts")


def _kind(value) -> str:
    """How a value is named in messages, without running any of its own code."""
    kind = type(value)
    if kind is torch.Tensor:
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if kind in (int, float, bool, str) or value is None:
        return f"{kind.__name__} {value!r:.60}"
    return f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else f"a {kind.__name__}"


class GuardedObject:
    """A student's object (an instance of a graded class) seen through graded calls only.

    `members`: attribute name -> result kind; each method call and attribute read goes through
    `call` (named CLASS.ATTR), and anything not listed is refused (the tests only use what the
    docstring promises)."""

    __slots__ = ("_name", "_obj", "_members")

    def __init__(self, name: str, obj, members: dict):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_members", members)

    def __getattr__(self, attr: str):
        name, obj, members = self._name, self._obj, self._members
        if attr not in members:
            raise AttributeError(f"the grader does not use {name}.{attr}")
        value = call(f"{name}.{attr}", lambda: getattr(obj, attr), returns="raw")
        if callable(value) and not isinstance(value, (int, float, bool, torch.Tensor)):
            return lambda *args, **kwargs: call(f"{name}.{attr}", value, args, kwargs, members[attr])
        return check(f"{name}.{attr}", value, members[attr])

    def __setattr__(self, attr, value):
        raise AttributeError("the grader never sets attributes of a graded object")

    def __repr__(self) -> str:
        return f"<graded {self._name} object>"
