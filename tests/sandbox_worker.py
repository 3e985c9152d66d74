"""The processes a student's package runs in (tests/sandbox.py is the grader's side; read it first).

Three kinds of process, all started from this file:
- the *supervisor* (`python -I tests/sandbox_worker.py FD`, spawned by the grader): imports torch and the
  library (never the student's package), is the child subreaper of everything below it (an orphan of a
  student's process is re-parented here, so it can always be found and killed), and forks a package root
  on request. It runs no student code, so the grader may trust the pids it reports;
- the *package root* (forked by the supervisor, one per grading run): a new session, imports the student's
  package once and reports how that went, records the state a fresh worker starts from (`Baseline`), then
  forks a worker whenever the grader asks for one (at the first graded call, and after any failure);
- a *worker* (forked by the package root): closes every inherited fd but the socket the grader gave it,
  limits its address space, silences fds 1 and 2 (its prints are collected and sent back as text), and
  answers the grader's requests: call a graded function, read an attribute of or call a method on an
  object it returned, run the backward pass of a result that needs gradients. A worker serves test after
  test; at the end of each the grader sends "reset": the worker drops the test's objects and reports whether
  its interpreter still matches the baseline (if not, or if anything else went wrong, the grader replaces it).

Everything sent back is plain data the grader decodes without running code (see `encode`): tensors as
raw bytes with dtype and shape, numbers, strings, lists, tuples, dicts, sympy trees, object handles.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import traceback

HEADER = struct.Struct(">Q")
MAX_DEPTH = 8
MAX_NODES = 10_000                  # of a sympy expression (the course's formulas have tens)
PR_SET_CHILD_SUBREAPER = 36
OUTPUT_LIMIT = 4000                 # characters of a worker's prints kept per reply
SMALL = 256                         # containers of a package's globals up to this size are compared item by item
CONTROL_FLOW = ("Skipped", "Exit", "Failed", "XFailed", "OutcomeException")


class GeneratorArg:
    """A torch.Generator of the test's arguments: its device and state (bytes) go to the worker, its state comes
    back."""

    __slots__ = ("slot", "device", "state")

    def __init__(self, slot, device, state):
        self.slot, self.device, self.state = slot, device, state


class TensorArg:
    """A tensor argument as raw bytes (much cheaper to pickle than torch's own reduction of a tensor)."""

    __slots__ = ("dtype", "shape", "raw")

    def __init__(self, tensor):
        t = tensor.detach().cpu().contiguous()
        self.dtype, self.shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        self.raw = t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""

    def tensor(self):
        import torch
        dtype = getattr(torch, self.dtype)
        if not self.raw:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.raw), dtype=torch.uint8).view(dtype).reshape(self.shape)


class GradArg:
    """A tensor argument that requires grad: the worker makes it a leaf that requires grad again."""

    __slots__ = ("slot", "tensor")

    def __init__(self, slot, tensor):
        self.slot, self.tensor = slot, tensor


# --- framing: an 8-byte length, then a pickle ------------------------------------------------------------


def send(sock, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(HEADER.pack(len(data)) + data)


def recv(sock):
    """The next message from the grader (trusted: plain pickle), or None at end of stream."""
    header = _exactly(sock, HEADER.size)
    if header is None:
        return None
    body = _exactly(sock, HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _exactly(sock, n: int):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# --- the supervisor ---------------------------------------------------------------------------------------


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    setup = recv(control)
    if setup is None:
        os._exit(0)
    sys.path[:] = setup["sys_path"]
    try:
        import ctypes
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass                                              # not Linux: process groups only (tests/sandbox.py)
    for name in setup.get("preload", ()):
        try:
            __import__(name)
        except Exception:   # noqa: BLE001  (a preload is only a head start)
            pass
    import torch                                          # noqa: F401  (every package root starts with it)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)         # the supervisor reaps whatever ends below it
    send(control, {"ready": os.getpid()})
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        except OSError:
            os._exit(0)
        if not msg or not fds:
            os._exit(0)                                    # the grader is gone
        request = pickle.loads(msg)
        pid = os.fork()
        if pid == 0:
            control.close()
            _package_root(socket.socket(fileno=fds[0]), request)
            os._exit(0)
        os.close(fds[0])
        control.sendall(pickle.dumps({"pid": pid}))


# --- the package root -------------------------------------------------------------------------------------


def _package_root(control, request) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    _quiet_fds()
    sys.path[:] = request["sys_path"]
    import importlib
    import importlib.util

    import torch
    torch.set_num_threads(1)     # torch ops at import start no thread pool a forked worker would inherit broken
    spec, kind = request["spec"], request["kind"]
    try:
        if kind == "module":
            module = importlib.import_module(spec)
        else:
            name, path = request["name"], request["path"]
            if kind == "package":
                found = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                               submodule_search_locations=[path])
            else:
                found = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[name] = module
            found.loader.exec_module(module)
        report = {"imported": True}
    except BaseException as err:   # noqa: B036  (a student's module may raise anything at import time)
        module, report = None, {"imported": False, "error": _one_line(err)}
    try:
        send(control, report)
    except OSError:
        os._exit(0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    baseline = Baseline.take(request["name"] if module is not None else None)
    import gc
    gc.freeze()                  # what the import made is never scanned again: a worker's collections stay cheap
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        except OSError:
            os._exit(0)
        if not msg or not fds:
            os._exit(0)
        options = pickle.loads(msg)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _worker(control, fds[0], module, options, baseline)
            os._exit(0)
        os.close(fds[0])


def _quiet_fds() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _one_line(err: BaseException) -> str:
    try:
        return "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()[-1][:500]
    except BaseException:   # noqa: B036  (an exception whose message raises)
        return f"it raised {type(err).__qualname__} while being imported"


# --- a worker ---------------------------------------------------------------------------------------------


class Baseline:
    """The interpreter state a fresh worker starts from (taken in the package root after the import), so that a
    worker kept for the next test is one that still matches it: the grader's tamper snapshot (tests/tamper.py:
    torch, numpy, builtins, ... not replaced), torch's global settings, every signal handler and interval
    timer, and a fingerprint of the package's own modules (each global's identity and, for containers and
    caches, size; classes' and functions' attributes and mutable defaults). A package that caches an answer,
    rebinds a global, patches torch or arms a timer during a test gets a fresh worker for the next one. This is
    the package's own process: the check serves fairness (a package is graded as if each test had a fresh
    worker), not security; what it misses only carries what a file written in one test could carry to the
    next, and every expected answer stays in the grader."""

    def __init__(self, package, snapshot, torch_state, signals, prints):
        self.package, self.snapshot, self.torch_state, self.signals, self.prints = \
            package, snapshot, torch_state, signals, prints

    @classmethod
    def take(cls, package: str | None):
        try:
            import tamper
            snapshot = tamper.Snapshot.take()
            return cls(package, snapshot, _torch_state(), _signals(), _package_prints(package))
        except BaseException:   # noqa: B036  (a package that broke the snapshot: every test gets a fresh worker)
            return None

    def matches(self) -> bool:
        try:
            return self.snapshot.intact() and _torch_state() == self.torch_state and _signals() == self.signals \
                and _package_prints(self.package) == self.prints
        except BaseException:   # noqa: B036
            return False


def _torch_state() -> tuple:
    import torch
    return (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), torch.is_anomaly_enabled(),
            torch.are_deterministic_algorithms_enabled(), str(torch.get_default_device())
            if hasattr(torch, "get_default_device") else None, torch.get_float32_matmul_precision())


def _signals() -> tuple:
    handlers = []
    for sig in sorted(signal.valid_signals()):
        try:
            handlers.append((int(sig), id(signal.getsignal(sig))))
        except (OSError, ValueError):
            pass
    timers = [signal.getitimer(t) for t in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)]
    return tuple(handlers), tuple(timers)


def _size(value):
    """A container's items (their identities, up to SMALL of them) or size, an lru cache's size, else None."""
    if isinstance(value, (dict, list, set, tuple, bytearray)) or type(value).__name__ == "deque":
        if len(value) > SMALL or isinstance(value, bytearray):
            return len(value)
        items = list(value.items()) if isinstance(value, dict) else list(value)
        return tuple(id(x) for item in items for x in (item if isinstance(value, dict) else (item,)))
    info = getattr(value, "cache_info", None)
    if info is not None and callable(info) and type(value).__name__ == "_lru_cache_wrapper":
        return info().currsize
    return None


def _package_prints(package: str | None) -> list:
    """The package's own state: for each of its modules, (name, identity, items) of each global, and the same for
    the attributes of the objects, classes and functions they hold and for functions' defaults (a counter in a
    list cell or an instance's attribute changes it too)."""
    if package is None:
        return []
    import types
    out = []
    for name, module in sorted((n, m) for n, m in list(sys.modules.items())
                               if n == package or n.startswith(package + ".")):
        out.append(name)
        for key, value in list(getattr(module, "__dict__", {}).items()):
            out.append((key, id(value), _size(value)))
            if isinstance(value, types.ModuleType):
                continue
            inner = getattr(value, "__dict__", None)
            if isinstance(inner, dict) or type(inner).__name__ == "mappingproxy":
                out.append(tuple((k, id(v), _size(v)) for k, v in list(inner.items())))
            defaults = getattr(value, "__defaults__", None)
            if type(defaults) is tuple:
                out.append(tuple((id(d), _size(d)) for d in defaults))
    return out


def _worker(control, fd: int, module, options, baseline=None) -> None:
    control.close()
    os.dup2(fd, 3)
    if fd != 3:
        os.close(fd)
    os.closerange(4, 65536)                       # no fd of the grader's beyond the socket
    sock = socket.socket(fileno=3)
    limit = options.get("memory_bytes")
    if limit:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            used = 0
        try:
            resource.setrlimit(resource.RLIMIT_AS, (used + limit, used + limit))
        except (ValueError, OSError):
            pass
    import torch
    torch.set_num_threads(1)       # graded tensors are tiny: a second thread would only wait for a shared core
    out = io.StringIO()
    sys.stdout = sys.stderr = out
    if baseline is not None:                      # this process's own settings (SIGCHLD, threads), before graded code
        baseline.torch_state, baseline.signals = _torch_state(), _signals()
    Worker(sock, module, out, baseline).serve()


class Worker:
    def __init__(self, sock, module, out, baseline=None):
        self.sock, self.module, self.out, self.baseline = sock, module, out, baseline
        self.objects: dict[int, object] = {}
        self.graphs: dict[int, tuple] = {}
        self.rng_before = None

    def serve(self) -> None:
        while True:
            try:
                request = recv(self.sock)
            except OSError:
                os._exit(0)
            if request is None:
                os._exit(0)
            reply = self.answer(request)
            text = self.out.getvalue()
            if text:
                reply["output"] = text[-OUTPUT_LIMIT:]
                self.out.seek(0)
                self.out.truncate()
            try:
                send(self.sock, reply)
            except OSError:
                os._exit(0)

    def answer(self, request) -> dict:
        import torch
        op = request["op"]
        if op == "backward":
            return self.backward(request)
        if op == "reset":
            return self.reset()
        if op == "many":
            return self.many(request)
        if request.get("rng") is not None:            # sent when the grader's state differs from what it last got
            torch.set_rng_state(request["rng"])
        self.rng_before = torch.get_rng_state()
        generators: dict[int, object] = {}
        grads: dict[int, object] = {}
        try:
            if op == "call":
                fn = getattr(self.module, request["name"], None) if self.module is not None else None
                if fn is None:
                    return {"kind": "missing"}
                target = fn
            else:
                obj = self.objects[request["handle"]]
                target = getattr(obj, request["attr"])
                if op == "getattr":
                    if callable(target) and not isinstance(target, (int, float, bool, torch.Tensor)):
                        return {"kind": "callable"}
                    return self.result(target, False, {}, None)
            args = _restore(request["args"], generators, grads)
            kwargs = _restore(request.get("kwargs") or {}, generators, grads)
            watchers = [_watcher(module, qualname) for module, qualname in request.get("watch") or ()]
            value = _under(watchers, target, args, kwargs)
        except BaseException as err:   # noqa: B036  (graded code may raise anything)
            return _error(err)
        reply = self.result(value, request.get("object", False), generators, grads)
        if watchers and reply.get("kind") == "value":
            try:
                reply["watch"] = [encode(w.findings()) for w in watchers]
            except BaseException as err:   # noqa: B036
                return _error(err)
        return reply

    def result(self, value, as_object: bool, generators, grads) -> dict:
        import torch
        rng = torch.get_rng_state()
        reply = {"kind": "value", "rng": None if torch.equal(rng, self.rng_before) else encode(rng),
                 "generators": {slot: encode(g.get_state()) for slot, g in generators.items()}}
        try:
            if as_object:
                handle = len(self.objects) + 1
                self.objects[handle] = value
                reply["value"] = ("o", handle)
                return reply
            outputs: list = []
            reply["value"] = encode(value, outputs if grads else None)
            if outputs:
                graph = len(self.graphs) + 1
                slots = sorted(grads)
                self.graphs[graph] = (outputs, [grads[s] for s in slots])
                reply["graph"] = (graph, slots)
        except BaseException as err:   # noqa: B036
            return _error(err)
        return reply

    def many(self, request) -> dict:
        """The steps of `request["calls"]` (a graded function, a method of a kept object or an attribute read of one,
        each with its arguments), in order, as the grader would make them one by one: the same torch.Generator
        arguments and torch's global RNG carry from each step to the next. The first step that raises (or whose
        result cannot be sent) ends the batch: its reply is "failure", and the random states that come back are
        those from before it (what the grader holds after a failed call), with the results before it. A graded
        function the package does not define is reported before any step runs ("missing")."""
        import torch
        calls = request["calls"]
        for target, _, _, _ in calls:
            if target[0] == "call" and (self.module is None or getattr(self.module, target[1], None) is None):
                return {"kind": "missing"}
        if request.get("rng") is not None:
            torch.set_rng_state(request["rng"])
        rng_start = torch.get_rng_state()
        generators: dict[int, object] = {}
        tensors: dict[int, object] = {}
        values: list = []
        failure = None
        rng, states = rng_start, {}
        for target, args, kwargs, returns in calls:
            try:
                args = _restore(args, generators, {}, tensors)
                kwargs = _restore(kwargs or {}, generators, {}, tensors)
                rng, states = torch.get_rng_state(), {slot: g.get_state() for slot, g in generators.items()}
                value = self.step(target, args, kwargs)
                values.append(encode(value))
            except _Missing:
                failure = {"kind": "missing"}
                break
            except BaseException as err:   # noqa: B036  (graded code may raise anything)
                failure = _error(err)
                break
            if not _takes(value, returns):             # the grader refuses it: the steps after it do not run
                failure = {"kind": "checked"}
                break
        if failure is None or failure["kind"] == "checked":     # the states after the last step that ran
            rng, states = torch.get_rng_state(), {slot: g.get_state() for slot, g in generators.items()}
        return {"kind": "many", "values": values, "failure": failure,
                "rng": None if torch.equal(rng, rng_start) else encode(rng),
                "generators": {slot: encode(state) for slot, state in states.items()}}

    def step(self, target: tuple, args, kwargs):
        """One step of a batch: ("call", name), ("method", handle, attr) or ("getattr", handle, attr)."""
        import torch
        if target[0] == "call":
            fn = getattr(self.module, target[1], None)
            if fn is None:
                raise _Missing
            return fn(*args, **kwargs)
        member = getattr(self.objects[target[1]], target[2])
        if target[0] == "method":
            return member(*args, **kwargs)
        if callable(member) and not isinstance(member, (int, float, bool, torch.Tensor)):
            raise Refused(f"is a method: a step of a script must call it, not read it ({target[2][:100]})")
        return member

    def reset(self) -> dict:
        """The end of a test: drop its objects and graphs (their finalizers run now), then say whether this
        process still matches the state a fresh worker starts from."""
        import gc
        self.objects.clear()
        self.graphs.clear()
        try:
            gc.collect()
        except BaseException:   # noqa: B036  (a finalizer of graded code's objects)
            return {"kind": "reset", "clean": False}
        return {"kind": "reset", "clean": self.baseline is not None and self.baseline.matches()}

    def backward(self, request) -> dict:
        import torch
        outputs, inputs = self.graphs[request["graph"]]
        pairs = [(o, g) for o, g in zip(outputs, request["grads"]) if g is not None]
        try:
            got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
            return {"kind": "value", "value": encode([g.detach() if g is not None else None for g in got])}
        except BaseException as err:   # noqa: B036
            return _error(err)


def _watcher(module: str, qualname: str):
    """A fresh instance of the grader's watcher class (a module of tests/, named by the grader)."""
    import importlib
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj()


def _under(watchers: list, target, args, kwargs):
    if not watchers:
        return target(*args, **kwargs)
    with watchers[0]:
        return _under(watchers[1:], target, args, kwargs)


_LEAVES = frozenset((int, float, bool, str, bytes, type(None)))


def _restore(value, generators: dict, grads: dict, tensors: dict | None = None):
    """The test's arguments as graded code sees them (generators rebuilt, grad leaves marked); each use of a tensor
    is a tensor of its own (`tensors`: those a batch made already, copied again at each use)."""
    kind = type(value)
    if kind in _LEAVES:
        return value
    if kind is TensorArg:
        if tensors is None:
            return value.tensor()
        made = tensors.get(id(value))
        if made is None:
            made = tensors[id(value)] = (value, value.tensor())      # the TensorArg is kept alive with its id
        return made[1].clone()
    if kind is tuple or kind is list:
        return kind([_restore(v, generators, grads, tensors) for v in value])
    if kind is GeneratorArg:
        if value.slot in generators:             # the same generator again (in this call or an earlier one of a batch)
            return generators[value.slot]
        import torch
        g = torch.Generator(device=value.device)
        g.set_state(torch.frombuffer(bytearray(value.state), dtype=torch.uint8))
        generators[value.slot] = g
        return g
    if kind is GradArg:
        t = value.tensor.requires_grad_()
        grads[value.slot] = t
        return t
    if kind is dict:
        return {k: _restore(v, generators, grads, tensors) for k, v in value.items()}
    return value


def _takes(value, returns) -> bool:
    """Whether the grader's check of a result (tests/guard.py, run again there on what it decodes) takes `value`."""
    try:
        guard = sys.modules.get("guard") or __import__("guard")
        guard.check("a step", value, returns)
    except BaseException:   # noqa: B036  (a result whose checks raise anything: the grader's check decides)
        return False
    return True


class _Missing(Exception):
    """A graded function a step of a batch names is gone from the package."""


class Refused(Exception):
    """A result the grader cannot take (the message says why, in the grader's words)."""


def _error(err: BaseException) -> dict:
    kind = type(err)
    if isinstance(err, (SystemExit, KeyboardInterrupt, GeneratorExit)) or kind.__name__ in CONTROL_FLOW \
            or not isinstance(err, Exception):
        return {"kind": "control", "type": kind.__name__[:100]}
    if isinstance(err, Refused):
        return {"kind": "refused", "message": str(err)}
    try:
        text = str(err)[:2000]
    except BaseException:   # noqa: B036  (a __str__ that raises)
        text = "<its message could not be printed>"
    where = None
    if isinstance(err, NotImplementedError):
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            code = tb.tb_frame.f_code
            where = getattr(code, "co_qualname", code.co_name).replace(".__init__", "")
    try:
        trace = "".join(traceback.format_exception(kind, err, err.__traceback__))[-3000:]
    except BaseException:   # noqa: B036
        trace = ""
    return {"kind": "error", "bases": [c.__name__ for c in kind.__mro__ if c.__module__ == "builtins"],
            "type": kind.__qualname__[:200], "builtin": kind.__module__ == "builtins", "message": text,
            "not_implemented": where, "traceback": trace}


# --- results as plain data ----------------------------------------------------------------------------------


def _kind(value) -> str:
    kind = type(value)
    if kind in (int, float, bool, str) or value is None:
        return f"{kind.__name__} {value!r:.60}"
    return f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else f"a {kind.__name__}"


def encode(value, outputs: list | None = None, depth: int = 0):
    """value as nested tagged tuples of plain Python data (see tests/sandbox.py's `decode`)."""
    import torch
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return ("v", value)
    if kind is torch.Tensor:
        t = value.detach()
        if t.layout != torch.strided:
            raise Refused(f"returned a {t.layout} tensor; return a dense (strided) torch.Tensor")
        t = t.cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        slot = None
        if outputs is not None and value.requires_grad:
            slot = len(outputs)
            outputs.append(value)
        return ("T", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw, slot)
    if isinstance(value, torch.Tensor):
        raise Refused(f"returned a torch.Tensor subclass ({kind.__qualname__}); return a plain torch.Tensor")
    if depth >= MAX_DEPTH and kind in (list, tuple, dict):
        raise Refused(f"returned lists or dicts nested deeper than {MAX_DEPTH}")
    if kind in (list, tuple):
        return ("l" if kind is list else "t", [encode(v, outputs, depth + 1) for v in value])
    if kind is dict:
        items = []
        for k, v in value.items():
            if type(k) not in (str, int):
                raise Refused(f"returned a dict with a {_kind(k)} key; use str keys")
            items.append((k, encode(v, outputs, depth + 1)))
        return ("d", items)
    sympy = sys.modules.get("sympy")
    if sympy is not None and isinstance(value, sympy.Basic):
        return ("S", _sympy(value, sympy, [0]))
    if kind.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        item = value.item()
        if type(item) in (bool, int, float):
            return ("v", item)
    raise Refused(f"returned {_kind(value)}; return plain tensors, numbers, lists, tuples and dicts")


def _sympy(expr, sympy, count: list):
    count[0] += 1
    if count[0] > MAX_NODES:
        raise Refused(f"returned a sympy expression of more than {MAX_NODES} nodes")
    name = type(expr).__name__
    if isinstance(expr, sympy.Symbol):
        return ("Symbol", expr.name, {k: v for k, v in expr.assumptions0.items() if type(v) is bool and type(k) is str})
    if isinstance(expr, sympy.Integer):
        return ("Integer", int(expr.p))
    if isinstance(expr, sympy.Rational):
        return ("Rational", int(expr.p), int(expr.q))
    if isinstance(expr, sympy.Float):
        return ("Float", str(expr), int(expr._prec))
    return (name, [_sympy(a, sympy, count) for a in expr.args])


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import sandbox_worker   # the classes pickled by the grader live in the module of this name
    sandbox_worker.main()
