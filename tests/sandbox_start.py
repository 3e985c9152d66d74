"""Starting the sandbox's supervisor (tests/sandbox.py) as early as possible.

The supervisor is a fresh interpreter that imports torch, the library and the other PRELOAD modules before it can
fork the student's package root; alone, that takes longer than the grader's own collection. This module imports no
torch, and conftest.py imports it first: the import starts the supervisor (`start_early`) when the command line asks
to grade a package, so that the two processes import side by side on two cores and the supervisor is ready by the
time the tests are collected. `sandbox.Supervisor` adopts the process started here (`take_early`) or starts one
itself; one never adopted (a run that grades no package after all) is killed when the grader exits.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import sandbox_worker   # no torch at import either

__mutable__ = ("_early",)   # bookkeeping tests/tamper.py skips

WORKER = Path(sandbox_worker.__file__).resolve()
ENV_VAR = "CS336_INFERENCE_IMPL"        # implementation.ENV_VAR (that module imports torch)
# imported by the supervisor before any fork (cs336_inference first: it sets OpenMP's wait policy before torch starts)
PRELOAD = ("cs336_inference", "numpy", "einops", "sympy", "cs336_inference.homework.reference", "tamper", "guard")

_early: tuple[subprocess.Popen, socket.socket] | None = None


def spawn() -> tuple[subprocess.Popen, socket.socket]:
    """A supervisor process, sent its setup and not waited for: (the process, the grader's end of its socket).
    It sees neither pytest's variables nor the package to grade (`PYTEST_*`, $CS336_INFERENCE_IMPL)."""
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", ENV_VAR))}
    try:
        proc = subprocess.Popen([sys.executable, "-I", str(WORKER), str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        theirs.close()
    sandbox_worker.send(ours, {"sys_path": list(sys.path), "preload": PRELOAD})
    return proc, ours


def requested(argv: list[str], environ) -> bool:
    """Whether this pytest run grades a package (an --impl option, or $CS336_INFERENCE_IMPL not blank), judged from
    the command line before pytest has parsed it. A wrong guess costs only a process killed at exit."""
    if any(arg == "--impl" or arg.startswith("--impl=") for arg in argv):
        return True
    return bool((environ.get(ENV_VAR) or "").strip())


def start_early(argv: list[str] | None = None, environ=None) -> None:
    """Start the supervisor now if this run grades a package (under pytest-xdist each worker starts its own later)."""
    global _early
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    if _early is not None or environ.get("PYTEST_XDIST_WORKER") or not requested(argv, environ):
        return
    if not Path("/proc").is_dir():       # Linux only, as the sandbox's process checks
        return
    _early = spawn()


def take_early() -> tuple[subprocess.Popen, socket.socket] | None:
    """The supervisor `start_early` started, still running, or None; it is the caller's from now on."""
    global _early
    early, _early = _early, None
    if early is not None and early[0].poll() is not None:
        early[1].close()
        return None
    return early


@atexit.register
def _stop_unadopted() -> None:
    early = take_early()
    if early is None:
        return
    proc, sock = early
    sock.close()
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # its own session: what it started goes too
    except OSError:
        pass
    proc.wait()


start_early()   # on import, by conftest.py before torch
