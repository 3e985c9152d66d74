import cs336_inference  # noqa: F401  (before torch: OpenMP's passive wait policy, see cs336_inference/_openmp.py)
# isort: split
import os
import subprocess
from pathlib import Path

import pytest
import torch

import grading
import guard
import implementation

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_addoption(parser):
    grading.add_options(parser)


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): points of a hidden graded test (shared by its parametrized cases)")
    config.addinivalue_line("markers", "visibility(v): Gradescope visibility of a hidden graded test")
    spec = config.getoption("impl")
    try:
        implementation.select(spec if spec is not None else os.environ.get(implementation.ENV_VAR))
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    guard.install_interrupt_handler()
    config.pluginmanager.register(grading.Grader(config), "cs336-grader")


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared, oversubscribed CPU the
    threads' synchronisation dominates every small op; one thread keeps these tests fast."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def git_tree_unchanged():
    """The test must leave `git status --porcelain` as it found it: no new, changed or deleted file
    that git sees (outputs go to git-ignored scratch folders). Skipped outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def status():
        proc = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else None

    before = status()
    yield
    if before is not None:
        after = status()
        assert after == before, f"the run changed the git tree:\nbefore:\n{before}\nafter:\n{after}"
