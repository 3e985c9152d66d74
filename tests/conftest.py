import openmp_first  # noqa: F401  (before torch: the CLI's OpenMP wait policy, see tests/openmp_first.py)
import sandbox_start  # noqa: F401  (before torch: a graded package's supervisor imports beside the grader, see there)
# isort: split
import os
import subprocess
from pathlib import Path

import pytest
import torch

import grading
import guard
import implementation

if os.environ.get("PYTEST_XDIST_WORKER") and not any(os.environ.get(v) for v in ("CS336_NUM_THREADS",
                                                                                 "OMP_NUM_THREADS")):
    # Under pytest-xdist every core already runs a worker: a second OpenMP thread per worker only waits
    # for a core, and a parallel region is as slow as its slowest thread (a notebook's roofline ran 3x
    # slower beside one busy core). One thread here, and in every process a test starts (notebook
    # kernels, the lecture, servers, the mutation check's shards), which read the variable.
    os.environ["CS336_NUM_THREADS"] = "1"
torch.set_num_threads(1 if os.environ.get("CS336_NUM_THREADS") == "1" else max(1, min(2, torch.get_num_threads())))


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



# `serve --model target`, launched as soon as collection shows a test needs it, so it boots (torch,
# the model, the engine: a few seconds of one core) while the tests before that run.
TOY_SERVER_ARGS = ("target", "--max-num-seqs", "64")
_early_servers: dict = {}


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: only tests that will run count
def pytest_collection_modifyitems(session, config, items):
    import importlib.util

    if importlib.util.find_spec("fastapi") and any("toy_server" in getattr(i, "fixturenames", ()) for i in items):
        from http_server import Server

        _early_servers["toy"] = Server.start(*TOY_SERVER_ARGS)


def pytest_sessionfinish(session, exitstatus):
    for server in _early_servers.values():
        server.stop()


@pytest.fixture(scope="session")
def toy_server():
    """One `serve --model target` process on a free 127.0.0.1 port for the whole session (tests/http_server.py)."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    from http_server import Server

    if "toy" not in _early_servers:
        _early_servers["toy"] = Server.start(*TOY_SERVER_ARGS)
    yield _early_servers["toy"].wait_ready()
