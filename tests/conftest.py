import cs336_inference  # noqa: F401  (before torch: OpenMP's passive wait policy, see cs336_inference/_openmp.py)
# isort: split
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


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
