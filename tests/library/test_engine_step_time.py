"""`Engine(model, step_time=cost)`: the simulated clock advances by a cost model instead of the
measured wall time, so a replay is identical run to run (the lecture's serving and paging demos
depend on it). Checked against the cost model itself and a second run; bad costs fail clearly."""

from __future__ import annotations

import time

import pytest

import adapters
from cs336_inference.model import load_pretrained
from cs336_inference.serving import Engine, TraceConfig, make_trace

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def cost(batch) -> float:
    """5 ms per step plus 0.1 ms per token: written here, independent of the engine."""
    return 0.005 + 0.0001 * batch.num_tokens


@pytest.fixture(scope="module")
def model():
    return load_pretrained("target").eval()


@pytest.fixture(scope="module")
def trace():
    text = adapters.run_load_corpus("val")[:3000]
    config = TraceConfig(num_requests=6, rate=200.0, prompt_len=(8, 24), max_new_tokens=12, sampled_fraction=0.3,
                         n_samples=2, seed=3)
    return make_trace(text, config)


def _numbers(result) -> tuple:
    steps = [(s.start, s.end, s.num_tokens, s.num_running, s.reserved_tokens) for s in result.steps]
    outputs = [(o.tokens, o.token_times, o.arrival_time) for o in result.outputs]
    return steps, outputs, result.summary()


def test_every_step_costs_what_the_model_says_and_two_runs_are_identical(model, trace):
    first = Engine(model, block_size=4, max_num_seqs=4, step_time=cost).run(trace)
    time.sleep(0.01)  # a different wall clock must change nothing
    second = Engine(model, block_size=4, max_num_seqs=4, step_time=cost).run(trace)
    assert _numbers(first) == _numbers(second)
    arrivals = sorted(r.arrival_time for r in trace)
    previous_end = 0.0
    for step in first.steps:
        assert step.end - step.start == pytest.approx(0.005 + 0.0001 * step.num_tokens, abs=1e-12)
        # a step starts when the last one ended, or (idle engine) at the next arrival
        assert step.start == previous_end or step.start in arrivals
        previous_end = step.end


def test_step_time_is_checked(model, trace):
    with pytest.raises(TypeError, match="step_time"):
        Engine(model, step_time=0.01)
    with pytest.raises(ValueError, match="step_time"):
        Engine(model, step_time=cost, clock=time.monotonic)
    engine = Engine(model, block_size=4, step_time=lambda batch: -1.0)
    engine.add_request(list(trace[0].prompt))
    with pytest.raises(ValueError, match=r"step_time\(batch\) must return finite seconds >= 0, got -1.0"):
        engine.step()
    assert not engine.has_unfinished() or all(o.finish_reason == "error" for o in engine.step())
    assert engine.manager.num_free_blocks == engine.num_blocks  # the failed step's blocks are back
