"""Graded code runs in processes of its own: the grader's process never imports a student's package.

With `--impl`, every graded call of tests/adapters.py goes through `call`: the arguments are pickled to a
worker process (tests/sandbox_worker.py), which calls the student's function and sends back plain data;
`decode` turns that into tensors, numbers, lists, tuples, dicts and sympy expressions without running any
code it was sent (no pickle from the worker is ever loaded), and tests/guard.py checks the kind the adapter
asked for. Comparisons, points and results.json stay in this process.

The processes: a *supervisor* spawned once per grader process, as conftest.py starts (tests/sandbox_start.py,
before the grader imports torch, so that its imports overlap the grader's; else when pytest is configured,
`prestart`; `python -I`, its own argv and an environment without the grader's options: it never learns
where results.json goes) imports torch and the library and is
the child subreaper of everything below it; per grading run it forks a *package root* (a new session) that
imports the package once; the root forks a *worker* with only the socket the grader gave it (and /dev/null)
open and its address space limited. A reply has until the test's deadline (`--graded-timeout` from the
start of the test): a worker that does not answer is killed and the test fails as timed out, so a run ends
within (tests x timeout + a margin) whatever the package does. When the run ends, every process of the
package's goes (a double fork or a new session does not escape: orphans are re-parented to the supervisor).

A worker serves test after test (forking one costs more than most graded tests), and is replaced, with every process
below the supervisor but the package root killed, before the next test whenever anything went wrong in this one: a
graded call was missing, timed out, crashed, broke the protocol or returned what the grader refused (graded code
that raised an exception, as a package refusing bad input does, answered by the protocol: its worker is judged by
its reset like any other); or, at the end of the test (the "reset" is sent as the call phase ends where no code of
the test runs after it, and its reply read at the next test's first graded call or call phase, so the worker's check
overlaps the grader's report of this test and its setup of the next), the worker does not answer "reset" in time,
reports that its interpreter no longer matches the state a fresh worker starts from (tests/sandbox_worker.py
`Baseline`: torch patched, a global rebound, a cache grown, a timer armed, ...), has more than its one thread, or a
process it started (a child, a detached grandchild re-parented to the supervisor or the grader, a second child of
the package root) is alive (`_alone`, read from /proc, which graded code cannot forge). The decision never depends
on the grader's verdict: a worker kept or replaced learns nothing about its score. A kept worker carries nothing to
the next test that a fresh one could not read from a file written during this one (the package's processes share the
user's files), and no graded call is ever sent an expected answer.

Per test a worker keeps what graded calls returned as objects (`RemoteObject`: attribute reads and method
calls are graded calls of their own) and the autograd graphs of results that need gradients (their backward
runs in the worker, `_RemoteGrad`). torch's global RNG state and the state of every torch.Generator argument
travel with each call and come back, so graded code draws exactly the numbers it would draw in-process.

A test that makes thousands of graded calls whose arguments it knows in advance sends them in one message
(`script`, through tests/adapters.py `script` and `each`: calls of graded functions, methods of graded objects and
attribute reads of them, mixed): the worker makes them in order, exactly as one by one (the same generators and
torch's RNG carried from call to call; each result decoded and checked here on its own) and stops at the first that
raises, whose exception the test gets, with the random states from before that call, or whose result the grader
refuses. One round trip instead of thousands is what keeps the --impl run near the in-process one; so does a worker
forked for the next test as soon as one is replaced, and a grader whose heap (torch, pytest, the collected tests) the
garbage collector no longer scans once the package is imported (tests/grading.py).
"""

from __future__ import annotations

__mutable__ = ("_supervisor", "_RAISED_BY_GRADED_CODE")   # bookkeeping tests/tamper.py skips

import atexit
import builtins
import functools
import os
import pickle
import signal
import socket
import time

import torch

import guard
import sandbox_start
import sandbox_worker
from sandbox_worker import HEADER, GeneratorArg, GradArg, TensorArg

MAX_MESSAGE = 1 << 28                   # bytes of one reply
START_TIMEOUT = 120.0                   # seconds the supervisor may take to import torch and the library
MEMORY_BYTES = 8 << 30                  # address space a worker may add to what it starts with
KILL_ROUNDS = 50
RESET_GRACE = 1.0                       # seconds a "reset" read after its test ended may still take


class SandboxError(RuntimeError):
    """The sandbox itself failed (the supervisor could not start): a problem of the grader, not the package."""


class WorkerGone(AssertionError):
    """The worker ended (exited, crashed, was killed) or broke the protocol during a graded call."""


_supervisor: Supervisor | None = None


# --- the supervisor (trusted: runs no student code) -----------------------------------------------------------


class Supervisor:
    def __init__(self):
        self.proc, self.sock = sandbox_start.take_early() or sandbox_start.spawn()   # started by conftest.py?
        self.sock.settimeout(START_TIMEOUT)
        self.ready = False

    def wait_ready(self) -> None:
        """Until the supervisor has imported torch and the library (it is started without waiting for that)."""
        if self.ready:
            return
        ready = _recv(self.sock, time.monotonic() + START_TIMEOUT, "the sandbox's supervisor")
        if not isinstance(ready, dict) or ready.get("ready") != self.proc.pid:
            raise SandboxError(f"the sandbox's supervisor did not start: {ready!r}")
        self.ready = True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork_package_root(self, request: dict) -> tuple[int, socket.socket]:
        ours, theirs = socket.socketpair()
        try:
            self.sock.settimeout(START_TIMEOUT)
            socket.send_fds(self.sock, [pickle.dumps(request)], [theirs.fileno()])
            reply = restricted_loads(self.sock.recv(1 << 16))
        finally:
            theirs.close()
        return reply["pid"], ours

    def stop(self) -> None:
        kill_tree(self.pid, keep=())
        try:
            self.sock.close()
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()


def supervisor() -> Supervisor:
    """The supervisor of this grader process (started on first use or by `prestart`, reused by every run in the
    process), ready to fork a package root."""
    global _supervisor
    if _supervisor is None or not _supervisor.alive():
        _supervisor = Supervisor()
    _supervisor.wait_ready()
    return _supervisor


def prestart() -> None:
    """Start the supervisor without waiting for it: its imports (seconds) overlap the grader's collection. It
    learns nothing it would not learn later (its argv, environment and setup are the same) and runs no
    student code; `supervisor()` waits for it when the package is imported."""
    global _supervisor
    if _supervisor is None or not _supervisor.alive():
        _supervisor = Supervisor()


@atexit.register
def _stop_supervisor() -> None:
    if _supervisor is not None:
        _supervisor.stop()


# --- processes ------------------------------------------------------------------------------------------------


def _children() -> tuple[dict[int, list[int]], set[int]]:
    """(ppid -> pids, the pids that are zombies), from /proc (Linux)."""
    tree: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        pid = int(entry.name)
        tree.setdefault(int(fields[1]), []).append(pid)
        if fields[0] == b"Z":
            zombies.add(pid)
    return tree, zombies


def _below(tree: dict[int, list[int]], pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in tree.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (zombies are dead already)."""
    if not os.path.isdir("/proc"):
        return []
    tree, zombies = _children()
    return [p for p in _below(tree, pid) if p not in zombies]


def kill_tree(root: int, keep: tuple[int, ...] = ()) -> None:
    """SIGKILL every live descendant of `root` but the pids in `keep` (their own descendants are not spared), and
    what graded code left re-parented to the grader (`sweep_orphans`), until none is left (a process that forks
    while this runs is caught on the next round)."""
    if not os.path.isdir("/proc"):
        return
    me = os.getpid()
    for _ in range(KILL_ROUNDS):
        tree, zombies = _children()
        victims = [p for p in _below(tree, root) if p not in keep and p not in zombies]
        orphans = [] if _own_children is None else [
            p for p in tree.get(me, ()) if p not in _own_children and p != root
            and (_supervisor is None or p != _supervisor.pid)]
        for orphan in orphans:
            victims += [orphan] + [p for p in _below(tree, orphan) if p not in zombies]
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for orphan in orphans:                 # the grader's children now: reap them
            try:
                os.waitpid(orphan, 0)
            except OSError:
                pass
        time.sleep(0.002)


# The grader is a child subreaper too (Linux), as a backup: if graded code kills the supervisor, the processes
# below it are re-parented here instead of to init, and `sweep_orphans` kills them. The grader's own children
# from before (servers of other tests, ...) are left alone.
_own_children: set[int] | None = None


def become_subreaper() -> None:
    """At the start of a run (the previous run's orphans are already swept): the grader's children now are its
    own (started by the grader or by other tests of the same session), never swept."""
    global _own_children
    if not os.path.isdir("/proc"):
        return
    try:
        import ctypes
        ctypes.CDLL(None).prctl(sandbox_worker.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return
    _own_children = set(_children()[0].get(os.getpid(), ()))


def sweep_orphans() -> None:
    """Kill (and reap) what graded code left re-parented to the grader: its children that are neither the
    supervisor nor children it had before the run."""
    if _supervisor is not None and _supervisor.alive():
        kill_tree(_supervisor.pid, keep=tuple(descendants(_supervisor.pid)))   # the orphans only
    else:
        kill_tree(-1)


# --- one grading run ----------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[bytes, int] | None:
    """(state, ppid) of `pid` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0], int(fields[1])


def _last_pid() -> int | None:
    """The pid allocated last in this pid namespace (Linux), or None where that cannot be read."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _is_child(pid: int, parent: int) -> bool:
    """`pid` is a live child of `parent` (one read of /proc; elsewhere: assume so)."""
    if not os.path.isdir("/proc"):
        return True
    stat = _stat(pid)
    return stat is not None and stat[0] != b"Z" and stat[1] == parent


class Sandbox:
    """The package root of one grading run and the worker of the graded test in progress."""

    def __init__(self, request: dict, timeout: float, memory_bytes: int = MEMORY_BYTES):
        self.package, self.timeout, self.memory_bytes = request, timeout, memory_bytes
        self.root: int | None = None
        self.control: socket.socket | None = None
        self.worker: socket.socket | None = None
        self.generation = 0                  # bumped each time a worker is started (handles name theirs)
        self.deadline = float("inf")
        self.failure: str | None = None      # why the test in progress must fail, whatever it caught
        self.output: list[str] = []          # what graded code printed during the test in progress
        self.rng_known = None                # torch's RNG state the worker holds (after its last reply)
        self.dirty = False                   # the worker must be replaced before the next test
        self.floor = -1                      # every pid above it was allocated after the last check of the worker
        self.worker_pid: int | None = None   # found in /proc (a child of the package root), not told by the worker
        self.workers_started = 0
        self.reset_sent: float | None = None  # the deadline of a "reset" sent ahead (`send_reset`), reply not read
        self.settle_pending = False           # the test ended with that reply unread: `settle` reads it

    # the package --------------------------------------------------------------------------------------------

    def start(self) -> str | None:
        """Fork the package root and import the package there; None, or why it could not be imported."""
        become_subreaper()
        self._kill_all()
        sup = supervisor()
        self.root, self.control = sup.fork_package_root(self.package)
        try:
            report = _recv(self.control, self._deadline(), "importing it")
        except TimeoutError:
            self._kill_all()
            return f"timed out after {self.timeout:g} s while being imported"
        except (WorkerGone, OSError, pickle.UnpicklingError, EOFError, ValueError) as err:
            self._kill_all()
            return str(err)
        if type(report) is not dict or report.get("imported") is not True:
            error = report.get("error") if type(report) is dict else None
            self._kill_all()
            return error if type(error) is str else "the package root sent no report"
        return None

    def stop(self) -> None:
        """The end of the run: every process of the package's."""
        self._kill_all()
        self.deadline = float("inf")

    def _kill_all(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.reset_sent, self.settle_pending = None, False
        if self.root is not None and _supervisor is not None:
            kill_tree(_supervisor.pid, keep=())
        else:
            sweep_orphans()
        if self.control is not None:
            self.control.close()
        self.root = self.control = None

    # tests --------------------------------------------------------------------------------------------------

    def rng_to_send(self):
        """torch's global RNG state for the worker, or None when the worker already has it (it keeps the state it
        returned last; a new worker starts from nothing it could have)."""
        state = torch.get_rng_state()
        if self.worker is not None and self.rng_known is not None and torch.equal(state, self.rng_known):
            return None
        return state

    def _deadline(self) -> float:
        """The test's deadline (a graded call outside a graded test gets the timeout from now)."""
        return min(self.deadline, time.monotonic() + self.timeout)

    def begin_test(self) -> None:
        # before the test's clock starts: restarting (seconds of imports on a busy machine) is the grader's time;
        # charged to this test, it would fail one the package answers well (the SIGALRM backstop does not wait). The
        # last test's end (its worker kept or replaced) is settled later, when this test first needs the worker
        # (`settle`), and not charged to it either.
        self._bring_back()
        self.deadline = time.monotonic() + self.timeout
        self.failure, self.output, self.dirty = None, [], False
        self.rng_known = None                # the first call of every test sends torch's RNG state
        self.generation += 1                 # objects and graphs of earlier tests are gone

    def _package_alive(self) -> bool:
        sup = _supervisor
        return (sup is not None and sup.alive() and self.root is not None and self.control is not None
                and _is_child(self.root, sup.pid))

    def _bring_back(self) -> str | None:
        """A supervisor or package root that graded code killed comes back: what was below it (re-parented to the
        grader) is killed, a supervisor is started and the package imported again. None, or why it could not be."""
        if self._package_alive():
            return None
        self._kill_all()
        supervisor()
        return self.start()

    def end_test(self) -> None:
        """Keep the worker for the next test if nothing went wrong in this one (see the module's docstring);
        otherwise kill it and everything it started (the package root stays). Where the "reset" was sent ahead,
        its reply is read later, by `settle` at the next test's first graded call or call phase: the worker checks
        itself while the grader reports this test and sets up the next."""
        if self.worker is not None and not self.dirty and self.failure is None and self.reset_sent is not None:
            self.settle_pending, self.deadline = True, float("inf")
            return
        self._decide(self.worker is not None and not self.dirty and self.failure is None and self._reusable())

    def settle(self) -> None:
        """The end of the last test, if `end_test` left its "reset" reply unread: keep the worker or replace it. Read
        at the first graded call of the next test (its fixtures') or as its call phase begins (tests/grading.py),
        whichever comes first. The time it takes is not that test's: its deadline moves by as much, and whatever
        goes wrong with the old worker (no reply in time, a broken protocol) replaces it without failing this test."""
        if not self.settle_pending:
            return
        self.settle_pending = False
        deadline, failure, started = self.deadline, self.failure, time.monotonic()
        self.deadline = float("inf")               # `_reset_reply` then allows RESET_GRACE from now
        try:
            self._decide(self.worker is not None and self._reusable())
        finally:
            self.failure, self.deadline = failure, deadline + (time.monotonic() - started)

    def _decide(self, keep: bool) -> None:
        self.deadline = float("inf")
        if not keep:
            replaced = self.worker is not None
            self._replace_worker()
            if replaced:
                self._prefork()

    def _prefork(self) -> None:
        """Start the next test's worker now (a fork of the package root, which learns nothing from the test that
        ended), so that it is ready while the grader finishes this test and sets up the next one. A package that
        cannot start one is brought back, or reported, at the next graded call as usual."""
        if not self._package_alive():
            return
        self.deadline = time.monotonic() + self.timeout
        try:
            self._worker()
        except BaseException:   # noqa: B036  (already killed; the next graded call starts one)
            pass
        self.failure, self.deadline = None, float("inf")

    def send_reset(self) -> None:
        """The end of a test's call phase when nothing of the test runs after it (tests/grading.py: no fixture
        of its own): "reset" is sent now, so the worker checks itself while the grader compares its own
        interpreter; `end_test` reads the reply. Sent only where end_test would send it (a worker that did
        nothing wrong), with the same deadline."""
        if self.worker is None or self.dirty or self.failure is not None or self.reset_sent is not None:
            return
        deadline = self._deadline()
        try:
            self.worker.settimeout(max(0.001, deadline - time.monotonic()))
            _send(self.worker, {"op": "reset"})
        except OSError:
            self.dirty = True                 # end_test replaces it
            return
        self.reset_sent = deadline

    def _reset_reply(self):
        """The reply to the "reset" sent ahead (the same errors as `request`'s), by the test's deadline or, read after
        the test ended, within RESET_GRACE seconds of now."""
        deadline, self.reset_sent = self.reset_sent, None
        if self.deadline == float("inf"):           # read by `settle`, after the test ended
            deadline = max(deadline, time.monotonic() + RESET_GRACE)
        try:
            reply = _recv(self.worker, deadline, "reset")
        except (TimeoutError, guard.GradedTimeout):
            raise self._fail(f"timed out after {self.timeout:g} s in reset", timeout=True) from None
        except (OSError, WorkerGone, pickle.UnpicklingError, EOFError, ValueError) as err:
            raise self._fail(f"reset ended the process it ran in, or broke its protocol ({err})") from None
        return reply

    def _reusable(self) -> bool:
        sup = _supervisor
        if sup is None or not sup.alive() or self.root is None or not _is_child(self.root, sup.pid):
            return False
        try:
            reply = self._reset_reply() if self.reset_sent is not None else self.request("reset", {"op": "reset"})
        except BaseException:   # noqa: B036  (timed out, ended, broke the protocol: already killed)
            return False
        return type(reply) is dict and reply.get("kind") == "reset" and reply.get("clean") is True and self._alone()

    def _alone(self) -> bool:
        """The worker is alive, has one thread, and no process it may have started exists: every pid allocated
        since the last check is read from /proc (a pid counter that wrapped around: every pid)."""
        if not os.path.isdir("/proc"):
            return False
        last = _last_pid()
        floor = self.floor if last is not None and last >= self.floor else -1
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) > floor:
                stat = _stat(int(name))
                if stat is not None and stat[0] != b"Z":
                    stats[int(name)] = stat[1]
        sup, root, me = _supervisor.pid, self.root, os.getpid()
        if self.worker_pid is None:
            found = [pid for pid, ppid in stats.items() if ppid == root]
            if len(found) != 1:
                return False
            self.worker_pid = found[0]
        worker = self.worker_pid
        stat = _stat(worker)
        if stat is None or stat[0] == b"Z" or stat[1] != root:
            return False
        own = _own_children or set()
        for pid, ppid in stats.items():
            if pid != worker and (ppid in (worker, root, sup) or (ppid == me and pid not in own and pid != sup)):
                return False
        try:
            with open(f"/proc/{worker}/status", "rb") as f:
                threads = next(line for line in f if line.startswith(b"Threads:"))
        except (OSError, StopIteration):
            return False
        if int(threads.split()[1]) != 1:
            return False
        self.floor = last if last is not None else -1
        return True

    def _replace_worker(self) -> None:
        """Kill the worker and everything it started (the package root stays)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.reset_sent, self.settle_pending = None, False
        if _supervisor is not None and self.root is not None:
            kill_tree(_supervisor.pid, keep=(self.root,))      # and the orphans re-parented to the grader
        else:
            sweep_orphans()
        self.deadline = float("inf")

    def _fail(self, message: str, timeout: bool = False):
        self.failure = message
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.reset_sent, self.settle_pending = None, False
        if _supervisor is not None:
            kill_tree(_supervisor.pid, keep=(self.root,) if self.root is not None else ())
        return (guard.GradedTimeout if timeout else WorkerGone)(message)

    def _worker(self) -> socket.socket:
        if self.worker is not None:
            return self.worker
        if not self._package_alive():          # killed during this test (begin_test brings them back between tests)
            error = self._bring_back()
            if error is not None:
                raise self._fail(f"cannot import the implementation again: {error}")
        last = _last_pid()
        self.floor, self.worker_pid = (last if last is not None else -1), None
        ours, theirs = socket.socketpair()
        try:
            self.control.settimeout(max(0.001, self._deadline() - time.monotonic()))
            socket.send_fds(self.control, [pickle.dumps({"memory_bytes": self.memory_bytes,
                                                         "num_threads": torch.get_num_threads()})],
                            [theirs.fileno()])
        except OSError as err:
            ours.close()
            raise self._fail(f"the package's process did not start a worker ({err})") from None
        finally:
            theirs.close()
        self.worker, self.generation, self.reset_sent = ours, self.generation + 1, None
        self.workers_started += 1
        return ours

    def request(self, name: str, message: dict):
        """Send one request, wait for its reply until the test's deadline, decode it."""
        if self.failure is not None:
            raise WorkerGone(f"not run: {self.failure}")
        self.settle()                          # the first graded call of a test (or one outside a test, after one)
        if self.reset_sent is not None:        # a call after the test's call phase (send_reset said none comes)
            self._reset_reply()
            self.dirty = True                  # its objects are gone: replaced after this test
        sock = self._worker()
        deadline = self._deadline()
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            _send(sock, message)
            reply = _recv(sock, deadline, name)
        except (TimeoutError, guard.GradedTimeout):     # the deadline, or the grader's SIGALRM backstop
            raise self._fail(f"timed out after {self.timeout:g} s in {name}", timeout=True) from None
        except (OSError, WorkerGone, pickle.UnpicklingError, EOFError, ValueError) as err:
            raise self._fail(f"{name} ended the process it ran in, or broke its protocol ({err}); graded code "
                             f"must not exit, kill or write to the grader's channel") from None
        if type(reply) is not dict:
            raise self._fail(f"{name}: the worker sent {type(reply).__name__}, not a reply")
        if type(reply.get("output")) is str:
            self.output.append(reply["output"][-sandbox_worker.OUTPUT_LIMIT:])
        return reply


def _send(sock, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(HEADER.pack(len(data)) + data)


def _recv(sock, deadline: float, what: str):
    """One reply, read until `deadline` (TimeoutError) and loaded without running code."""
    header = _exactly(sock, HEADER.size, deadline, what)
    size = HEADER.unpack(header)[0]
    if size > MAX_MESSAGE:
        raise WorkerGone(f"{what}: a reply of {size} bytes (at most {MAX_MESSAGE})")
    return restricted_loads(_exactly(sock, size, deadline, what))


def _exactly(sock, n: int, deadline: float, what: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(what)
        sock.settimeout(remaining)
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise WorkerGone(f"the process ended while {what} ran")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the worker sent a {module}.{name}; only plain data is accepted")


def restricted_loads(data: bytes):
    """Lists, tuples, dicts, str, bytes, numbers, None: a pickle that names any class or function is refused."""
    import io
    return _NoClasses(io.BytesIO(data)).load()


# --- the parent's side of a graded call -------------------------------------------------------------------------

_active: Sandbox | None = None


def activate(sandbox: Sandbox | None) -> None:
    global _active
    _active = sandbox


def active() -> Sandbox | None:
    return _active


_watchers: list = []


class watching:
    """Graded calls inside this context run under a fresh instance of the watcher's class in the worker; its
    findings come back after each call and are merged into `watcher` (yielded)."""

    def __init__(self, watcher):
        self.watcher = watcher

    def __enter__(self):
        _watchers.append(self.watcher)
        return self.watcher

    def __exit__(self, *exc):
        _watchers.remove(self.watcher)
        return False


def _watch_request() -> list:
    return [(type(w).__module__, type(w).__qualname__) for w in _watchers]


def _merge_findings(name: str, reply: dict, watchers: list) -> None:
    found = reply.get("watch")
    if not watchers:
        return
    if type(found) is not list or len(found) != len(watchers):
        raise guard.GradedCallError(f"{name}: the worker did not report what the grader watched")
    for watcher, findings in zip(watchers, found):
        watcher.merge(decode(name, findings))


# The exceptions graded code raised in the worker (an "error" reply, rebuilt here by `_outcome`), by id while they
# propagate: such a worker answered by the protocol and is kept for the next test if its reset finds it clean, as after
# any other test (a package that refuses bad input on purpose is not charged a new worker). Every other failure (a
# refusal, a timeout, a broken protocol, a control-flow exception) has the worker replaced after the test.
_RAISED_BY_GRADED_CODE: dict[int, BaseException] = {}


def _after_failure(sandbox: Sandbox, err: BaseException) -> None:
    if _RAISED_BY_GRADED_CODE.pop(id(err), None) is not err:
        sandbox.dirty = True


def call(name: str, args: tuple, kwargs: dict | None = None, returns="any", handle=None, attr=None):
    """The graded call `name` in the worker; its result decoded and checked against `returns`. Anything but a
    result the grader takes (a refusal, a timeout, a broken protocol; not an exception graded code raised, see
    `_after_failure`) marks the worker to be replaced after the test."""
    sandbox = _active
    if sandbox is None:
        raise SandboxError("no sandbox is active (graded calls with --impl run only inside a graded test)")
    if _collecting is not None:                     # `script` gathers the calls, to make them in one message
        step = _Deferred("call" if handle is None else "method", name, args, kwargs, returns, handle, attr)
        _collecting.append(step)
        return step
    try:
        return _call(sandbox, name, args, kwargs, returns, handle, attr)
    except BaseException as err:
        _after_failure(sandbox, err)
        raise


def _call(sandbox: Sandbox, name: str, args: tuple, kwargs: dict | None, returns, handle, attr):
    generators: list = []
    grad_inputs: list = []
    sent: dict = {}
    message = {"op": "call" if handle is None else "method", "name": name, "handle": handle, "attr": attr,
               "args": _prepare(args, generators, grad_inputs, sent=sent),
               "kwargs": _prepare(kwargs or {}, generators, grad_inputs, sent=sent),
               "object": isinstance(returns, dict), "rng": sandbox.rng_to_send(), "watch": _watch_request()}
    watchers = list(_watchers)
    guard._calls.append(name)
    try:
        reply = sandbox.request(name, message)
    finally:
        guard._calls.pop()
    value = _outcome(name, reply, sandbox)
    _merge_findings(name, reply, watchers)
    _restore_rng(name, reply, generators)
    if isinstance(returns, dict):
        if value != ("o", value[1] if type(value) is tuple and len(value) == 2 else None):
            raise guard.GradedCallError(f"{name}: the worker did not keep the object it returned")
        return RemoteObject(name, sandbox, sandbox.generation, value[1], returns)
    graph = reply.get("graph")
    if graph is not None:
        return guard.check(name, _attach_graph(name, sandbox, value, graph, grad_inputs), returns)
    return guard.check(name, decode(name, value), returns)


# --- many graded calls in one message ---------------------------------------------------------------------------

_collecting: list | None = None     # the graded steps `script` is gathering (None: every call runs at once)


class _Deferred:
    """A graded call, or an attribute read of a graded object, gathered by `script`: what the step gets back
    meanwhile and must return as it is. A read that is then called becomes a call of that method."""

    __slots__ = ("op", "name", "args", "kwargs", "returns", "handle", "attr")

    def __init__(self, op: str, name: str, args, kwargs, returns, handle, attr):
        self.op, self.name, self.args, self.kwargs = op, name, args, kwargs
        self.returns, self.handle, self.attr = returns, handle, attr

    def __call__(self, *args, **kwargs):
        if self.op != "getattr":
            raise TypeError("script(steps): a step called what a graded call returned (results are known only "
                            "after the whole script)")
        self.op, self.args, self.kwargs = "method", args, kwargs
        return self

    def target(self) -> tuple:
        return ("call", self.name) if self.op == "call" else (self.op, self.handle, self.attr)

    def __repr__(self) -> str:
        return "<a graded call gathered by script(); its result is not known yet>"


def script(steps) -> list:
    """[step() for step in steps], where each step makes exactly one graded call (a graded function, a method of a
    graded object) or reads one attribute of a graded object, and returns its result as it is; its arguments must
    not depend on the results of the other steps (they are all known before the first runs). The steps travel to
    the worker in one message and run there in order (`_call_script`), exactly as they would one by one: the same
    generators and torch's RNG carried from step to step, each result decoded and checked here on its own, and the
    first step that raises ends the script with that exception and the random states from before it (one whose
    result the grader refuses ends it too: the worker runs the same check first, so no later step runs). A script
    that cannot go as one message (a watched call, a step that returns an object or takes tensors that need
    gradients, a package that defines a name only under a former one) runs one step at a time."""
    global _collecting
    steps = list(steps)
    if _collecting is not None:
        raise TypeError("script(steps): a step must make one graded call, not run a script of its own")
    gathered, results = [], []
    _collecting = gathered
    try:
        for step in steps:
            results.append(step())
    finally:
        _collecting = None
    if len(gathered) != len(steps) or any(r is not g for r, g in zip(results, gathered)):
        raise TypeError("script(steps): every step must make exactly one graded call (or read one attribute of a "
                        "graded object) and return its result unchanged")
    if not gathered:
        return []
    sandbox = _active
    if sandbox is None:
        raise SandboxError("no sandbox is active (graded calls with --impl run only inside a graded test)")
    if _watchers or any(isinstance(g.returns, dict) for g in gathered):
        return [step() for step in steps]
    try:
        out = _call_script(sandbox, gathered)
    except BaseException as err:
        _after_failure(sandbox, err)
        raise
    return [step() for step in steps] if out is None else out


def each(fn, calls) -> list:
    """[fn(*args) for args in calls] as one `script`: each fn(*args) makes one graded call (an adapter such as
    run_speculative_accept, a graded object's method) and returns its result as it is."""
    return script([functools.partial(fn, *args) for args in calls])


def _call_script(sandbox: Sandbox, steps: list) -> list | None:
    """The gathered steps in one round trip to the worker; None where they must go one by one instead (tensors that
    need gradients; a graded function the package does not define: the adapter may find it under a former name,
    and the steps before it run as they would)."""
    generators: list = []
    grad_inputs: list = []
    sent: dict = {}
    calls = [(step.target(), _prepare(step.args or (), generators, grad_inputs, sent=sent),
              _prepare(step.kwargs or {}, generators, grad_inputs, sent=sent), step.returns) for step in steps]
    if grad_inputs:
        return None
    names = list(dict.fromkeys(step.name for step in steps))
    label = names[0] if len(names) == 1 else f"a script of {len(steps)} graded calls ({', '.join(names[:4])}" \
        f"{', ...' if len(names) > 4 else ''})"
    guard._calls.append(label)
    try:
        reply = sandbox.request(label, {"op": "many", "calls": calls, "rng": sandbox.rng_to_send()})
    finally:
        guard._calls.pop()
    if reply.get("kind") == "missing":
        return None
    if reply.get("kind") != "many":
        _outcome(label, reply, sandbox, by_protocol=False)   # a value (or an error) here breaks the protocol
        raise sandbox._fail(f"{label}: the worker answered a batch of calls with a single reply")
    values, failure = reply.get("values"), reply.get("failure")
    checked = type(failure) is dict and failure.get("kind") == "checked"     # the last value is one to refuse
    if type(values) is not list or (failure is not None and type(failure) is not dict) \
            or not (len(values) == len(steps) if failure is None else 0 < len(values) <= len(steps) if checked
                    else len(values) < len(steps)):
        raise sandbox._fail(f"{label}: the worker sent a malformed reply to a batch of calls")
    _restore_rng(label, reply, generators)
    if failure is not None and not checked:
        sandbox.rng_known = None             # the failed call may have drawn numbers: send the state again next time
    out = [guard.check(step.name, decode(step.name, value), step.returns) for step, value in zip(steps, values)]
    if checked:
        raise sandbox._fail(f"{label}: the worker stopped a batch of calls at a result the grader takes")
    if failure is not None:
        failed = steps[len(values)].name
        _outcome(failed, failure, sandbox)
        raise sandbox._fail(f"{failed}: the worker reported a failure of kind {_text(failure.get('kind'), 60)!r} "
                            f"in a batch of calls")
    return out


_LEAVES = frozenset((int, float, bool, str, bytes, type(None)))     # sent as they are


def _prepare(value, generators: list, grad_inputs: list, depth: int = 0, sent: dict | None = None):
    """The test's arguments, ready to pickle: generators as their state, tensors that need grad marked. A generator
    passed twice (in one call, or in several calls of a batch: `sent` remembers them) is one generator there too."""
    kind = type(value)
    if kind in _LEAVES:                      # the common cases first, by exact type (a batch prepares thousands)
        return value
    sent = {} if sent is None else sent
    if kind is tuple or kind is list:
        if depth >= guard.MAX_DEPTH:
            return value
        return kind([_prepare(v, generators, grad_inputs, depth + 1, sent) for v in value])
    if kind is torch.Tensor and not value.requires_grad and value.layout == torch.strided:
        arg = sent.get(("tensor", id(value)))
        if arg is None:                      # the worker makes a tensor of its own from it at each use
            arg = sent["tensor", id(value)] = TensorArg(value)
        return arg
    if kind is torch.Generator or isinstance(value, torch.Generator):     # (isinstance runs Python code here)
        if id(value) not in sent:
            generators.append(value)
            sent[id(value)] = GeneratorArg(len(generators) - 1, str(value.device), value.get_state().numpy().tobytes())
        return sent[id(value)]
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            grad_inputs.append(value)
            return GradArg(len(grad_inputs) - 1, value.detach().clone())
        return value.detach()
    if depth < guard.MAX_DEPTH and kind is dict:
        return {k: _prepare(v, generators, grad_inputs, depth + 1, sent) for k, v in value.items()}
    return value


def _outcome(name: str, reply: dict, sandbox: Sandbox, by_protocol: bool = True):
    kind = reply.get("kind")
    if kind == "value":
        return reply.get("value")
    if kind == "missing":
        import implementation
        raise implementation.NotImplementedGraded(f"not implemented: {name} ({sandbox.package['spec']} defines no "
                                                  f"{name})")
    if kind == "control":
        raise guard.GradedCallError(f"{name} raised {_text(reply.get('type'), 100)}: graded code must not skip, "
                                    f"fail, exit or end the run")
    if kind == "refused":
        raise guard.GradedCallError(f"{name} {_text(reply.get('message'), 500)}")
    sandbox.rng_known = None                 # the call may have drawn numbers: send the state again next time
    if kind == "error":
        err = _exception(name, reply)
        if by_protocol:
            _RAISED_BY_GRADED_CODE[id(err)] = err
        raise err
    raise sandbox._fail(f"{name}: the worker sent a reply of unknown kind {_text(kind, 60)!r}")


def _text(value, limit: int) -> str:
    return value[:limit] if type(value) is str else "?"


def _exception(name: str, reply: dict) -> BaseException:
    """The worker's exception as the nearest builtin exception (pytest.raises(ValueError) still catches it)."""
    where = reply.get("not_implemented")
    if type(where) is str:
        import implementation
        return implementation.NotImplementedGraded(f"not implemented: {where[:200]}")
    message = _text(reply.get("message"), 2000)
    if reply.get("builtin") is not True:
        message = f"{_text(reply.get('type'), 200)}: {message}"
    bases = reply.get("bases") if type(reply.get("bases")) is list else []
    cls = next((getattr(builtins, b) for b in bases if type(b) is str and isinstance(getattr(builtins, b, None), type)
                and issubclass(getattr(builtins, b), Exception)), Exception)
    try:
        err = cls(message)
    except Exception:   # noqa: BLE001  (bases with other signatures: UnicodeDecodeError, ...)
        err = guard.GradedCallError(message)
    trace = reply.get("traceback")
    if type(trace) is str and trace:
        err.add_note(f"(raised in {name}, in the worker process; its traceback:)\n{trace[-3000:]}")
    return err


def _restore_rng(name: str, reply: dict, generators: list) -> None:
    state = reply.get("rng")
    if state is not None:
        torch.set_rng_state(_state(name, state, torch.get_rng_state()))
    if _active is not None:
        _active.rng_known = torch.get_rng_state()
    returned = reply.get("generators") or {}
    if type(returned) is not dict:
        raise guard.GradedCallError(f"{name}: a bad generator state came back")
    for slot, state in returned.items():
        if type(slot) is not int or not 0 <= slot < len(generators):
            raise guard.GradedCallError(f"{name}: a bad generator state came back")
        generators[slot].set_state(_state(name, state, generators[slot].get_state()))


def _state(name: str, encoded, like: torch.Tensor) -> torch.Tensor:
    state = decode(name, encoded) if type(encoded) is tuple else None
    if type(state) is not torch.Tensor or state.dtype != like.dtype or state.shape != like.shape:
        raise guard.GradedCallError(f"{name}: a bad random generator state came back")
    return state


# --- decoding (nothing the worker sends runs here) -----------------------------------------------------------

_SCALARS = (bool, int, float, str, type(None))


def decode(name: str, value, depth: int = 0, slots: dict | None = None):
    """The worker's tagged data as Python values; `slots` collects the tensors marked as needing gradients."""
    if type(value) is not tuple or not value or depth > guard.MAX_DEPTH + 1:
        raise guard.GradedCallError(f"{name}: the worker sent malformed data")
    tag = value[0]
    if tag == "v" and len(value) == 2 and type(value[1]) in _SCALARS:
        return value[1]
    if tag == "T" and len(value) == 5:
        tensor = _tensor(name, *value[1:4])
        if value[4] is not None:
            if slots is None or type(value[4]) is not int or value[4] in slots:
                raise guard.GradedCallError(f"{name}: the worker sent a malformed autograd graph")
            slots[value[4]] = tensor
        return tensor
    if tag in ("l", "t") and len(value) == 2 and type(value[1]) is list:
        items = [decode(name, v, depth + 1, slots) for v in value[1]]
        return items if tag == "l" else tuple(items)
    if tag == "d" and len(value) == 2 and type(value[1]) is list:
        out = {}
        for item in value[1]:
            if type(item) is not tuple or len(item) != 2 or type(item[0]) not in (str, int):
                raise guard.GradedCallError(f"{name}: the worker sent a malformed dict")
            out[item[0]] = decode(name, item[1], depth + 1, slots)
        return out
    if tag == "S" and len(value) == 2:
        import sympy
        return _sympy(name, value[1], sympy, [0])
    raise guard.GradedCallError(f"{name}: the worker sent malformed data (tag {str(tag)[:20]!r})")


def _tensor(name: str, dtype_name, shape, raw) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None) if type(dtype_name) is str and dtype_name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or type(shape) is not tuple or type(raw) is not bytes \
            or not all(type(s) is int and s >= 0 for s in shape) or len(shape) > 64:
        raise guard.GradedCallError(f"{name}: the worker sent a malformed tensor")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != len(raw):
        raise guard.GradedCallError(f"{name}: the worker sent a tensor of shape {shape} and dtype {dtype} in "
                                    f"{len(raw)} bytes")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _sympy(name: str, node, sympy, count: list):
    count[0] += 1
    if count[0] > sandbox_worker.MAX_NODES or type(node) is not tuple or not node or type(node[0]) is not str:
        raise guard.GradedCallError(f"{name}: the worker sent a malformed sympy expression")
    kind, rest = node[0], node[1:]
    try:
        if kind == "Symbol" and len(rest) == 2 and type(rest[0]) is str and type(rest[1]) is dict:
            assumptions = {k: v for k, v in rest[1].items() if type(k) is str and k.isidentifier() and len(k) < 40
                           and type(v) is bool}
            return sympy.Symbol(rest[0], **assumptions)
        if kind == "Integer" and len(rest) == 1 and type(rest[0]) is int:
            return sympy.Integer(rest[0])
        if kind == "Rational" and len(rest) == 2 and all(type(r) is int for r in rest) and rest[1] != 0:
            return sympy.Rational(rest[0], rest[1])
        if kind == "Float" and len(rest) == 2 and type(rest[0]) is str and type(rest[1]) is int \
                and len(rest[0]) < 200 and 1 <= rest[1] <= 10000:
            return sympy.Float(rest[0], precision=rest[1])
        cls = getattr(sympy, kind, None) if kind.isidentifier() and not kind.startswith("_") else None
        if not (isinstance(cls, type) and issubclass(cls, sympy.Basic)) or len(rest) != 1 or type(rest[0]) is not list:
            raise guard.GradedCallError(f"{name} returned a sympy {kind[:60]}, which the grader does not rebuild")
        args = [_sympy(name, a, sympy, count) for a in rest[0]]
        return cls(*args) if args else cls()
    except guard.GradedCallError:
        raise
    except Exception as err:   # noqa: BLE001  (sympy refusing the arguments)
        raise guard.GradedCallError(f"{name}: its sympy {kind[:60]} could not be rebuilt ({type(err).__name__})") \
            from None


# --- objects and gradients ---------------------------------------------------------------------------------------


class RemoteObject:
    """An object graded code returned, kept in the worker: each attribute read or method call is a graded call."""

    __slots__ = ("_name", "_sandbox", "_generation", "_handle", "_members", "_methods")

    def __init__(self, name, sandbox, generation, handle, members):
        for key, value in (("_name", name), ("_sandbox", sandbox), ("_generation", generation),
                           ("_handle", handle), ("_members", members), ("_methods", set())):
            object.__setattr__(self, key, value)

    def __getattr__(self, attr: str):
        name, sandbox, members = self._name, self._sandbox, self._members
        if attr not in members:
            raise AttributeError(f"the grader does not use {name}.{attr}")
        full = f"{name}.{attr}"
        if sandbox.generation != self._generation or sandbox.worker is None:
            raise guard.GradedCallError(f"{full}: the process that held this object is gone")
        handle, kind = self._handle, members[attr]
        if attr in self._methods:      # a method once: the call itself reads it again in the worker
            return lambda *args, **kwargs: call(full, args, kwargs, kind, handle=handle, attr=attr)
        if _collecting is not None:    # `script` gathers steps: a read, or a method call if the step calls it
            step = _Deferred("getattr", full, (), {}, kind, handle, attr)
            _collecting.append(step)
            return step
        try:
            return self._read(sandbox, full, attr, handle, kind)
        except BaseException as err:
            _after_failure(sandbox, err)
            raise

    def _read(self, sandbox, full: str, attr: str, handle, kind):
        guard._calls.append(full)
        try:
            reply = sandbox.request(full, {"op": "getattr", "handle": self._handle, "attr": attr,
                                           "rng": sandbox.rng_to_send()})
        finally:
            guard._calls.pop()
        if reply.get("kind") == "callable":
            self._methods.add(attr)
            return lambda *args, **kwargs: call(full, args, kwargs, kind, handle=handle, attr=attr)
        value = _outcome(full, reply, sandbox)
        return guard.check(full, decode(full, value), kind)

    def __setattr__(self, attr, value):
        raise AttributeError("the grader never sets attributes of a graded object")

    def __repr__(self) -> str:
        return f"<graded {self._name} object in a worker process>"




class _Box:
    __slots__ = ("name", "sandbox", "generation", "graph", "outputs", "inputs")


class _RemoteGrad(torch.autograd.Function):
    """Outputs whose gradient the worker computes: backward sends the output grads and receives the input grads."""

    @staticmethod
    def forward(ctx, box, *inputs):
        ctx.box = box
        return tuple(o.clone() for o in box.outputs)

    @staticmethod
    def backward(ctx, *grads):
        try:
            return _RemoteGrad._backward(ctx.box, grads)
        except BaseException as err:
            _after_failure(ctx.box.sandbox, err)
            raise

    @staticmethod
    def _backward(box, grads):
        if box.sandbox.generation != box.generation or box.sandbox.worker is None:
            raise guard.GradedCallError(f"{box.name}: the process that holds its autograd graph is gone")
        reply = box.sandbox.request(f"{box.name} (backward)", {
            "op": "backward", "graph": box.graph, "grads": [None if g is None else g.detach() for g in grads]})
        got = decode(box.name, _outcome(box.name, reply, box.sandbox))
        if type(got) is not list or len(got) != len(box.inputs):
            raise guard.GradedCallError(f"{box.name}: its backward sent {len(got)} gradients")
        out = []
        for g, x in zip(got, box.inputs):
            if g is not None and (type(g) is not torch.Tensor or g.shape != x.shape):
                raise guard.GradedCallError(f"{box.name}: a gradient of the wrong shape came back")
            out.append(None if g is None else g.to(x.dtype))
        return (None, *out)


def _attach_graph(name: str, sandbox: Sandbox, encoded, graph, grad_inputs: list):
    """The result with each tensor that needs gradients (marked by the worker) an output of a _RemoteGrad over the
    test's own input tensors, so the test's backward reaches its inputs through the worker's graph."""
    if type(graph) is not tuple or len(graph) != 2 or type(graph[0]) is not int or type(graph[1]) is not list \
            or sorted(graph[1]) != list(range(len(grad_inputs))):
        raise guard.GradedCallError(f"{name}: the worker sent a malformed autograd graph")
    slots: dict[int, torch.Tensor] = {}
    value = decode(name, encoded, slots=slots)
    if sorted(slots) != list(range(len(slots))) or not slots:
        raise guard.GradedCallError(f"{name}: the worker sent a malformed autograd graph")
    box = _Box()
    box.name, box.sandbox, box.generation, box.graph = name, sandbox, sandbox.generation, graph[0]
    box.outputs, box.inputs = [slots[i] for i in range(len(slots))], grad_inputs
    outs = _RemoteGrad.apply(box, *grad_inputs)
    swap = {id(t): out for t, out in zip(box.outputs, outs)}

    def fill(v, depth=0):
        if type(v) is torch.Tensor:
            return swap.get(id(v), v)
        if depth < guard.MAX_DEPTH + 1 and type(v) in (list, tuple):
            return type(v)(fill(x, depth + 1) for x in v)
        if depth < guard.MAX_DEPTH + 1 and type(v) is dict:
            return {k: fill(x, depth + 1) for k, x in v.items()}
        return v
    return fill(value)
