"""adapters.each: many graded calls of one function in one message to a student's worker (tests/sandbox.py
`each`, `call_many`). A batch must be indistinguishable from the same calls made one by one: the same results,
the same torch.Generator and global RNG states after it, the first call that raises ends it with that exception
and the states from before that call, a refused result is refused, a missing function is reported, and methods
of a graded object work too. The reference here is the calls made one by one in the same test.

The hidden tests below run in a grading run of their own (through pytest in this process, as
tests/library/test_grader.py does), once with a package in its worker process and once in-process."""

import json
import textwrap

from test_grader import ROOT, grade

HIDDEN = '''
import pytest
import torch
from adapters import each, make_block_allocator, run_greedy_verify, run_sample_next_token


def _rows(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 6, generator=g) for _ in range(n)]


def _calls(rows, g):
    """Every second call draws from `g`, the others from torch's global RNG."""
    return [(x, 1.0, None, None, g if i % 2 else None) for i, x in enumerate(rows)]


def _one_by_one(rows, seed=7):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(3)
    got = []
    for args in _calls(rows, g):
        try:
            got.append(run_sample_next_token(*args))
        except ValueError:
            break
    return got, torch.get_rng_state(), g.get_state()


@pytest.mark.parametrize("n", [1, 2, 60])
def test_a_batch_draws_what_the_calls_one_by_one_draw(n):
    rows = _rows(n)
    want, rng, state = _one_by_one(rows)
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(3)
    got = each(run_sample_next_token, _calls(rows, g))
    assert len(got) == n and all(type(t) is torch.Tensor and torch.equal(t, w) for t, w in zip(got, want))
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG after the batch"
    assert torch.equal(g.get_state(), state), "the generator after the batch"
    if n == 60:
        assert len({int(t) for t in got}) > 1, "the draws differ from call to call"
        assert not torch.equal(state, torch.Generator().manual_seed(3).get_state()), "the generator was used"


def test_the_first_call_that_raises_ends_the_batch_with_the_states_from_before_it():
    rows = _rows(20)
    rows[13] = torch.full((1, 6), float("nan"))                # refused by sample_next_token (ValueError)
    want, rng, state = _one_by_one(rows)
    assert len(want) == 13
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError):
        each(run_sample_next_token, _calls(rows, g))
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(g.get_state(), state)
    again = each(run_sample_next_token, _calls(_rows(4), g))    # the test goes on: the next batch still runs
    assert len(again) == 4


@pytest.mark.parametrize("index", [0, 9])
def test_package_a_call_that_draws_then_raises_leaves_the_states_from_before_it(index):
    rows = _rows(12)
    rows[index] = rows[index].clone()
    rows[index][0, 0] = 43.0                                   # the package draws, then raises ValueError
    want, rng, state = _one_by_one(rows)
    assert len(want) == index
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="forty-three"):
        each(run_sample_next_token, _calls(rows, g))
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(g.get_state(), state)


def test_a_batch_of_method_calls_of_a_graded_object():
    alloc = make_block_allocator(6, 2)
    first, second, third = alloc.allocate(), alloc.allocate(), alloc.allocate()
    alloc.incref(second)
    want = [alloc.ref_count(b) for b in range(6)]
    assert sorted(want) == [0, 0, 0, 1, 1, 2] and want[first] == want[third] == 1 and want[second] == 2
    assert each(alloc.ref_count, [(b,) for b in range(6)]) == want
    assert each(alloc.ref_count, []) == []


@pytest.fixture
def allocator():
    alloc = make_block_allocator(4, 2)
    yield alloc
    block = alloc.allocate()                                    # graded calls after the test's call phase
    assert alloc.ref_count(block) == 1


def test_a_fixture_makes_graded_calls_after_the_call_phase(allocator):
    """The worker's end-of-test check is sent early only when nothing of the test runs after its call phase."""
    assert each(allocator.ref_count, [(b,) for b in range(4)]) == [0] * 4


def test_package_a_refused_result_fails_the_batch():
    rows = _rows(10)
    rows[4] = torch.full((1, 6), 42.0)                         # the package returns a str for it
    with pytest.raises(AssertionError, match="must return a torch.Tensor"):
        each(run_sample_next_token, [(x,) for x in rows])


def test_package_a_missing_function_is_reported():
    with pytest.raises(NotImplementedError, match="not implemented: greedy_verify"):
        each(run_greedy_verify, [([1], torch.zeros(2, 4))] * 5)


def test_package_a_function_that_does_more_than_one_graded_call_is_refused():
    with pytest.raises(TypeError, match="exactly one graded call"):
        each(lambda x: (run_sample_next_token(x), run_sample_next_token(x)), [(r,) for r in _rows(3)])
'''

PACKAGE = '''
from cs336_inference.homework import reference as _r

globals().update({k: getattr(_r, k) for k in dir(_r) if not k.startswith("_")})
del greedy_verify


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    if float(logits.flatten()[0]) == 42.0:
        return "not a tensor"
    if float(logits.flatten()[0]) == 43.0:
        _r.sample_next_token(logits, temperature, top_k, top_p, generator)
        raise ValueError("forty-three")
    return _r.sample_next_token(logits, temperature, top_k, top_p, generator)
'''


_HIDDEN_DIR: list = []


def _grade(tmp_path, select, *extra):
    if not _HIDDEN_DIR:               # one folder for the whole module (pytest imports test_each.py once per process)
        _HIDDEN_DIR.append(tmp_path / "hidden")
        _HIDDEN_DIR[0].mkdir()
        (_HIDDEN_DIR[0] / "test_each.py").write_text(HIDDEN)
    hidden = _HIDDEN_DIR[0]
    out = tmp_path / "results.json"
    rc, log = grade(ROOT / "tests" / "graded" / "test_batch_sampler.py", "-k", select, "--hidden-tests", hidden,
                    "--grade-json", out, *extra)
    assert out.exists(), log[-3000:]
    return rc, {t["name"]: t for t in json.loads(out.read_text())["tests"]}, log


def test_a_batch_in_the_worker_behaves_as_the_calls_one_by_one(tmp_path):
    package = tmp_path / "batchy"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    rc, tests, log = _grade(tmp_path, "test_each", "--impl", package)
    assert rc == 0, log[-3000:]
    assert len(tests) == 11 and all(t["status"] == "passed" for t in tests.values()), tests


def test_each_in_process_is_the_loop(tmp_path):
    rc, tests, log = _grade(tmp_path, "test_each and not package")
    assert rc == 0, log[-3000:]
    assert len(tests) == 6 and all(t["status"] == "passed" for t in tests.values()), tests
