"""`timing.alternating_timings`: the side-by-side timing the notebooks narrate from. A fake clock makes
the arithmetic exact: the order of calls, the warm-up rounds left out, median/min/max per variant.
Also what every benchmark records beside a time: the run's peak memory and the machine."""

import statistics

import pytest
import torch

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


def test_peak_memory_sees_what_a_run_allocates():
    """On a CPU: the resident set at the start and Linux's peak during the run (reset at its start
    where the OS allows), which a 64 MB buffer touched inside the run must raise. Measured in a fresh
    process: inside a long test session the allocator may hand back pages that are already resident."""
    import json
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    code = ("import json, torch\n"
            "from cs336_inference.timing import PeakMemory, rss_bytes\n"
            "with PeakMemory(torch.device('cpu')) as peak:\n"
            "    buffer = torch.ones(16 * 2**20)\n"          # 64 MB, written
            "print(json.dumps({**peak.result(), 'nbytes': buffer.nbytes, 'rss_now': rss_bytes()}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    values = json.loads(out.stdout.strip().splitlines()[-1])
    assert values["rss_start_bytes"] > 0 and values["rss_now"] > 0
    assert values["rss_peak_bytes"] >= values["rss_start_bytes"] + values["nbytes"] // 2, values


def test_describe_machine_says_where_a_number_was_measured():
    from cs336_inference.device import describe_machine

    d = describe_machine(torch.device("cpu"))
    assert d["cpu"] and d["cpu_count"] >= 1 and d["torch_threads"] == torch.get_num_threads()
    assert d["torch"] == torch.__version__ and d["device"] == "cpu" and "gpu" not in d
