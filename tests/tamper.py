"""What a graded implementation must not change: the interpreter state the grader itself relies on.

A student's package runs in worker processes (tests/sandbox.py), so these checks are the second line of
defence: code running in the grader's process (the reference; anything that got past the sandbox) could
replace `torch.testing.assert_close`, `torch.equal`, `math.isclose`, a builtin, `pytest.approx`, a
`torch.Tensor` method, a function's code, the tolerance table of `assert_close`, the module behind
`import torch`, push a torch function mode that answers every comparison, or disarm the grader's
timeout. `Snapshot.take()` records all of that before the implementation is imported; `changes()`
names what differs afterwards and `restore()` puts it back. The grader (tests/grading.py and
tests/implementation.py) compares after the import (a tampering import fails every graded test) and
after every graded test (that test fails), and restores each time, so the comparisons of every test
run on the interpreter as it was. Additions are allowed (a package may import more modules or add
attributes of its own); replacing or deleting what was there is not.

What is watched (by module name; classes and functions defined there are watched with them):
builtins and the standard modules a comparison or the grader uses, torch (top level, Tensor,
testing, nn.functional, linalg, overrides), numpy, sympy's core, einops, pytest and pluggy, and the
test modules themselves (adapters, grading, implementation, the references, tests/graded/*). A module
lists the globals it changes itself in `__mutable__` (the grader's own bookkeeping); those are skipped.
SIGALRM is the grader's (its timeout) and not compared: graded code that disarms it meets the watchdog.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from itertools import repeat
from operator import attrgetter, is_
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parent
MISSING = object()

# modules watched whole (these names, present when the snapshot is taken)
MODULES = ("builtins", "math", "cmath", "operator", "functools", "itertools", "fractions", "decimal", "numbers",
           "random", "statistics", "json", "re", "copy", "collections", "signal", "threading", "time", "types",
           "importlib", "inspect", "traceback", "io", "contextlib", "dataclasses",
           "torch", "torch.testing", "torch.testing._comparison", "torch.nn.functional", "torch.linalg",
           "torch.overrides", "torch.functional", "torch._tensor", "torch.autograd", "torch.random",
           "numpy", "numpy.testing", "einops",
           "sympy", "sympy.core.basic", "sympy.core.expr", "sympy.core.numbers", "sympy.core.relational",
           "sympy.core.symbol", "sympy.core.sympify", "sympy.simplify.simplify",
           "pytest", "_pytest.python_api", "_pytest.outcomes", "_pytest.runner", "_pytest.reports", "_pytest.main",
           "_pytest.python", "_pytest.fixtures", "_pytest.skipping", "_pytest.terminal",
           "pluggy", "pluggy._callers", "pluggy._hooks", "pluggy._manager", "pluggy._result")
_HEAP_TYPE, _IMMUTABLE_TYPE = 1 << 9, 1 << 8   # type flags: static C types and immutable ones cannot change
SMALL = 512                                 # module-level dicts/lists/sets up to this size are copied
# modules whose module-level containers are compared too (elsewhere they are caches that change by themselves,
# such as re's pattern cache): the tolerance table of assert_close, and the test modules' own tables
CONTAINER_MODULES = ("torch.testing._comparison",)


def _test_modules() -> list[types.ModuleType]:
    """The test suite's own modules: anything loaded from tests/ (adapters, grading, graded tests, ...)."""
    root = str(TESTS_DIR) + os.sep
    return [m for m in list(sys.modules.values()) if str(getattr(m, "__file__", None) or "").startswith(root)]


def import_lazy_modules() -> None:
    """Modules torch imports on first use that rebind names of modules already watched (torch._dynamo
    wraps torch.manual_seed): imported before a snapshot, so that first use is not mistaken for tampering.
    A snapshot of a process where no untrusted code runs can allow these rebinds instead (`allow_lazy_rebinds`),
    and save the import."""
    import torch._dynamo  # noqa: F401


# (module, name, the module torch imports on first use that rebinds it to a wrapper of the function it replaces)
LAZY_REBINDS = (("torch", "manual_seed", "torch._dynamo"),)


def watched_modules() -> list[types.ModuleType]:
    found = [sys.modules[n] for n in MODULES if isinstance(sys.modules.get(n), types.ModuleType)]
    return found + [m for m in _test_modules() if m not in found]


def _function_state(func: types.FunctionType) -> tuple:
    return (func.__code__, func.__defaults__, func.__kwdefaults__)


def _mode_stacks() -> tuple[list, list]:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return list(_get_current_function_mode_stack()), list(_get_current_dispatch_mode_stack())


def _global_state() -> dict:
    functions, dispatch = _mode_stacks()
    return {
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch function modes": [id(m) for m in functions],
        "torch dispatch modes": [id(m) for m in dispatch],
        "torch function dispatch enabled": torch._C._is_torch_function_enabled(),
        "sys.settrace": sys.gettrace(),
        "sys.setprofile": sys.getprofile(),
        "threading.settrace": threading.gettrace() if hasattr(threading, "gettrace") else None,
        "sys.meta_path": [id(f) for f in sys.meta_path],
        "sys.path_hooks": [id(h) for h in sys.path_hooks],
        "signal handler SIGINT": signal.getsignal(signal.SIGINT),
    }


class Snapshot:
    """The watched state at one moment: `changes()` lists what differs now, `restore()` undoes it.

    Comparisons are by identity (`operator.is_` over C-level `map`s, stopping at the first difference), so
    checking ~40k watched objects after every graded test costs a few milliseconds."""

    def __init__(self):
        self.namespaces: list[tuple[str, dict, dict, list]] = []     # (label, live dict, copy, ids of values)
        self.classes: list[list] = []             # [label, class, watched members, their ids, len(__dict__)]
        self.functions: list[types.FunctionType] = []
        self.function_labels: list[str] = []
        self.function_state: list[tuple] = []                        # (__code__, __defaults__, __kwdefaults__)
        self.containers: list[tuple[str, object, object]] = []       # (label, live container, copy)
        self.sys_modules: dict[str, object] = {}
        self.state: dict = {}
        self.meta_path: list = []
        self.path_hooks: list = []
        self.mode_stacks: tuple[list, list] = ([], [])
        self.lazy_rebinds_allowed = False

    @classmethod
    def take(cls, modules: list[types.ModuleType] | None = None, allow_lazy_rebinds: bool = False) -> "Snapshot":
        """allow_lazy_rebinds: a name of LAZY_REBINDS rebound to a wrapper of the saved function (`__wrapped__`) once
        its module is imported is no change (for a process that runs none of a package's code: the grader's
        own, with --impl; any other code could rebind the same way)."""
        snap = cls()
        snap.lazy_rebinds_allowed = allow_lazy_rebinds
        seen: set[int] = set()
        tests = {id(m) for m in _test_modules()}
        for module in modules if modules is not None else watched_modules():
            name = module.__name__
            containers = name in CONTAINER_MODULES or id(module) in tests
            space = module.__dict__
            mutable = space.get("__mutable__", ())
            saved = {k: v for k, v in space.items() if k not in mutable and _watched(v)}
            snap.namespaces.append((name, space, saved, list(map(id, saved.values()))))
            snap.sys_modules[name] = module
            for key, value in list(space.items()):
                if id(value) in seen or key in mutable:
                    continue
                if isinstance(value, type) and getattr(value, "__module__", None) == name \
                        and value.__flags__ & _HEAP_TYPE and not value.__flags__ & _IMMUTABLE_TYPE:
                    seen.add(id(value))
                    members = {k: v for k, v in vars(value).items() if _watched(v)}
                    snap.classes.append([f"{value.__module__}.{value.__qualname__}", value, members,
                                         list(map(id, members.values())), len(vars(value))])
                    for attr, member in members.items():
                        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                        if isinstance(fn, types.FunctionType) and id(fn) not in seen:
                            seen.add(id(fn))
                            snap._add_function(f"{value.__qualname__}.{attr}", fn)
                elif isinstance(value, types.FunctionType):
                    seen.add(id(value))
                    snap._add_function(f"{name}.{key}", value)
                elif containers and isinstance(value, (dict, list, set)) and len(value) <= SMALL \
                        and not key.startswith("__"):
                    seen.add(id(value))
                    snap.containers.append((f"{name}.{key}", value, value.copy()))
        snap._index()
        snap.state = _global_state()
        snap.meta_path, snap.path_hooks = list(sys.meta_path), list(sys.path_hooks)
        snap.mode_stacks = _mode_stacks()
        return snap

    def _add_function(self, label: str, fn: types.FunctionType) -> None:
        self.functions.append(fn)
        self.function_labels.append(label)
        kw = fn.__kwdefaults__
        self.function_state.append((fn.__code__, fn.__defaults__, kw, dict(kw) if kw else None))

    def _index(self) -> None:
        """Flat lists for `intact`: every watched entry of every namespace, and every watched member of every
        class, looked up by one C-level `map` each."""
        self._dicts = [live for _, live, saved, _ in self.namespaces for _ in saved]
        self._dict_keys = [key for _, _, saved, _ in self.namespaces for key in saved]
        self._dict_values = [value for _, _, saved, _ in self.namespaces for value in saved.values()]
        self._class_dicts = [vars(klass) for _, klass, _, _, _ in self.classes]    # live views of the classes
        self._member_dicts = [live for live, entry in zip(self._class_dicts, self.classes) for _ in entry[2]]
        self._member_keys = [key for entry in self.classes for key in entry[2]]
        self._member_values = [value for entry in self.classes for value in entry[2].values()]
        self._class_sizes = [entry[4] for entry in self.classes]
        self._kwdefaults = [(fn, kw) for fn, (_, _, _, kw) in zip(self.functions, self.function_state)
                            if kw is not None]
        self._function_attrs = [[state[i] for state in self.function_state] for i in range(3)]   # code, defaults, kw

    def _functions_intact(self) -> bool:
        fns = self.functions
        return _all(_all(_map(is_, _map(get, fns), saved)) for get, saved in zip(_FUNCTION_ATTRS, self._function_attrs))

    # --- what changed -----------------------------------------------------------------------------

    def intact(self) -> bool:
        """True if nothing watched was replaced or deleted (the fast check)."""
        if not _all(_map(is_, _map(dict.get, self._dicts, self._dict_keys, repeat(MISSING)), self._dict_values)):
            return False
        # every saved member of a class still holding its object, and no new watched member
        if not _all(_map(is_, _map(_PROXY_GET, self._member_dicts, self._member_keys, repeat(MISSING)),
                         self._member_values)):
            return False
        sizes = list(map(len, self._class_dicts))
        if sizes != self._class_sizes:
            for live, (_, _, saved, _, _), size, now in zip(self._class_dicts, self.classes, self._class_sizes, sizes):
                if now != size and _added(live, saved):
                    return False
            self._class_sizes = sizes    # only data was added (a library's own cache or counter)
        if not self._functions_intact():
            return False
        if any(fn.__kwdefaults__ != kw for fn, kw in self._kwdefaults):
            return False
        if any(_container_changed(live, saved) for _, live, saved in self.containers):
            return False
        if any(sys.modules.get(name) is not module for name, module in self.sys_modules.items()):
            return False
        return _global_state() == self.state

    def quick_changes(self, limit: int = 5) -> list[str]:
        """`changes()` where the cheap part of the state differs (torch's modes and defaults, trace functions, import
        hooks, `sys.modules`, the small containers), else []: what code of the grader's own could leave behind by
        mistake. The identity scan over every watched object is `changes()` alone."""
        if (_global_state() == self.state
                and not any(_container_changed(live, saved) for _, live, saved in self.containers)
                and not any(sys.modules.get(name) is not module for name, module in self.sys_modules.items())):
            return []
        return self.changes(limit)

    def _accept_lazy_rebinds(self) -> bool:
        """Save anew each name of LAZY_REBINDS that its lazily imported module rebound to a wrapper of the saved
        function; True if any was."""
        accepted = False
        for label, live, saved, _ in self.namespaces:
            for module, key, lazy in LAZY_REBINDS:
                if label == module and key in saved and lazy in sys.modules:
                    now = live.get(key, MISSING)
                    if now is not saved[key] and getattr(now, "__wrapped__", None) is saved[key]:
                        saved[key], accepted = now, True
        if accepted:
            self._index()
        return accepted

    def changes(self, limit: int = 5) -> list[str]:
        """Up to `limit` descriptions of what was replaced or deleted since the snapshot (empty: nothing)."""
        if self.intact() or (self.lazy_rebinds_allowed and self._accept_lazy_rebinds() and self.intact()):
            return []
        found: list[str] = []
        for label, live, saved, _ in self.namespaces:
            for key, value in saved.items():
                if live.get(key, MISSING) is not value:
                    found.append(f"{label}.{key} was {'deleted' if key not in live else 'replaced'}")
        for label, klass, saved, _, _ in self.classes:
            live = vars(klass)
            added, deleted = _added(live, saved), sorted(set(saved) - set(live))
            if added:
                found.append(f"{label}: attributes added: {added[:3]}")
            if deleted:
                found.append(f"{label}: attributes deleted: {deleted[:3]}")
            found += [f"{label}.{key} was replaced" for key, value in saved.items()
                      if key in live and live[key] is not value]
        for label, fn, (code, defaults, kw_obj, kw) in zip(self.function_labels, self.functions, self.function_state):
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kw_obj \
                    or (kw is not None and fn.__kwdefaults__ != kw):
                found.append(f"the code or defaults of {label} were replaced")
        found += [f"{label} (a {type(live).__name__}) was modified" for label, live, saved in self.containers
                  if _container_changed(live, saved)]
        found += [f"sys.modules[{name!r}] was replaced" for name, module in self.sys_modules.items()
                  if sys.modules.get(name) is not module]
        now = _global_state()
        found += [f"{key} was changed" for key, value in self.state.items() if now[key] != value]
        return found[:limit] or ["the interpreter state was changed"]

    def restore(self) -> None:
        """Put back everything `changes()` would report (additions to classes are removed too)."""
        for _, live, saved, _ in self.namespaces:
            for key, value in saved.items():
                if live.get(key, MISSING) is not value:
                    live[key] = value
        for _, klass, saved, _, _ in self.classes:
            live = vars(klass)
            for key in _added(live, saved):
                _try(delattr, klass, key)
            for key, value in saved.items():
                if live.get(key, MISSING) is not value:
                    _try(setattr, klass, key, value)
        for fn, (code, defaults, kw_obj, kw) in zip(self.functions, self.function_state):
            if fn.__code__ is not code:
                fn.__code__ = code
            fn.__defaults__, fn.__kwdefaults__ = defaults, kw_obj
            if kw is not None and kw_obj != kw:
                kw_obj.clear()
                kw_obj.update(kw)
        for _, live, saved in self.containers:
            if _container_changed(live, saved):
                if isinstance(live, list):
                    live[:] = saved
                else:
                    live.clear()
                    live.update(saved)
        for name, module in self.sys_modules.items():
            sys.modules[name] = module
        sys.meta_path[:] = self.meta_path
        sys.path_hooks[:] = self.path_hooks
        self._restore_state()

    def _restore_state(self) -> None:
        s = self.state
        torch.set_default_dtype(s["torch default dtype"])
        torch.set_grad_enabled(s["torch grad mode"])
        functions, dispatch = self.mode_stacks
        _pop_modes(functions, dispatch)
        sys.settrace(s["sys.settrace"])
        sys.setprofile(s["sys.setprofile"])
        if hasattr(threading, "gettrace"):
            threading.settrace(s["threading.settrace"])
        if signal.getsignal(signal.SIGINT) is not s["signal handler SIGINT"] and s["signal handler SIGINT"] is not None:
            _try(signal.signal, signal.SIGINT, s["signal handler SIGINT"])


_FUNCTION_ATTRS = tuple(attrgetter(a) for a in ("__code__", "__defaults__", "__kwdefaults__"))
_all, _map = all, map      # bound once: `intact` must not ask a patched `builtins.all` whether all is well
_PROXY_GET = types.MappingProxyType.get


def _watched(value) -> bool:
    """Functions, classes, modules and descriptors are compared; plain data (a library's counters) is not."""
    return callable(value) or isinstance(value, types.ModuleType) or hasattr(type(value), "__get__")


def _added(live, saved) -> list[str]:
    return sorted(k for k in live if k not in saved and _watched(live[k]))


def _container_changed(live, saved) -> bool:
    if isinstance(live, dict):
        return live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items())
    if isinstance(live, list):
        return len(live) != len(saved) or any(a is not b for a, b in zip(live, saved))
    return live != saved


def _pop_modes(functions: list, dispatch: list) -> None:
    """Leave exactly the torch function / dispatch modes that were active at the snapshot."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode
    while len(_get_current_function_mode_stack()) > len(functions):
        torch._C._pop_torch_function_stack()
    while len(_get_current_dispatch_mode_stack()) > len(dispatch):
        _pop_mode()
    if not torch._C._is_torch_function_enabled():   # a DisableTorchFunction left entered
        torch._C._set_torch_function_state(torch._C._TorchFunctionState.ENABLED) \
            if hasattr(torch._C, "_set_torch_function_state") else None


def _try(fn, *args) -> None:
    try:
        fn(*args)
    except (AttributeError, TypeError):   # immutable (C) types cannot have been changed either
        pass
