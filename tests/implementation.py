"""Which implementation the graded tests call: the reference solution (default) or a student's package.

`pytest --impl SPEC` (or the environment variable CS336_INFERENCE_IMPL=SPEC) selects it; SPEC is an
importable module name (`my_solution`) or a path to a package folder or a .py file. `tests/adapters.py`
asks `get(NAME)` for each graded function at call time, so nothing else changes between grading the
reference and grading a student.

Failures stay local to the test that needs the missing piece, never the whole run and never a silent
fallback to the reference: a name the package does not define raises `NotImplementedGraded`
("not implemented: NAME"); a package that cannot be imported fails every graded test with the import
error (the run and its results.json still complete).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

REFERENCE = "cs336_inference.homework.reference"
ENV_VAR = "CS336_INFERENCE_IMPL"

_spec: str | None = None
_module = None
_error: str | None = None


class NotImplementedGraded(NotImplementedError):
    """A graded name the implementation under test does not provide (or that raised NotImplementedError)."""


class ImplementationImportError(RuntimeError):
    """The implementation under test could not be imported."""


def select(spec: str | None) -> None:
    """Grade `spec` (module name or path); None or "" selects the reference. Takes effect on the next `get`."""
    global _spec, _module, _error
    _spec, _module, _error = (spec or None), None, None


def selected() -> str:
    """What is graded, for messages and reports."""
    return _spec or REFERENCE


def is_reference() -> bool:
    return _spec is None


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith(".py") or Path(spec).exists()


def _import(spec: str):
    if not _looks_like_path(spec):
        return importlib.import_module(spec)
    path = Path(spec).resolve()
    if path.is_dir():
        if not (path / "__init__.py").exists():
            raise ImportError(f"{path} is a folder without __init__.py (not a Python package)")
        cached = sys.modules.get(path.name)
        if cached is not None and Path(getattr(cached, "__file__", "") or "").parent != path:
            for name in [n for n in sys.modules if n == path.name or n.startswith(path.name + ".")]:
                del sys.modules[name]          # another package of the same name was graded earlier
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        return importlib.import_module(path.name)
    if not path.is_file():
        raise ImportError(f"no such file or folder: {path}")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return module


def module():
    """The implementation's module, imported once (the import error, if any, is re-raised on every call)."""
    global _module, _error
    if _module is None and _error is None:
        try:
            _module = _import(selected())
        except BaseException as err:   # a student's module may raise anything at import time
            if isinstance(err, KeyboardInterrupt):
                raise
            _error = "".join(traceback.format_exception_only(type(err), err)).strip()
    if _error is not None:
        raise ImplementationImportError(f"cannot import the implementation {selected()!r}: {_error}")
    return _module


def get(name: str):
    """The graded function or class `name` of the implementation under test."""
    obj = getattr(module(), name, None)
    if obj is None:
        raise NotImplementedGraded(f"not implemented: {name} ({selected()} defines no {name})")
    return obj
