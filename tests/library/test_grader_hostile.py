"""The autograder against hostile packages: each trick fails its own tests with a clear message, the
run finishes, results.json is written, and the grader's interpreter is as it was afterwards. A student's
package runs in worker processes (tests/sandbox.py), so what it patches there (torch.equal, the default
dtype, ...) never reaches the grader: its wrong answers fail on their own. Tricks aimed at the grader itself
(gc, os._exit, results.json, detached processes) are in test_grader_sandbox.py.

Runs go through pytest in this process (as tests/library/test_grader.py does), on a handful of tiny
graded tests (a hidden-tests folder that calls get_batch), so the whole file takes a few seconds.
The watchdog that ends a run whose graded code ignores the timeout exits the process, so its test
runs in a subprocess and is marked slow."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy
import pytest
import torch
from test_grader import ROOT, grade

import adapters  # noqa: F401  (imported before the snapshot, as every graded test module imports it)
import cs336_inference.homework.reference  # noqa: F401  (so no graded run below pays its import)
import tamper
from cs336_inference import cli

HIDDEN = '''
import pytest
import torch
from adapters import run_get_batch

DATA = torch.arange(50)


@pytest.mark.parametrize("mode", range(1, 15))
def test_mode(mode):
    x, y = run_get_batch(DATA, mode, 4, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1) and x.shape == (mode, 4), "windows and shifted targets"


@pytest.mark.parametrize("mode", [14, 14])
def test_two(mode):
    test_mode(mode)
'''

# get_batch misbehaves according to batch_size (one run of the hidden tests above exercises every trick)
MISCHIEF = '''
import sys
import time

import pytest
import torch

from cs336_inference.homework.reference import get_batch as reference


class Sub(torch.Tensor):
    pass


class Always(int):
    def __eq__(self, other):
        return True


class Evil(Exception):
    def __str__(self):
        while True:
            pass


def get_batch(data, batch_size, seq_len, generator=None):
    x, y = reference(data, batch_size, seq_len, generator)
    mode = batch_size
    if mode == 1:
        while True:
            pass
    if mode == 2:
        time.sleep(1e6)
    if mode == 3:
        return [x]
    if mode == 4:
        return x.as_subclass(Sub), y.as_subclass(Sub)
    if mode == 5:
        pytest.skip("skipping is not passing")
    if mode == 6:
        pytest.exit("the run must not end here")
    if mode == 7:
        raise SystemExit(0)
    if mode == 8:
        raise KeyboardInterrupt
    if mode == 9:
        raise Evil()
    if mode == 10:
        torch.equal = lambda *a, **k: True
        return x, x
    if mode == 11:
        return (x, Always(1))
    if mode == 12:
        return "x", "y"
    if mode == 13:
        torch.set_default_dtype(torch.float64)
        return x, x
    return x, y
'''

EXPECTED = {1: "GradedTimeout: timed out after 1 s in get_batch", 2: "GradedTimeout: timed out after 1 s in get_batch",
            3: "get_batch must return a tuple of 2", 4: "torch.Tensor subclass", 5: "get_batch raised Skipped",
            6: "get_batch raised Exit", 7: "get_batch raised SystemExit", 8: "get_batch raised KeyboardInterrupt",
            9: "GradedTimeout: timed out after 1 s in get_batch",          # its message never ends printing
            10: "windows and shifted targets", 11: "returned a mischief.Always",  # torch.equal patched in the worker
            12: "must return a torch.Tensor, got str", 13: "windows and shifted targets"}


def _package(tmp_path, name: str, source: str) -> Path:
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(source))
    return package


_HIDDEN_DIR: list[Path] = []


def _hidden(tmp_path) -> Path:
    """One folder for the whole module (pytest imports test_tricks.py once per process)."""
    if not _HIDDEN_DIR:
        hidden = tmp_path / "hidden"
        hidden.mkdir(exist_ok=True)
        (hidden / "test_tricks.py").write_text(HIDDEN)
        _HIDDEN_DIR.append(hidden)
    return _HIDDEN_DIR[0]


def _run(tmp_path, package, *extra, tests="test_mode") -> tuple[int, dict, str]:
    """Grade `package` on the hidden tests named `tests` (test_mode: the 14 tricks; test_two: two plain cases)."""
    hidden = _hidden(tmp_path)
    out = tmp_path / f"{Path(str(package)).name}.json"
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "-k", tests, "--hidden-tests", hidden,
                    "--impl", package, "--grade-json", out, *extra)
    assert out.exists(), log[-3000:]
    return rc, json.loads(out.read_text()), log


def _interpreter_is_intact():
    assert torch.equal(torch.ones(2), torch.zeros(2)) is False
    assert torch.get_default_dtype() == torch.float32
    assert "__eq__" not in vars(torch.Tensor)
    assert sys.modules["torch"] is torch and math.isclose(1.0, 2.0) is False


def test_each_trick_fails_its_own_test_and_the_run_finishes(tmp_path):
    package = _package(tmp_path, "mischief", MISCHIEF)
    rc, results, log = _run(tmp_path, package, "--graded-timeout", "1")
    assert rc == 1, log[-3000:]
    by_mode = {int(t["name"].split("[")[1].rstrip("]")): t for t in results["tests"]}
    assert set(by_mode) == set(range(1, 15)), "every case ran and was counted (none skipped, the run did not stop)"
    for mode, text in EXPECTED.items():
        assert by_mode[mode]["status"] == "failed" and text in by_mode[mode]["output"], (mode, by_mode[mode])
    assert by_mode[14]["status"] == "passed", by_mode[14]     # after every trick, an honest answer still passes
    _interpreter_is_intact()


PATCHES = {   # what a package may try at import -> what the grader must report (each is undone after)
    "assert_close": ("torch.testing.assert_close = lambda *a, **k: None", "torch.testing.assert_close was replaced"),
    "equal": ("torch.equal = lambda *a, **k: True", "torch.equal was replaced"),
    "allclose": ("torch.allclose = lambda *a, **k: True", "torch.allclose was replaced"),
    "numpy": ("numpy.allclose = lambda *a, **k: True", "numpy.allclose was replaced"),
    "isclose": ("math.isclose = lambda *a, **k: True", "math.isclose was replaced"),
    "builtin": ("builtins.all = lambda *a: True", "builtins.all was replaced"),
    "approx": ("pytest.approx = lambda x, **k: x", "pytest.approx was replaced"),
    "tensor_eq": ("torch.Tensor.__eq__ = lambda self, other: torch.ones((), dtype=torch.bool)",
                  "attributes added: ['__eq__']"),
    "code": ("torch.testing.assert_close.__code__ = (lambda *a, **k: None).__code__",
             "the code or defaults of torch.testing.assert_close"),
    "tolerances": ("torch.testing._comparison._DTYPE_PRECISIONS[torch.float32] = (1e9, 1e9)", "_DTYPE_PRECISIONS"),
    "sys_modules": ("sys.modules['torch'] = type(sys)('torch')", "sys.modules['torch'] was replaced"),
    "adapters": ("import adapters; adapters.run_get_batch = lambda *a: None", "adapters.run_get_batch was replaced"),
    "mode": ("torch.overrides.TorchFunctionMode.__enter__(type('M', (torch.overrides.TorchFunctionMode,), "
             "{'__torch_function__': lambda self, f, t, a=(), k=None: True})())", "torch function modes"),
    "default_dtype": ("torch.set_default_dtype(torch.float16)", "torch default dtype was changed"),
    "trace": ("sys.settrace(lambda *a: None)", "sys.settrace was changed"),
}


@pytest.fixture(scope="module")
def snapshot():
    return tamper.Snapshot.take()


@pytest.mark.parametrize("name", PATCHES)
def test_every_kind_of_patch_is_noticed_and_undone(snapshot, name):
    import builtins  # noqa: F401  (names the patches use)
    env = {"torch": torch, "numpy": numpy, "math": math, "pytest": pytest, "sys": sys, "builtins": builtins}
    originals = (torch.testing.assert_close, torch.equal, torch.testing.assert_close.__code__, builtins.all)
    assert snapshot.changes() == []
    code, report = PATCHES[name]
    try:
        exec(code, env)
        assert any(report in change for change in snapshot.changes(limit=50)), (name, snapshot.changes())
    finally:
        snapshot.restore()
    assert snapshot.changes() == [], f"{name}: not undone"
    assert (torch.testing.assert_close, torch.equal, torch.testing.assert_close.__code__, builtins.all) == originals
    _interpreter_is_intact()


LAZY_IMPORT = """
import functools, sys, torch
import tamper
plain, allowing = tamper.Snapshot.take(), tamper.Snapshot.take(allow_lazy_rebinds=True)
assert "torch._dynamo" not in sys.modules
import torch._dynamo                                   # rebinds torch.manual_seed to a wrapper of it
print(plain.changes() == ["torch.manual_seed was replaced"], allowing.changes() == [])
seed = torch.manual_seed
torch.manual_seed = lambda *a: None
print(allowing.changes() == ["torch.manual_seed was replaced"])
allowing.restore()
print(torch.manual_seed is seed, allowing.changes() == [])
"""


def test_the_lazy_import_of_torch_dynamo_is_a_change_only_where_it_must_be_imported_first():
    """tests/tamper.py LAZY_REBINDS: a snapshot of the grader's own process with --impl allows torch._dynamo's
    wrapper of torch.manual_seed (so it need not import torch._dynamo first); any other replacement is reported."""
    proc = subprocess.run([sys.executable, "-c", LAZY_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True"] * 5, proc.stdout


def test_a_package_that_patches_at_import_scores_nothing(tmp_path):
    package = _package(tmp_path, "patcher", """
        import math, torch
        from cs336_inference.homework.reference import get_batch as _get_batch

        def get_batch(data, batch_size, seq_len, generator=None):
            x, y = _get_batch(data, batch_size, seq_len, generator)
            return x, x                                    # wrong targets
        torch.equal = lambda *a, **k: True
        torch.testing.assert_close = lambda *a, **k: None
        math.isclose = lambda *a, **k: True
        """)
    rc, results, log = _run(tmp_path, package, tests="test_two")
    assert rc == 1 and results["score"] == 0, log[-3000:]
    for t in results["tests"]:
        assert "windows and shifted targets" in t["output"], t     # the patches stayed in the worker
    _interpreter_is_intact()


IMPORT_FAILURES = {
    "system_exit": ("raise SystemExit(3)", "SystemExit: 3"),
    "keyboard_interrupt": ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    "skip": ("import pytest\npytest.skip('no', allow_module_level=True)", "Skipped"),
    "loop": ("while True:\n    pass", "timed out after 1 s while being imported"),
    "evil": ("class E(Exception):\n    def __str__(self):\n        return 1 / 0\nraise E()",
             "E: <exception str() failed>"),
}


@pytest.mark.parametrize("case", IMPORT_FAILURES)
def test_an_import_that_misbehaves_is_reported_once_and_no_test_runs(tmp_path, case):
    source, text = IMPORT_FAILURES[case]
    package = _package(tmp_path, f"bad_{case}", source + "\n")
    rc, results, log = _run(tmp_path, package, "--graded-timeout", "1", tests="test_two")
    assert rc == 1, log[-3000:]
    assert len(results["tests"]) == 2 and results["score"] == 0
    message = f"cannot import the implementation {package}: "
    assert all(message in t["output"] and text in t["output"] for t in results["tests"]), results["tests"][0]
    assert message in results["output"] and log.count(message) == 2, log[-3000:]   # NOT GRADED + the last line
    assert message in log.strip().splitlines()[-1]
    _interpreter_is_intact()


def test_a_package_named_like_a_module_the_grader_uses_is_refused(tmp_path):
    for name in ("torch", "json", "adapters"):
        rc, results, log = _run(tmp_path, _package(tmp_path, name, "x = 1\n"), tests="test_two")
        assert rc == 1, log[-3000:]
        assert all(f"the package name {name!r} shadows" in t["output"] for t in results["tests"]), results["tests"][0]
    _interpreter_is_intact()
    assert Path(torch.__file__).parent.name == "torch" and hasattr(torch, "tensor")


@pytest.mark.parametrize("spec", ["", "   "])
def test_an_empty_impl_is_a_usage_error(tmp_path, spec):
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "--impl", spec)
    assert rc == 4 and "is empty" in log, log[-2000:]          # 4: pytest's usage error
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", env={"CS336_INFERENCE_IMPL": spec})
    assert rc == 4 and "is empty" in log, log[-2000:]


def test_homework_init_refuses_names_that_shadow_modules(tmp_path, capsys):
    for name in ("torch", "numpy", "json", "adapters", "cs336_inference"):
        assert cli.main(["homework", "init", str(tmp_path / name)]) == 2
        assert "shadows" in capsys.readouterr().err
        assert not (tmp_path / name).exists()


@pytest.mark.slow
def test_code_that_swallows_every_timeout_fails_each_test_and_the_run_ends(tmp_path):
    package = _package(tmp_path, "stubborn", """
        import signal

        def get_batch(*args):
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                try:
                    while True:
                        pass
                except BaseException:
                    pass
        """)
    hidden, out = _hidden(tmp_path), tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "graded" / "test_batch_sampler.py"),
                           "-k", "test_mode", "--hidden-tests", str(hidden), "--impl",
                           str(package), "--grade-json", str(out), "--graded-timeout", "1", "-q", "-p",
                           "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=14 * 1 + 120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    tests = json.loads(out.read_text())["tests"]
    assert len(tests) == 14 and all(t["status"] == "failed" and "timed out after 1 s in get_batch" in t["output"]
                                    for t in tests)


def test_the_reference_runs_in_process_and_leaves_no_timer_armed(tmp_path):
    signal_before = signal.getsignal(signal.SIGALRM)
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "--grade-json", tmp_path / "r.json")
    assert rc == 0, log[-2000:]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the grader left its interval timer armed"
    assert signal.getsignal(signal.SIGALRM) is signal_before


OWN_PATCH = '''
import math
import torch
from adapters import run_get_batch

DATA = torch.arange(50)


def test_before_the_patch():
    x, y = run_get_batch(DATA, 2, 4, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)


def test_the_test_itself_patches_the_grader():
    math.isclose = lambda *a, **k: True                   # this test's own code runs in the grader's process
    x, y = run_get_batch(DATA, 2, 4, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)
'''


def test_with_impl_a_change_to_the_graders_interpreter_fails_its_whole_file_and_is_undone(tmp_path):
    """tests/grading.py: in an isolated run the full comparison runs after each test file; what it finds fails every
    graded test of that file (the earlier test too) and is restored; the other files' tests are untouched."""
    hidden = tmp_path / "own_patch"
    hidden.mkdir()
    (hidden / "test_grader_own_patch.py").write_text(OWN_PATCH)
    package = _package(tmp_path, "honest_pkg", "from cs336_inference.homework.reference import *  # noqa\n")
    out = tmp_path / "results.json"
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "--hidden-tests", hidden, "--impl", package,
                    "--grade-json", out)
    assert rc == 1, log[-3000:]
    tests = {t["name"]: t for t in json.loads(out.read_text())["tests"]}
    own = {n: t for n, t in tests.items() if n.startswith("test_grader_own_patch.py")}
    assert len(own) == 2 and all(t["status"] == "failed" and "the grader's interpreter changed" in t["output"]
                                 and "math.isclose" in t["output"] for t in own.values()), own
    others = [t for n, t in tests.items() if n not in own]
    assert others and all(t["status"] == "passed" for t in others), others
    _interpreter_is_intact()


LINGER = '''
import os
import time
from cs336_inference.homework.reference import get_batch as reference


def get_batch(data, batch_size, seq_len, generator=None):
    if batch_size == 1 and os.fork() == 0:                # a child that outlives the call
        with open({pid_file!r}, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
        os._exit(0)
    return reference(data, batch_size, seq_len, generator)
'''

AFTER_LINGER = '''
import os
import time
import torch
from adapters import run_get_batch

DATA = torch.arange(50)


def test_a_call_starts_a_child():
    x, y = run_get_batch(DATA, 1, 4, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)
    for _ in range(500):                                  # the child has written its pid
        if os.path.exists({pid_file!r}):
            break
        time.sleep(0.01)


def test_the_next_test_starts_without_it():
    pid = int(open({pid_file!r}).read())
    stat = f"/proc/{{pid}}/stat"
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z", "the child still runs"
    x, y = run_get_batch(DATA, 2, 4, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)
'''


def test_a_process_a_graded_call_started_is_gone_before_the_next_test_runs(tmp_path):
    """tests/sandbox.py: the worker's "reset" reply is read after its test has ended (`settle`), but before the next
    test's first graded call or body: a process the worker started is killed, with the worker, before any code of
    the next test's body runs."""
    pid_file = str(tmp_path / "child.pid")
    hidden = tmp_path / "linger"
    hidden.mkdir()
    (hidden / "test_grader_linger.py").write_text(AFTER_LINGER.format(pid_file=pid_file))
    package = _package(tmp_path, "linger_pkg", LINGER.format(pid_file=pid_file))
    out = tmp_path / "results.json"
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "-k", "child or without_it", "--hidden-tests",
                    hidden, "--impl", package, "--grade-json", out)
    assert rc == 0, log[-3000:]
    assert [t["status"] for t in json.loads(out.read_text())["tests"]] == ["passed", "passed"]
