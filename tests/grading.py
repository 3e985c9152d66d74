"""The autograder's pytest plugin: points per graded test, a summary line, Gradescope's results.json,
hidden tests added at grading time, and one short line for what a student has not implemented yet.

Graded tests are the ones under tests/graded/ (points from the one table, tests/graded/points.py: the
points of a test function are shared equally by its parametrized cases) and, with `--hidden-tests DIR`,
the tests in DIR (points from `@pytest.mark.points(n)`, default 1; visibility from
`@pytest.mark.visibility("...")`, default "after_due_date"). A test that is skipped is left out of the
total (it could not run here, e.g. a GPU test on a CPU machine).

A student's package (`--impl`) never runs in this process (tests/sandbox.py): it is imported once, before
any test runs, in a process of its own (a package that cannot be imported is reported once, loudly, and
scores 0), and each graded test's calls run in a fresh worker process forked from there, killed with
everything it started when the test ends. Every graded test has a deadline (`--graded-timeout`, default
60 s): a worker that has not answered by then is killed and the test fails with "timed out after N s in
NAME"; the run goes on, so it ends within (tests x timeout + a margin) whatever the package does.

results.json cannot lie: before anything of the package runs, a "not graded" results.json is written (its
folder created); at the end it is replaced, atomically, by this process's own records. The exit status is
this process's (1 if a graded test failed), and the score is the last line printed.

The reference solution (no `--impl`) runs in this process, under SIGALRM (raised again every second until
disarmed, and a watchdog thread that ends a run whose code ignores it). As a second line of defence,
the interpreter is compared with its state before the run (tests/tamper.py) after every graded test
where graded code runs in this process; what changed fails that test and is restored. In a run with
`--impl` nothing of the package's runs here: the cheap part of the comparison follows every test, the
identity scan over every watched object each test file, and what it finds fails that file's tests.

Options (registered by tests/conftest.py):
  --impl SPEC          grade this package (see tests/implementation.py); default: the reference
  --grade-json PATH    write Gradescope's results.json to PATH
  --hidden-tests DIR   also run the graded tests in DIR (kept out of the repository)
  --graded-timeout S   seconds one graded test may take (default 60)
"""

from __future__ import annotations

import importlib.util
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import guard
import implementation
import sandbox
import tamper

GRADED_DIR = Path(__file__).resolve().parent / "graded"
POINTS_FILE = GRADED_DIR / "points.py"
VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")
OUTPUT_LIMIT = 4000   # characters of failure text per test in results.json
DEFAULT_TIMEOUT = 60.0


def add_options(parser) -> None:
    group = parser.getgroup("cs336-grading", "CS336 autograder")
    group.addoption("--impl", default=None, metavar="SPEC",
                    help=f"grade this implementation: a module name or a path to a package folder or .py file "
                         f"(default: ${implementation.ENV_VAR}, else the reference solution)")
    group.addoption("--grade-json", default=None, metavar="PATH",
                    help="write the graded results as Gradescope's results.json to PATH")
    group.addoption("--hidden-tests", default=None, metavar="DIR",
                    help="also collect the graded tests in DIR (hidden tests, added at grading time)")
    group.addoption("--graded-timeout", default=DEFAULT_TIMEOUT, type=float, metavar="S",
                    help=f"seconds one graded test may take before it fails as timed out (default {DEFAULT_TIMEOUT:g})")


GradedTimeout = guard.GradedTimeout


class Tampered(AssertionError):
    """Graded code changed the grader's interpreter during a test (restored before the next one)."""


def load_points() -> dict[str, float]:
    """{"test_file.py::test_name": points} from tests/graded/points.py."""
    spec = importlib.util.spec_from_file_location("graded_points", POINTS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.POINTS)


@dataclass
class Record:
    """One graded test case: its points and what happened in each phase."""

    name: str
    max_score: float
    visibility: str
    hidden: bool
    outcome: str = "pending"          # pending (not run yet) / passed / failed / skipped
    output: list[str] = field(default_factory=list)
    not_implemented: str | None = None

    @property
    def score(self) -> float:
        return self.max_score if self.outcome == "passed" else 0.0


def _nothing_runs_after_the_call(item) -> bool:
    """No code of the test runs after its call phase: its only fixtures are the grader's `_seed` (nothing after
    its yield) and direct parametrization."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            func = getattr(fixturedef.func, "__func__", fixturedef.func)
            where = (getattr(func, "__module__", None), getattr(func, "__name__", None))
            if where not in (("grading", "_seed"), ("_pytest.python", "get_direct_param_fixture_func")):
                return False
    return True


def _freeze_heap() -> None:
    """What exists when a run with a worker process starts (torch, pytest, the collected tests: hundreds of thousands
    of objects) is never scanned by the garbage collector again; the messages and decoded results of thousands of
    graded calls would otherwise trigger full collections over all of it. A process that grades again
    (tests/library/test_grader.py) first frees what an earlier run left frozen."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
    gc.freeze()


def not_implemented_name(excinfo) -> str:
    """The graded name behind a NotImplementedError: from our own message, else the raising function."""
    message = str(excinfo.value)
    if isinstance(excinfo.value, implementation.NotImplementedGraded):
        return message.removeprefix("not implemented: ").split(" ")[0]
    code = excinfo.traceback[-1].frame.code.raw
    return getattr(code, "co_qualname", code.co_name).replace(".__init__", "")


class Grader:
    """Registered as a plugin by tests/conftest.py for every run."""

    def __init__(self, config):
        self.config = config
        self.json_path = config.getoption("grade_json")
        hidden = config.getoption("hidden_tests")
        self.hidden_dir = Path(hidden).resolve() if hidden else None
        self.points = load_points()
        self.records: dict[str, Record] = {}
        self.start = time.time()
        self.timeout = float(config.getoption("graded_timeout"))
        if not self.timeout > 0:
            raise pytest.UsageError(f"--graded-timeout must be a positive number of seconds, got {self.timeout}")
        self.running: tuple[str, float] | None = None     # (nodeid, start) of the graded test in its call phase
        self.done: set[str] = set()
        self._watchdog: threading.Thread | None = None
        if self.hidden_dir is not None:
            if not self.hidden_dir.is_dir():
                raise pytest.UsageError(f"--hidden-tests {hidden}: not a folder")
            config.args.append(str(self.hidden_dir))
        self.sandbox: sandbox.Sandbox | None = None
        self.import_error: str | None = None       # the package under test could not be imported
        self.snapshot: tamper.Snapshot | None = None
        self.unverified: list[str] = []            # graded tests run since the last full comparison (isolated runs)
        self.write_failed: str | None = None
        if self.json_path:                          # before anything of the package runs
            self.write_results({"score": 0.0, "execution_time": 0.0, "visibility": "visible",
                                "stdout_visibility": "hidden", "tests": [],
                                "output": "not graded: the grading run did not finish (this file is replaced by the "
                                          "results when it does)", "extra_data": {"graded": False}})
        if implementation.isolated():
            sandbox.prestart()                      # its imports overlap collection (see _start_sandbox)

    @pytest.fixture(autouse=True)
    def _seed(self):
        """Every test (hidden ones included, wherever they live) starts from torch.manual_seed(0)."""
        torch.manual_seed(0)
        yield

    # --- which tests are graded, and for how many points -----------------------------------------

    def _kind(self, item) -> str | None:
        path = Path(item.path).resolve()
        if self.hidden_dir is not None and path.is_relative_to(self.hidden_dir):
            return "hidden"
        if path.is_relative_to(GRADED_DIR):
            return "graded"
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        cases: dict[str, list] = {}
        for item in items:
            kind = self._kind(item)
            if kind is not None:
                cases.setdefault(f"{kind}:{item.path.name}::{item.originalname}", []).append((item, kind))
        for key, group in cases.items():
            item, kind = group[0]
            base = key.split(":", 1)[1]
            if kind == "graded":
                if base not in self.points:
                    raise pytest.UsageError(f"graded test {base} has no points in {POINTS_FILE.name}; add it")
                total, visibility = self.points[base], "visible"
            else:
                marker = item.get_closest_marker("points")
                total = float(marker.args[0]) if marker else 1.0
                vis = item.get_closest_marker("visibility")
                visibility = vis.args[0] if vis else "after_due_date"
                if visibility not in VISIBILITIES:
                    raise pytest.UsageError(f"{base}: visibility must be one of {VISIBILITIES}, got {visibility!r}")
            for case, _ in group:
                name = case.nodeid.split("::", 1)[1]
                self.records[case.nodeid] = Record(f"{case.path.name}::{name}", total / len(group), visibility,
                                                   kind == "hidden")
        if self.records and implementation.isolated():
            self._start_sandbox(items)

    def _start_sandbox(self, items) -> None:
        """Import the package under test in its own process, once; if that fails, no graded test runs."""
        spec = implementation.selected()
        self.snapshot = tamper.Snapshot.take(allow_lazy_rebinds=True)   # nothing of the package's runs here
        try:
            request = implementation.locate(spec)
            self.sandbox = sandbox.Sandbox(request, self.timeout)
            error = self.sandbox.start()
        except ImportError as err:
            error = str(err)
        if error is None:
            sandbox.activate(self.sandbox)
            _freeze_heap()
            return
        if "request" in locals() and request["kind"] == "module" and error.startswith("ModuleNotFoundError"):
            error += (f" (--impl takes the path of a package folder or .py file, absolute or relative to "
                      f"{os.getcwd()}, or the name of a module on sys.path)")
        where = request["path"] if "request" in locals() and request.get("path") else spec
        self.import_error = f"cannot import the implementation {where}: {error}"
        graded = [item for item in items if item.nodeid in self.records]
        for item in graded:
            record = self.records[item.nodeid]
            record.outcome = "failed"
            record.output.append(f"not run: {self.import_error}")
        items[:] = [item for item in items if item.nodeid not in self.records]
        self.config.hook.pytest_deselected(items=graded)

    # --- running a graded test: timeout, tampering -------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        if item.nodeid in self.records and self.sandbox is not None:
            self.sandbox.begin_test()               # the deadline covers the graded fixtures too
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        try:
            return (yield)
        finally:
            if item.nodeid in self.records and self.sandbox is not None:
                self.sandbox.end_test()             # the worker and everything it started
            if self.unverified and (nextitem is None or nextitem.path != item.path):
                self._compare_interpreter()         # also after a teardown that raised

    def _compare_interpreter(self) -> None:
        """An isolated run's full comparison of this process's interpreter with its state before the run, at the end
        of each test file: what changed is restored, and every graded test since the last comparison fails."""
        tests, self.unverified = self.unverified, []
        changed = self.snapshot.changes() if self.snapshot is not None else []
        if not changed:
            return
        self.snapshot.restore()
        message = (f"the grader's interpreter changed during the graded tests of this file ({'; '.join(changed)}); it "
                   f"was restored, and they fail")
        for nodeid in tests:
            self.records[nodeid].outcome = "failed"
            self.records[nodeid].output.append(message[:OUTPUT_LIMIT])
        raise Tampered(message)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if item.nodeid not in self.records:
            return (yield)
        if self.sandbox is not None:
            return (yield from self._isolated_call(item))
        return (yield from self._in_process_call(item))

    def _isolated_call(self, item):
        """The test's graded calls run in its worker (tests/sandbox.py); a failure of the worker (timed out,
        ended, broke the protocol) fails the test even if the test caught the exception."""
        box = self.sandbox
        box.settle()                                # the last test's worker kept or replaced, before the clock below
        previous = self._arm(slack=1.0)             # a backstop for the test's own code on what came back
        try:
            result = yield
        finally:
            self._disarm(previous)
            if box.output:
                item.add_report_section("call", "graded code's output", "".join(box.output)[-OUTPUT_LIMIT:])
            if _nothing_runs_after_the_call(item):
                box.send_reset()                    # the worker checks itself while this process goes on
            # Nothing of the package's runs here (its worker's replies are plain data: sandbox.restricted_loads), so
            # only the grader's own code could change this interpreter: the cheap comparison after each test, the
            # identity scan over every watched object after each test file (`_compare_interpreter`).
            changed = self.snapshot.quick_changes() if self.snapshot is not None else []
            self.unverified.append(item.nodeid)
            if changed:
                self.snapshot.restore()
        if box.failure is not None:
            raise (GradedTimeout if box.failure.startswith("timed out") else guard.GradedCallError)(box.failure)
        if changed:
            raise Tampered(f"the grader's interpreter changed during this test ({'; '.join(changed)}); it was "
                           f"restored, and the test fails")
        return result

    def _in_process_call(self, item):
        implementation.prepare()
        self.running = (item.nodeid, time.monotonic())
        self._start_watchdog()
        previous = self._arm()
        try:
            return (yield)
        finally:
            self._disarm(previous)
            self.running = None
            changed = implementation.changes_since_import()
            if changed:
                raise Tampered(f"graded code changed the grader's interpreter during this test "
                               f"({'; '.join(changed)}); it was restored, and the test fails")

    def _arm(self, slack: float = 0.0):
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            return None
        timeout = self.timeout

        def on_alarm(signum, frame):
            where = guard.current()
            raise GradedTimeout(f"timed out after {timeout:g} s in "
                                f"{where if where else 'the test itself, between graded calls'}")
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout + slack, 1.0)   # raised again every second until disarmed
        return previous

    @staticmethod
    def _disarm(previous) -> None:
        if previous is None:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    def _start_watchdog(self) -> None:
        """A thread that ends the run (with its results written) if a graded test ignores its timeout."""
        if self._watchdog is not None:
            return
        grace = max(10.0, self.timeout)

        def watch():
            while True:
                time.sleep(0.5)
                running = self.running
                if running is not None and time.monotonic() - running[1] > self.timeout + grace:
                    self._abandon(running[0])
        self._watchdog = threading.Thread(target=watch, name="cs336-grader-watchdog", daemon=True)
        self._watchdog.start()

    def _abandon(self, nodeid: str) -> None:
        """The graded test `nodeid` ignored its timeout: fail it and every graded test not yet run, write the
        results, and exit (the hung code cannot be interrupted from here)."""
        where = guard.current() or "the test"
        for key, record in self.records.items():
            if key == nodeid:
                record.outcome = "failed"
                record.output.append(f"[call] timed out after {self.timeout:g} s in {where}, which ignored the "
                                     f"timeout; the grading run was stopped here")
            elif key not in self.done:
                record.outcome = "failed"
                record.output.append(f"not run: the grading run was stopped when {where} hung")
        if self.json_path:
            self.write_results(self.results_json())
        capture = self.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:          # write past pytest's capture of the hung test's output
            capture.suspend_global_capture(in_=False)
        sys.stderr.write(f"\n{self.summary_line()}\ngrading stopped: {where} hung in {nodeid}\n")
        sys.stderr.flush()
        os._exit(1)

    # --- outcomes -----------------------------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        record = self.records.get(item.nodeid)
        if record is None:
            return
        if call.when == "teardown":
            self.done.add(item.nodeid)
        excinfo = call.excinfo
        if report.failed and excinfo is not None and excinfo.errisinstance((GradedTimeout, Tampered,
                                                                              guard.GradedCallError)):
            report.longrepr = f"{type(excinfo.value).__name__}: {excinfo.value}"
        elif report.failed and excinfo is not None and excinfo.errisinstance(NotImplementedError):
            record.not_implemented = not_implemented_name(excinfo)
            report.longrepr = f"not implemented: {record.not_implemented}"
        elif report.failed and excinfo is not None and excinfo.errisinstance(implementation.ImplementationImportError):
            report.longrepr = str(excinfo.value)
        if report.failed:
            record.outcome = "failed"
            record.output.append(f"[{report.when}] {report.longreprtext}"[:OUTPUT_LIMIT])
        elif report.when == "call" and report.passed and record.outcome == "pending":
            record.outcome = "passed"
        elif report.skipped and record.outcome in ("pending", "passed"):
            record.outcome = "skipped"
            record.output.append(f"skipped: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else ''}")

    # --- the report -----------------------------------------------------------------------------------

    def totals(self) -> tuple[float, float, int, int]:
        self._close_pending()
        counted = [r for r in self.records.values() if r.outcome != "skipped"]
        return (sum(r.score for r in counted), sum(r.max_score for r in counted),
                sum(r.outcome == "passed" for r in counted), len(counted))

    def _close_pending(self) -> None:
        """A graded test that never ran (the run stopped early: -x, an interrupt) fails: it earned nothing."""
        for record in self.records.values():
            if record.outcome == "pending":
                record.outcome = "failed"
                record.output.append(f"not run: {self.import_error or 'the grading run stopped before this test'}")

    def missing(self) -> list[str]:
        return sorted({r.not_implemented.split(".")[0] for r in self.records.values() if r.not_implemented})

    def summary_line(self) -> str:
        score, max_score, passed, total = self.totals()
        line = (f"graded {implementation.selected()}: {score:.2f} / {max_score:.2f} points "
                f"({passed}/{total} graded tests passed)")
        if self.missing():
            line += f"; not implemented: {', '.join(self.missing())}"
        if self.import_error:
            line += f"; NOT GRADED: {self.import_error}"
        return line

    def pytest_terminal_summary(self, terminalreporter):
        if not self.records:
            return
        verbose = (self.json_path or self.hidden_dir or self.config.getoption("impl")
                   or self.config.getoption("verbose") > 0)
        terminalreporter.section("grading")
        if verbose and not self.import_error:
            for record in self.records.values():
                if record.outcome != "skipped":
                    mark = "PASS" if record.outcome == "passed" else "FAIL"
                    terminalreporter.write_line(f"{mark} {record.score:5.2f} / {record.max_score:5.2f}  {record.name}")
        if self.import_error:
            terminalreporter.write_line(f"NOT GRADED: {self.import_error}", red=True, bold=True)

    def results_json(self) -> dict:
        score, max_score, _, _ = self.totals()
        tests = [{
            "name": r.name, "score": round(r.score, 6), "max_score": round(r.max_score, 6),
            "status": "passed" if r.outcome == "passed" else "failed",
            "output": "\n".join(r.output) if r.output else "passed", "visibility": r.visibility,
        } for r in self.records.values() if r.outcome != "skipped"]
        output = self.summary_line() if not self.import_error else f"{self.import_error}\n{self.summary_line()}"
        return {"score": round(score, 6), "execution_time": round(time.time() - self.start, 3),
                "output": output, "visibility": "visible", "stdout_visibility": "hidden",
                "tests": tests, "extra_data": {"max_score": round(max_score, 6)}}

    def write_results(self, results: dict, retry: bool = False) -> None:
        """results.json replaced atomically (a temporary file in the same folder, then os.replace); whatever
        is at the path (a folder, a link) is removed first if the replace fails. A failure is reported and
        makes the exit status 3 (pytest's internal error)."""
        path = Path(self.json_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(results, indent=2))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.replace(tmp, path)
            except OSError:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
                os.replace(tmp, path)
            self.write_failed = None
        except PermissionError:
            if not retry:                   # graded code may have made the folder read-only: it is ours again
                try:
                    os.chmod(path.parent, os.stat(path.parent).st_mode | 0o700)
                except OSError:
                    pass
                return self.write_results(results, retry=True)
            self.write_failed = f"could not write {path}: permission denied"
            sys.stderr.write(f"\ngrading: {self.write_failed}\n")
        except OSError as err:
            self.write_failed = f"could not write {path}: {err}"
            sys.stderr.write(f"\ngrading: {self.write_failed}\n")

    def pytest_sessionfinish(self, session):
        if self.sandbox is not None:
            sandbox.activate(None)
            self.sandbox.stop()                     # every process of the package's, before the results
        if self.records and self.import_error:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.json_path:
            self.write_results(self.results_json())
            if self.write_failed:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config):
        if self.sandbox is not None:
            sandbox.activate(None)
            self.sandbox.stop()
        if self.records:                            # the score is the last line of a grading run
            reporter = config.pluginmanager.getplugin("terminalreporter")
            line = self.summary_line()
            if reporter is not None:
                reporter.write_line(line, bold=True)
            else:
                print(line)
