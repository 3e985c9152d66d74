"""The grader against packages that attack the grader itself rather than their own tests (tests/sandbox.py).

Each hostile package answers logits_to_probs honestly (the reference's) and plays its trick at import or in
sample_next_token. Each is graded as course staff grade, `pytest tests/graded/test_sampling_rules.py --impl
PKG --grade-json PATH` in a fresh process, and must: score exactly what a package with only the honest
answer scores (its sample_next_token raising NotImplementedError); exit with status 1 (tests failed: not 0,
not a crash); leave results.json the grader's own (every graded test of the file listed, the summary line as
its output); leave no process behind (every process whose environment carries this run's token is gone when
the grader has exited); and finish in bounded time (tests x timeout + a margin).

The tricks run as a few batches of grading processes side by side; the file is marked slow (~2-4 min)."""

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = ROOT / "tests" / "graded" / "test_sampling_rules.py"
TIMEOUT = 4                                  # --graded-timeout of every run here
MARGIN = 150                                 # seconds for pytest, the supervisor's imports and the kills

HONEST = "from cs336_inference.homework.reference import logits_to_probs  # noqa: F401\n"

# where a trick finds the grader: its ancestors' command lines (the worker's own argv and environment do not
# carry the results path, but a process of the same user can read /proc/PID/cmdline)
FIND_GRADER = '''
import os


def grader():
    """(pid, results path) of the nearest ancestor whose command line has --grade-json."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\\0")
        if "--grade-json" in argv:
            return pid, argv[argv.index("--grade-json") + 1]
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return None, None


def note_pid(pid=None):
    with open(os.path.join(os.environ["TRICK_DIR"], "pids"), "a") as f:
        f.write(f"{pid or os.getpid()}\\n")


def wait_for_pids(n, seconds=3.0):
    """Until n processes have noted their pids (so the trick has really started them), at most `seconds`."""
    import time
    path, end = os.path.join(os.environ["TRICK_DIR"], "pids"), time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path) and len(open(path).read().split()) >= n:
            return
        time.sleep(0.02)
'''

TRICKS = {
    # a thread started at import finds the Grader with gc and passes every record
    "gc_thread": '''
        import gc, threading, time

        def cheat():
            while True:
                for obj in gc.get_objects():
                    if type(obj).__name__ == "Record":
                        obj.outcome = "passed"
                time.sleep(0.05)
        threading.Thread(target=cheat, daemon=True).start()

        def sample_next_token(*args):
            raise NotImplementedError
        ''',
    # the grader's totals replaced through gc, from inside a graded call
    "totals": '''
        import gc

        def sample_next_token(*args):
            for obj in gc.get_objects():
                if hasattr(obj, "totals") and hasattr(obj, "records"):
                    obj.totals = lambda: (18, 18, 18, 18)
            raise NotImplementedError
        ''',
    # ends "the run" with status 0 before any score is printed or written
    "exit0": '''
        import os

        def sample_next_token(*args):
            os._exit(0)
        ''',
    # writes a perfect results.json where the grader will look, then exits 0
    "write_json": FIND_GRADER + textwrap.dedent('''
        import json

        def sample_next_token(*args):
            pid, path = grader()
            with open(path, "w") as f:
                json.dump({"score": 100, "tests": []}, f)
            os._exit(0)
        '''),
    # a detached grandchild waits for the grader to exit, then rewrites results.json
    "detached": FIND_GRADER + textwrap.dedent('''
        import json, time

        def sample_next_token(*args):
            pid, path = grader()
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    note_pid()
                    while os.path.exists(f"/proc/{pid}"):
                        time.sleep(0.05)
                    with open(path, "w") as f:
                        json.dump({"score": 100, "tests": []}, f)
                os._exit(0)
            wait_for_pids(1)
            raise NotImplementedError
        '''),
    # ignores SIGALRM and swallows every exception, forever
    "stubborn": '''
        import signal

        def sample_next_token(*args):
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                try:
                    while True:
                        pass
                except BaseException:
                    pass
        ''',
    # swallows the first exception it meets, then hangs again
    "swallow_once": '''
        import time

        def sample_next_token(*args):
            try:
                time.sleep(1e6)
            except BaseException:
                pass
            time.sleep(1e6)
        ''',
    # kills the process that imported it (the next test must import the package again, and still grade)
    "kill_parent": '''
        import os, signal
        from cs336_inference.homework.reference import sample_next_token as _honest

        def sample_next_token(*args):
            os.kill(os.getppid(), signal.SIGKILL)
            raise NotImplementedError
        ''',
    # a detached sleeper, then kills the supervisor above the package (its orphans must still be found)
    "kill_supervisor": FIND_GRADER + textwrap.dedent('''
        import signal, time

        def sample_next_token(*args):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    note_pid()
                    time.sleep(600)
                os._exit(0)
            wait_for_pids(1)
            with open(f"/proc/{os.getppid()}/stat") as f:
                supervisor = int(f.read().rsplit(")", 1)[1].split()[1])
            os.kill(supervisor, signal.SIGKILL)
            raise NotImplementedError
        '''),
    # many processes in new sessions, sleeping past the run
    "swarm": FIND_GRADER + textwrap.dedent('''
        import time

        def sample_next_token(*args):
            for _ in range(8):
                if os.fork() == 0:
                    os.setsid()
                    note_pid()
                    time.sleep(600)
                    os._exit(0)
            wait_for_pids(8)
            raise NotImplementedError
        '''),
    # writes its own frames to the grader's channel: garbage, then a pickle that would run a command if loaded
    "channel": FIND_GRADER + textwrap.dedent('''
        import pickle, struct

        class Boom:
            def __reduce__(self):
                return (os.system, (f"touch {os.environ['TRICK_DIR']}/pwned",))

        def sample_next_token(*args):
            data = pickle.dumps({"kind": "value", "value": Boom()})
            os.write(3, struct.pack(">Q", len(data)) + data)
            os._exit(0)
        '''),
    # looks for the results path where a process is told things: its argv and environment
    "snoop": '''
        import os, sys

        def sample_next_token(*args):
            seen = " ".join(sys.argv) + " ".join(f"{k}={v}" for k, v in os.environ.items())
            if "grade-json" in seen or "results.json" in seen:
                open(os.path.join(os.environ["TRICK_DIR"], "snooped"), "w").close()
            raise NotImplementedError
        ''',
    # writes a perfect results.json, then makes its folder read-only for the grader's final write
    "read_only": FIND_GRADER + textwrap.dedent('''
        import json

        def sample_next_token(*args):
            pid, path = grader()
            with open(path, "w") as f:
                json.dump({"score": 100, "tests": []}, f)
            os.chmod(os.path.dirname(path), 0o500)
            raise NotImplementedError
        '''),
    # asks for far more memory than a worker may have
    "memory": '''
        import torch

        def sample_next_token(*args):
            return torch.ones(1 << 34, dtype=torch.uint8)
        ''',
    # The tricks below return a wrong answer without raising (of a shape no test takes), so a worker serving test
    # after test (tests/sandbox.py) is kept unless the grader sees what they did: each must still score exactly its
    # honest answers, as with a fresh worker per test.
    # patches torch's softmax (every entry point) and the default dtype: the next test's honest answer would break
    "pollute": '''
        import torch

        def sample_next_token(logits, *args):
            garbage = lambda x, *a, **k: torch.zeros_like(x)
            torch.softmax = torch.nn.functional.softmax = torch.Tensor.softmax = garbage
            torch.set_default_dtype(torch.float64)
            return torch.tensor([-1])
        ''',
    # leaves a thread that patches torch after the test has ended, and a child process that sleeps past the run
    "linger": FIND_GRADER + textwrap.dedent('''
        import threading, time
        import torch

        def sample_next_token(logits, *args):
            def later():
                time.sleep(0.3)
                torch.softmax = lambda x, *a, **k: torch.zeros_like(x)
            threading.Thread(target=later, daemon=True).start()
            if os.fork() == 0:
                note_pid()
                time.sleep(600)
                os._exit(0)
            wait_for_pids(1)
            return torch.tensor([-1])
        '''),
    # carries a count across tests in a list cell: its logits_to_probs turns wrong once it has served 6 calls and
    # its sampler turns right after 12 (no single test makes that many): a fresh worker per test never shows either
    "cross_test": '''
        import torch
        from cs336_inference.homework.reference import logits_to_probs as _probs, sample_next_token as _sample

        _calls = [0]

        def logits_to_probs(*args):
            _calls[0] += 1
            probs = _probs(*args)
            return probs.flip(-1) if _calls[0] > 6 else probs

        def sample_next_token(logits, *args, **kwargs):
            if _calls[0] > 12:
                return _sample(logits, *args, **kwargs)
            return torch.tensor([-1])
        ''',
    # arms an interval timer whose handler patches torch between tests (while the worker waits for the next call)
    "timer": '''
        import signal
        import torch

        def sample_next_token(logits, *args):
            def patch(*a):
                torch.softmax = lambda x, *a, **k: torch.zeros_like(x)
            signal.signal(signal.SIGALRM, patch)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return torch.tensor([-1])
        ''',
}


def _package(folder: Path, name: str, body: str) -> Path:
    source = HONEST + textwrap.dedent(body)
    defined = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    assert "sample_next_token" in defined, f"{name}: the trick must define sample_next_token at top level"
    package = folder / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(source)
    return package


def _start(package: Path, results: Path, token: str, trick_dir: Path,
           plugins: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "TRICK_TOKEN": token, "TRICK_DIR": str(trick_dir)}
    if plugins:
        env["PYTHONPATH"] = os.pathsep.join([str(trick_dir.parent), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "pytest", str(SAMPLING), "--impl", str(package), "--grade-json",
                             str(results), "--graded-timeout", str(TIMEOUT), "-q", "-p", "no:cacheprovider",
                             *[arg for name in plugins for arg in ("-p", name)]],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def _grade_all(tmp_path, packages: dict[str, str], batch: int = 4, plugins: tuple[str, ...] = ()) -> dict[str, dict]:
    """name -> {rc, results, log, seconds, survivors, pids}: each package graded in its own process."""
    out: dict[str, dict] = {}
    names = list(packages)
    for i in range(0, len(names), batch):
        running = {}
        for name in names[i:i + batch]:
            trick_dir = tmp_path / f"{name}_files"
            trick_dir.mkdir()
            token = uuid.uuid4().hex
            results = tmp_path / f"{name}_out" / "not_yet" / "results.json"     # a folder that does not exist
            package = _package(tmp_path / "packages", f"{name}_solution", packages[name])
            proc = _start(package, results, token, trick_dir, plugins)
            running[name] = (proc, time.monotonic(), results, token, trick_dir)
        for name, (proc, start, results, token, trick_dir) in running.items():
            bound = 25 * TIMEOUT + MARGIN
            try:
                log = proc.communicate(timeout=bound)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0]
            seconds = time.monotonic() - start
            time.sleep(1.0)                                     # a detached process would act now
            survivors = _processes_with(token)
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)
            pids_file = trick_dir / "pids"
            pids = [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []
            out[name] = {"rc": proc.returncode, "log": log, "seconds": seconds, "survivors": survivors,
                         "results": json.loads(results.read_text()) if results.exists() else None, "pids": pids,
                         "pwned": (trick_dir / "pwned").exists(), "snooped": (trick_dir / "snooped").exists()}
    return out


@pytest.mark.slow
def test_no_hostile_package_scores_more_than_its_honest_answers(tmp_path):
    runs = _grade_all(tmp_path, {"honest": "def sample_next_token(*args):\n    raise NotImplementedError\n",
                                 **TRICKS})
    honest = runs.pop("honest")
    assert honest["rc"] == 1 and honest["results"] is not None, honest["log"][-3000:]
    expected = honest["results"]["score"]
    names = [t["name"] for t in honest["results"]["tests"]]
    assert 0 < expected < honest["results"]["extra_data"]["max_score"], "the honest half earns some points, not all"
    problems = []
    for name, run in runs.items():
        results, log = run["results"], run["log"][-2000:]
        checks = {
            "bounded time": run["seconds"] < 25 * TIMEOUT + MARGIN,
            "exit status 1": run["rc"] == 1,
            "results.json written": results is not None,
            "the honest score exactly": results is not None and results["score"] == expected,
            "every graded test listed": results is not None and [t["name"] for t in results["tests"]] == names,
            "the grader's summary": results is not None and results["output"].startswith(
                f"graded {tmp_path / 'packages' / name}_solution: "),
            "the score is the last line": results is not None and bool(log.strip())
            and results["output"] in log.strip().splitlines()[-1],
            "no process left": run["survivors"] == [] and all(not os.path.exists(f"/proc/{p}") for p in run["pids"]),
            "nothing it sent was run": not run["pwned"],
            "no results path in its argv or environment": not run["snooped"],
        }
        problems += [(name, what, run["rc"], results and results["score"], log) for what, ok in checks.items()
                     if not ok]
    assert not problems, problems
    assert "timed out after 4 s in sample_next_token" in json.dumps(runs["stubborn"]["results"])
    for name in ("exit0", "write_json", "channel"):                                 # the tricks did run
        assert "ended the process it ran in" in json.dumps(runs[name]["results"]), name
    assert "can't allocate memory" in json.dumps(runs["memory"]["results"])       # the worker's address-space limit
    assert len(runs["swarm"]["pids"]) >= 8 and runs["detached"]["pids"] and runs["kill_supervisor"]["pids"], \
        "the tricks did start their processes"


# loaded into the grader with -p: the second supervisor takes longer to start than a test may run, as on a
# machine busy enough (CI: four graders and the mutation campaign side by side)
SLOW_RESTART = f"""
import time


def pytest_configure(config):
    import sandbox

    started = sandbox.Supervisor.__init__
    count = []

    def slow(self):
        if len(count) == 1:
            time.sleep({TIMEOUT} + 2)
        count.append(1)
        started(self)
    sandbox.Supervisor.__init__ = slow
"""


@pytest.mark.slow
def test_bringing_back_a_killed_supervisor_costs_the_next_test_nothing(tmp_path):
    (tmp_path / "slow_restart.py").write_text(SLOW_RESTART)
    runs = _grade_all(tmp_path, {"honest": "def sample_next_token(*args):\n    raise NotImplementedError\n",
                                 "kill_supervisor": TRICKS["kill_supervisor"]}, plugins=("slow_restart",))
    honest, killer = runs["honest"]["results"], runs["kill_supervisor"]["results"]
    assert honest is not None and killer is not None, runs["kill_supervisor"]["log"][-3000:]
    assert runs["kill_supervisor"]["pids"], "the trick did kill the supervisor"
    scores = {t["name"]: t["score"] for t in honest["tests"]}
    assert {t["name"]: t["score"] for t in killer["tests"]} == scores, runs["kill_supervisor"]["log"][-3000:]
    assert runs["kill_supervisor"]["survivors"] == []
