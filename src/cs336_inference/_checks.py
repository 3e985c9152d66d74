"""Argument validation used across the package: one function per kind of argument.

Each check returns the value (normalised where that helps, e.g. an int as float) and raises
`TypeError` for a value of the wrong type and `ValueError` for a value of the right type outside
what is allowed; every message names the argument, the value given and what is allowed. `bool` is
never accepted as a number (True == 1 in Python, but `batch_size=True` is a bug).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_error(name: str, value, wanted: str) -> TypeError:
    return TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")


def integer(name: str, value, lo: int | None = None, hi: int | None = None, allowed: str | None = None) -> int:
    """An int with lo <= value <= hi (either bound optional); `allowed` words it for messages ("an int in ...")."""
    if not _is_int(value):
        raise _type_error(name, value, allowed or _range_words(lo, hi))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed or _range_words(lo, hi)}, got {value!r}")
    return value


def _range_words(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"an int in [{lo}, {hi}]"
    if lo == 1:
        return "a positive int"
    if lo == 0:
        return "a non-negative int"
    if lo is not None:
        return f"an int >= {lo}"
    return f"an int <= {hi}" if hi is not None else "an int"


def positive_int(name: str, value, maximum: int | None = None) -> int:
    """An int >= 1 (and <= maximum if given)."""
    return integer(name, value, 1, maximum)


def positive_ints(**values: int) -> None:
    """positive_int for several keyword arguments at once: positive_ints(batch_size=B, head_dim=H)."""
    for name, value in values.items():
        integer(name, value, 1)


def non_negative_int(name: str, value) -> int:
    return integer(name, value, 0)


def optional_positive_int(name: str, value) -> int | None:
    """None, or an int >= 1."""
    return None if value is None else integer(name, value, 1, allowed="a positive int or None")


def number(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, allowed: str | None = None) -> float:
    """A finite real number (int or float, not bool) in the interval given; returned as float."""
    words = allowed or _interval_words(lo, hi, lo_open, hi_open)
    if not _is_number(value):
        raise _type_error(name, value, words)
    value = float(value)
    bad = (not math.isfinite(value)
           or (lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and (value >= hi if hi_open else value > hi)))
    if bad:
        raise ValueError(f"{name} must be {words}, got {value!r}")
    return value


def _interval_words(lo, hi, lo_open, hi_open) -> str:
    if lo is None and hi is None:
        return "a finite number"
    if hi is None:
        return f"a finite number {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"a finite number {'<' if hi_open else '<='} {hi}"
    return f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def finite_positive_float(name: str, value) -> float:
    """A finite number > 0 (int or float, not bool), returned as float."""
    return number(name, value, 0, lo_open=True, allowed="a finite positive number")


def non_negative_float(name: str, value) -> float:
    return number(name, value, 0, allowed="a finite number >= 0")


def probability(name: str, value, allow_zero: bool = True, allow_one: bool = True) -> float:
    """A number in [0, 1] (ends excluded on request: top_p is in (0, 1], a ratio to prune in (0, 1))."""
    return number(name, value, 0, 1, lo_open=not allow_zero, hi_open=not allow_one)


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, value, "True or False")
    return value


def one_of(name: str, value, allowed: Iterable):
    """value must be one of `allowed` (compared with ==; types are not coerced)."""
    allowed = tuple(allowed)
    if value not in allowed or isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed):
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def instance(name: str, value, types, wanted: str | None = None):
    """isinstance(value, types), else a TypeError saying what was wanted."""
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise _type_error(name, value, wanted or f"a {names}")
    return value


def token_ids(name: str, value, vocab_size: int | None = None, dims: tuple[int, ...] = (1, 2)) -> torch.Tensor:
    """A non-empty integer tensor of token ids (1-D or 2-D by default), each in [0, vocab_size), as int64.

    Any integer dtype is accepted (uint8, int32, ...): embeddings need int64, so the ids are converted.
    """
    if not isinstance(value, torch.Tensor):
        raise _type_error(name, value, "a torch.Tensor of integer token ids")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if value.dim() not in dims:
        shapes = " or ".join({1: "(T,)", 2: "(B, T)"}.get(d, f"{d}-D") for d in dims)
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(value.shape)}")
    if value.numel() == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(value.shape)}")
    if vocab_size is not None:
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be in [0, vocab_size={vocab_size}), got values in [{lo}, {hi}]")
    return value.long()


def token_list(name: str, value) -> list[int]:
    """A list/tuple of int token ids (not bool), returned as a list."""
    if not isinstance(value, (list, tuple)) or any(not _is_int(t) for t in value):
        raise _type_error(name, value, "a list of int token ids")
    return list(value)


def token_id_list(name: str, ids) -> list[int]:
    """ids as a list of ints: a list/tuple of ints (numpy ints too) or an integer tensor; a float, a bool or
    anything else is refused (a float id would otherwise be truncated to some other token)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a tensor of dtype {ids.dtype}")
        return ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise TypeError(f"{name} must be a list of int token ids or an integer tensor, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{name} must hold int token ids, got {type(i).__name__} {i!r}")
        out.append(int(i))
    return out


def generator(name: str, value) -> torch.Generator | None:
    """None or a torch.Generator."""
    if value is not None and not isinstance(value, torch.Generator):
        raise _type_error(name, value, "a torch.Generator or None")
    return value
