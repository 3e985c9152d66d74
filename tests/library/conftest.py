"""Session fixtures for the slow lecture tests: the two ways of running the lecture (the CLI, the README's
command, and edtrace's trace, docs/lecture.md's), each run once per session (the tests that read them are
one `xdist_group`, so under pytest-xdist they share a worker). test_lecture.py and test_lecture_trace.py
share them, and the determinism test compares the two runs' live numbers. Also the serving engine tests' toy
target and corpus text (`model`, `text`: one per module; a module that defines its own keeps it)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LectureRun:
    returncode: int
    stdout: str
    stderr: str
    tree_change: str          # what `git status --porcelain` shows after the run but not before ("" outside git)
    trace_dir: Path | None    # where edtrace wrote lecture_10.json (None for the CLI run)

    def failure(self) -> str:
        return f"lecture failed:\n{self.stdout[-3000:]}\n{self.stderr[-5000:]}"


def _git_status() -> str | None:
    proc = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def _run(command: list[str], trace_dir: Path | None = None) -> LectureRun:
    env = {k: v for k, v in os.environ.items() if k != "CS336_FIGURES"}   # the default output folders
    env.update(MPLBACKEND="Agg", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = _git_status()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    after = _git_status()
    change = "" if before is None else "\n".join(sorted(set(after.splitlines()) ^ set(before.splitlines())))
    return LectureRun(proc.returncode, proc.stdout, proc.stderr, change, trace_dir)


@pytest.fixture(scope="session")
def lecture_cli_run() -> LectureRun:
    """`python -m cs336_inference lecture`, the README's main command."""
    return _run([sys.executable, "-m", "cs336_inference", "lecture"])


@pytest.fixture(scope="session")
def lecture_trace_run(tmp_path_factory) -> LectureRun:
    """`python -m edtrace.execute -m lecture_10 -o DIR` from the repository root (the venv has lecture/
    on its path, see .ci/setup): the whole lecture again, under edtrace's line tracer."""
    out = tmp_path_factory.mktemp("trace")
    return _run([sys.executable, "-m", "edtrace.execute", "-m", "lecture_10", "-o", str(out)], trace_dir=out)


@pytest.fixture(scope="session")
def lecture_class_trace_run(tmp_path_factory) -> LectureRun:
    """`python -m edtrace.execute -m lecture_10_class -o DIR`: the class path (no deep dives) under edtrace's
    line tracer; it writes DIR/lecture_10_class.json, whose source file is lecture/lecture_10.py."""
    out = tmp_path_factory.mktemp("class_trace")
    return _run([sys.executable, "-m", "edtrace.execute", "-m", "lecture_10_class", "-o", str(out)], trace_dir=out)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` under pytest 9: xdist 3.8 puts a test's `xdist_group` into its id (the
    scheduler groups by the "@group" suffix) through an attribute pytest 9 no longer reads, so the
    groups were ignored and both workers ran the whole lecture twice. After xdist's own hook, add the
    suffix where it is missing (pytest 8: already there)."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id   # pytest >= 9
    except ImportError:
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid:
            group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            item._id = coerce_node_id(f"{item.nodeid}@{group}")


# --- the serving engine tests (test_engine_api.py, test_engine_speculative.py, test_engine_feature_proposers.py) ---


@pytest.fixture(scope="module")
def model():
    """The shipped toy target, in eval mode."""
    from cs336_inference.model import load_pretrained
    return load_pretrained("target").eval()


@pytest.fixture(scope="module")
def text() -> list[int]:
    """4,000 tokens of the validation corpus."""
    import adapters
    return adapters.run_load_corpus("val")[:4000].tolist()
