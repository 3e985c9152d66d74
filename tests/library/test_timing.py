"""`timing.alternating_timings`: the side-by-side timing the notebooks narrate from. A fake clock makes
the arithmetic exact: the order of calls, the warm-up rounds left out, median/min/max per variant."""

import statistics

import pytest

from cs336_inference import timing


def test_alternates_variants_leaves_out_warmup_and_summarises_each(monkeypatch):
    clock = [0.0]
    calls = []
    # Variant "a" takes 1, 2, 3, ... seconds on successive calls, "b" always 10: a load that changes during
    # the run hits both, and the order of calls must be a, b, a, b, ...
    durations = {"a": iter([100.0, 1.0, 5.0, 3.0]), "b": iter([100.0, 10.0, 10.0, 10.0])}

    def make(name):
        def fn():
            calls.append(name)
            clock[0] += next(durations[name])
        return fn

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    result = timing.alternating_timings({"a": make("a"), "b": make("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert result["a"]["times"] == [1.0, 5.0, 3.0] and result["b"]["times"] == [10.0, 10.0, 10.0]
    assert (result["a"]["median"], result["a"]["min"], result["a"]["max"]) == (statistics.median([1, 5, 3]), 1.0, 5.0)


def test_cpu_clock_counts_this_process_only(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(timing.time, "process_time", lambda: clock[0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: 1e9)   # must not be read

    def work():
        clock[0] += 0.5

    assert timing.alternating_timings({"w": work}, repeats=2, warmup=0, clock="cpu")["w"]["times"] == [0.5, 0.5]


@pytest.mark.parametrize("kwargs, match", [
    (dict(fns={}), "fns"), (dict(fns={"a": 1}), "fns"), (dict(fns=[print]), "fns"),
    (dict(fns={"a": print}, repeats=0), "repeats"), (dict(fns={"a": print}, warmup=-1), "warmup"),
    (dict(fns={"a": print}, clock="gpu"), "clock"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        timing.alternating_timings(**kwargs)
