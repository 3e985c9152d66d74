import cs336_inference  # noqa: F401  (before torch: OpenMP's passive wait policy, see cs336_inference/_openmp.py)
# isort: split
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
