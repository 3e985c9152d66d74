"""Which implementation the graded tests call: the reference solution (default) or a student's package.

`pytest --impl SPEC` (or the environment variable CS336_INFERENCE_IMPL=SPEC) selects it; SPEC is an
importable module name (`my_solution`) or a path to a package folder or a .py file. An empty or
blank SPEC is an error (an unset shell variable must not grade the reference). `tests/adapters.py`
asks `get(NAME)` for each graded function at call time (through tests/guard.py), so nothing else
changes between grading the reference and grading a student.

A student's package (any SPEC) is never imported in the grader's process: tests/sandbox.py imports it
once per run in a process of its own (`locate` says what to import, without running any of it) and every
graded call runs in a worker process forked from there; this module imports only the reference. Failures
stay local to the test that needs the missing piece, never a silent fallback to the reference: a name the
package does not define raises `NotImplementedGraded` ("not implemented: NAME"). A package that cannot be
imported is reported once, before any test runs (tests/grading.py), and scores 0; so is one named like a
module the grader already uses or could import (`torch`, `json`, `adapters`, ...). A package folder is
imported under its own name without putting its parent folder on `sys.path`, so other folders next to it
cannot shadow anything either.
"""

from __future__ import annotations

__mutable__ = ("_spec", "_module", "_error", "_snapshot", "_loaded", "_prepared")   # bookkeeping tests/tamper.py skips

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

import guard
import tamper

REFERENCE = "cs336_inference.homework.reference"
ENV_VAR = "CS336_INFERENCE_IMPL"

_spec: str | None = None
_module = None
_error: str | None = None
_snapshot: tamper.Snapshot | None = None
_loaded: dict[str, Path] = {}        # package name -> folder, for packages this module imported
_prepared = False                    # prepare() has run


class NotImplementedGraded(NotImplementedError):
    """A graded name the implementation under test does not provide (or that raised NotImplementedError)."""


class ImplementationImportError(RuntimeError):
    """The implementation under test could not be imported (or was refused)."""


def select(spec: str | None) -> None:
    """Grade `spec` (module name or path); None selects the reference. Takes effect on the next `get`.

    Raises ValueError for an empty or blank spec: `--impl "$UNSET"` must not silently grade the reference."""
    global _spec, _module, _error, _snapshot
    if spec is not None and (not isinstance(spec, str) or not spec.strip()):
        raise ValueError(f"the implementation to grade (--impl or ${ENV_VAR}) is empty ({spec!r}); give a package "
                         f"folder, a .py file or a module name, or leave both unset to grade the reference solution")
    _spec, _module, _error, _snapshot = (spec.strip() if spec else None), None, None, None


def selected() -> str:
    """What is graded, for messages and reports."""
    return _spec or REFERENCE


def is_reference() -> bool:
    return _spec is None


def isolated() -> bool:
    """A student's package (any --impl): it runs only in worker processes (tests/sandbox.py), never here."""
    return _spec is not None


def locate(spec: str) -> dict:
    """What a worker process imports for `spec` (tests/sandbox_worker.py), found without running any of it:
    {"spec", "kind": module / package / file, "name", "path", "sys_path"}. Raises ImportError (naming the
    path) for a folder or file that is missing, not a package, badly named, or named like a module it would
    shadow."""
    if not _looks_like_path(spec):
        return {"spec": spec, "kind": "module", "name": spec, "path": None, "sys_path": list(sys.path)}
    path = Path(spec).resolve()
    if path.is_dir():
        if not (path / "__init__.py").exists():
            raise ImportError(f"{path} is a folder without __init__.py (not a Python package)")
        name, kind, where = path.name, "package", path
    elif path.is_file():
        name, kind, where = path.stem, "file", path.parent
    else:
        raise ImportError(f"no such file or folder: {path}")
    if not name.isidentifier():
        raise ImportError(f"{path}: a package or module name must be a Python identifier, got {name!r}")
    _refuse_shadowing(name, where)
    return {"spec": spec, "kind": kind, "name": name, "path": str(path), "sys_path": list(sys.path)}


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith(".py") or Path(spec).exists()


def _shadowed(name: str, path: Path) -> str | None:
    """What importing a package called `name` from `path` would shadow (None: nothing)."""
    if name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        return "a module of Python's standard library"
    loaded = sys.modules.get(name)
    if loaded is not None and _loaded.get(name) is None:
        where = getattr(loaded, "__file__", None)
        return f"the module the grader already imported ({where or 'built in'})"
    if loaded is None:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        origin = Path(found.origin).resolve() if found is not None and found.origin not in (None, "built-in") else None
        if found is not None and (origin is None or not origin.is_relative_to(path)):
            return f"the installed module {name!r} ({found.origin})"
    return None


def _refuse_shadowing(name: str, path: Path) -> None:
    what = _shadowed(name, path)
    if what is not None:
        raise ImportError(f"the package name {name!r} shadows {what}; rename the folder (for example to "
                          f"{name}_solution) and grade that")


def _forget(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def prepare() -> None:
    """The grader's own imports that precede a student's package (the reference, so its registry is not
    counted as a change; torch's lazy modules). tests/grading.py calls this before it arms a graded test's
    timeout, so on a slow machine the grader's own second of imports never counts against the student."""
    global _prepared
    if not _prepared and not is_reference() and _module is None and _error is None:
        importlib.import_module(REFERENCE)
        tamper.import_lazy_modules()
        _prepared = True


def _watch() -> None:
    """Right before graded code first runs: snapshot the interpreter (tests/tamper.py)."""
    global _snapshot
    if not is_reference():
        prepare()
        _snapshot = tamper.Snapshot.take()


def _import(spec: str):
    if not _looks_like_path(spec):
        _watch()
        return importlib.import_module(spec)
    path = Path(spec).resolve()
    if path.is_dir():
        init = path / "__init__.py"
        if not init.exists():
            raise ImportError(f"{path} is a folder without __init__.py (not a Python package)")
        name = path.name
        if not name.isidentifier():
            raise ImportError(f"{path}: a package folder's name must be a Python identifier, got {name!r}")
        _refuse_shadowing(name, path)
        if name in _loaded:
            _forget(name)                   # a package of the same name graded earlier in this process
        module_spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    elif path.is_file():
        name = path.stem
        if not name.isidentifier():
            raise ImportError(f"{path}: a module file's name must be a Python identifier, got {name!r}")
        _refuse_shadowing(name, path.parent)
        if name in _loaded:
            _forget(name)
        module_spec = importlib.util.spec_from_file_location(name, path)
    else:
        raise ImportError(f"no such file or folder: {path}")
    _watch()
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    _loaded[name] = path
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        _forget(name)
        raise
    return module


def module():
    """The implementation's module, imported once (the import error, if any, is re-raised on every call).
    Only the reference is imported here: a student's package runs in worker processes (tests/sandbox.py)."""
    global _module, _error, _snapshot
    if isolated():
        raise RuntimeError(f"the grader does not import {selected()!r} in its own process; graded calls go "
                           f"through tests/sandbox.py")
    if _module is None and _error is None:
        interrupts = guard._user_interrupts
        try:
            _module = _import(selected())
        except BaseException as err:   # a student's module may raise anything at import time
            if isinstance(err, KeyboardInterrupt) and guard._user_interrupts != interrupts:
                raise                  # a real Ctrl-C
            _error = _describe(err)
        changed = _snapshot.changes() if _snapshot is not None else []
        if changed:
            _snapshot.restore()
            _module, _error = None, (f"importing it changed the grader's interpreter ({'; '.join(changed)}); "
                                     f"graded code must not patch torch, numpy, math, builtins, pytest or the "
                                     f"tests (everything was restored)")
        if _module is None:
            _snapshot = None           # nothing of it will run: no test needs comparing
    if _error is not None:
        raise ImplementationImportError(f"cannot import the implementation {selected()!r}: {_error}")
    return _module


def _describe(err: BaseException) -> str:
    """One line about an import failure, without running the package's own exception code."""
    if guard._ordinary(err):
        return "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()[-1][:500]
    return f"it raised {type(err).__qualname__} while being imported"


def get(name: str):
    """The graded function or class `name` of the implementation under test (raw: adapters call it via guard)."""
    obj = getattr(module(), name, None)
    if obj is None:
        raise NotImplementedGraded(f"not implemented: {name} ({selected()} defines no {name})")
    return obj


def changes_since_import() -> list[str]:
    """What graded code changed in the interpreter since the implementation was imported; restores it."""
    if _snapshot is None:
        return []
    changed = _snapshot.changes()
    if changed:
        _snapshot.restore()
    return changed
