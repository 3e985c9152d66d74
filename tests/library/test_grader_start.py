"""The sandbox's supervisor started before the grader imports torch (tests/sandbox_start.py): started only for a run
that grades a package, adopted by the grader's first `Supervisor`, and killed at exit when never adopted."""

import os
import subprocess
import sys
import time
from pathlib import Path

import implementation
import pytest
import sandbox
import sandbox_start

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, environ, want", [
    (["pytest", "tests/graded", "--impl", "my_solution"], {}, True),
    (["pytest", "--impl=./my_solution"], {}, True),
    (["pytest", "tests/graded"], {"CS336_INFERENCE_IMPL": "my_solution"}, True),
    (["pytest", "tests/graded"], {}, False),
    (["pytest", "tests/graded"], {"CS336_INFERENCE_IMPL": "  "}, False),      # blank: the grader refuses it later
    (["pytest", "--implementation", "x", "-k", "impl"], {}, False),
])
def test_only_a_run_that_grades_a_package_starts_one(argv, environ, want):
    assert sandbox_start.requested(argv, environ) is want


def test_it_reads_the_variable_the_grader_reads():
    assert sandbox_start.ENV_VAR == implementation.ENV_VAR     # written twice: implementation imports torch


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:].split()[0] == b"Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the sandbox's process checks read /proc (Linux)")
def test_the_supervisor_started_early_is_the_one_the_grader_uses(monkeypatch):
    monkeypatch.setattr(sandbox_start, "_early", None)
    sandbox_start.start_early(["pytest", "--impl", "pkg"], {})
    early = sandbox_start._early
    assert early is not None
    sandbox_start.start_early(["pytest", "--impl", "pkg"], {})
    assert sandbox_start._early is early, "a second call starts no second supervisor"
    sup = sandbox.Supervisor()
    try:
        assert sup.pid == early[0].pid and sup.sock is early[1] and sandbox_start._early is None
        sup.sock.settimeout(60)
        sup.wait_ready()                                  # it received its setup and imported the library
        assert sup.alive()
    finally:
        sup.stop()
    assert _gone(sup.pid)
    other = sandbox.Supervisor()                          # nothing left to adopt: a new one
    try:
        assert other.pid != sup.pid
    finally:
        other.stop()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the sandbox's process checks read /proc (Linux)")
def test_one_never_adopted_is_killed_at_exit_and_starting_it_imports_no_torch(tmp_path):
    code = ("import sys; sys.argv = ['pytest', '--impl', 'pkg']; import sandbox_start; "
            "print(sandbox_start._early[0].pid, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + [p for p in sys.path if p])
    with open(tmp_path / "stderr", "w") as err:       # not a pipe: the supervisor inherits it and would hold it open
        out = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                             timeout=60)
    assert out.returncode == 0, (tmp_path / "stderr").read_text()
    pid, torch_imported = out.stdout.split()
    assert torch_imported == "False", "the supervisor must start before the grader imports torch"
    deadline = time.monotonic() + 0.5     # killed at exit: it would take seconds to end by itself
    while not _gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(int(pid)), "the early supervisor outlived the process that started it"
