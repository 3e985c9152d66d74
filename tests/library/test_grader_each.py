"""adapters.each and adapters.script: many graded calls in one message to a student's worker (tests/sandbox.py
`script`; `each` is a script of calls of one function). A batch must be indistinguishable from the same calls made
one by one: the same results, the same torch.Generator and global RNG states after it, the first call that raises
ends it with that exception and the states from before that call, a refused result is refused, a missing function
is reported, and methods of a graded object work too; a script mixes graded functions, methods of graded objects
and attribute reads. The reference here is the calls made one by one in the same test.

The hidden tests below run in a grading run of their own (through pytest in this process, as
tests/library/test_grader.py does), once with a package in its worker process and once in-process."""

import json
import textwrap

from test_grader import ROOT, grade

HIDDEN = '''
from functools import partial

import pytest
import torch
from adapters import each, make_block_allocator, run_greedy_verify, run_sample_next_token, script


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


def _mixed(alloc, rows, g):
    """Steps of a script: methods of a graded object (`free` first called inside a step), an attribute read, a
    graded function drawing from `g` and from torch's global RNG; none depends on another's result."""
    return [alloc.allocate, alloc.allocate, partial(alloc.incref, 0), lambda: alloc.num_free,
            partial(run_sample_next_token, rows[0], 1.0, None, None, g), partial(alloc.ref_count, 0),
            lambda: alloc.free(1), partial(run_sample_next_token, rows[1]), lambda: alloc.num_free,
            partial(alloc.ref_count, 1), partial(run_sample_next_token, rows[2], 1.0, None, None, g)]


def _mixed_one_by_one(rows, upto=None):
    torch.manual_seed(7)
    g, alloc = torch.Generator().manual_seed(3), make_block_allocator(4, 2)
    got = [step() for step in _mixed(alloc, rows, g)[:upto]]
    return got, torch.get_rng_state(), g.get_state(), alloc


def test_a_script_of_mixed_steps_is_the_steps_one_by_one():
    rows = _rows(3)
    want, rng, state, _ = _mixed_one_by_one(rows)
    assert want[:4] == [0, 1, None, 2] and want[5:7] == [2, True] and want[8:10] == [3, 0]
    torch.manual_seed(7)
    g, alloc = torch.Generator().manual_seed(3), make_block_allocator(4, 2)
    got = script(*_mixed(alloc, rows, g))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b) and (torch.equal(a, b) if type(a) is torch.Tensor else a == b)
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG after the script"
    assert torch.equal(g.get_state(), state), "the generator after the script"
    assert alloc.num_free == 3 and script() == []


def test_package_the_first_step_that_raises_ends_the_script_with_the_states_from_before_it():
    rows = _rows(3)
    rows[1] = rows[1].clone()
    rows[1][0, 0] = 43.0                                     # the package draws, then raises ValueError
    want, rng, state, ref = _mixed_one_by_one(rows, upto=7)  # the steps before the one that raises
    torch.manual_seed(7)
    g, alloc = torch.Generator().manual_seed(3), make_block_allocator(4, 2)
    with pytest.raises(ValueError, match="forty-three"):
        script(*_mixed(alloc, rows, g))
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(g.get_state(), state)
    assert alloc.num_free == ref.num_free == 3, "the steps before it ran, the steps after it did not"
    assert [alloc.ref_count(b) for b in range(4)] == [ref.ref_count(b) for b in range(4)] == [2, 0, 0, 0]


def test_a_refused_step_fails_the_script_and_the_steps_after_it_do_not_run():
    alloc = make_block_allocator(4, 2)
    with pytest.raises(ValueError):
        script(alloc.allocate, partial(alloc.free, 3), alloc.allocate)    # block 3 is free: refused
    assert alloc.num_free == 3


def test_package_a_refused_result_fails_the_script():
    alloc = make_block_allocator(4, 2)
    with pytest.raises(AssertionError, match="must return a torch.Tensor"):
        script(alloc.allocate, partial(run_sample_next_token, torch.full((1, 6), 42.0)), alloc.allocate)
    assert alloc.num_free == 3


def test_package_a_missing_function_in_a_script_is_reported_after_the_steps_before_it():
    alloc = make_block_allocator(4, 2)
    with pytest.raises(NotImplementedError, match="not implemented: greedy_verify"):
        script(alloc.allocate, partial(run_greedy_verify, [1], torch.zeros(2, 4)), alloc.allocate)
    assert alloc.num_free == 3


def test_package_each_call_gets_its_own_copy_of_a_tensor_argument():
    x = torch.zeros(1, 6)
    x[0, 0] = 44.0                                              # the package writes into it after drawing
    torch.manual_seed(0)
    want = [run_sample_next_token(x) for _ in range(3)]
    assert [int(t) for t in want] == [0, 0, 0]
    torch.manual_seed(0)
    got = each(run_sample_next_token, [(x,)] * 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and x[0, 0] == 44.0


def test_package_a_script_step_must_make_one_graded_call_whose_arguments_are_known():
    alloc = make_block_allocator(4, 2)
    with pytest.raises(TypeError, match="exactly one graded call"):
        script(lambda: (alloc.allocate(), alloc.allocate()))
    with pytest.raises(TypeError, match="exactly one graded call"):
        script(lambda: None)
    with pytest.raises(TypeError):
        script(lambda: alloc.free(alloc.allocate()))               # a result used as an argument
    assert alloc.num_free == 4 and alloc.allocate() == 0
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
    if float(logits.flatten()[0]) == 44.0:
        out = _r.sample_next_token(logits, temperature, top_k, top_p, generator)
        logits[..., 0] = -1e9
        return out
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
    assert len(tests) == 18 and all(t["status"] == "passed" for t in tests.values()), tests


def test_each_in_process_is_the_loop(tmp_path):
    rc, tests, log = _grade(tmp_path, "test_each and not package")
    assert rc == 0, log[-3000:]
    assert len(tests) == 8 and all(t["status"] == "passed" for t in tests.values()), tests
