"""Where a decode step's time goes: torch's profiler over a few steps, its events summed into the parts
a batch-1 step is made of.

The lecture's claim is that batch-1 decode is memory-bound: a step can be no faster than its weight
bytes / the memory bandwidth. `bench generation` measures how close a step comes (`fraction_of_bandwidth`);
this says where the rest goes. The matmuls stream the weights, and only while they run is memory busy.
Everything else is work between them on one core while the memory idles: the attention over the cache,
the compiled graph's own code (its fused element-wise kernels and the C++ that calls the kernels and
allocates their outputs), dynamo checking the graph's guards before each call, and Python. So
`matmul_GBps` (weight bytes / time in the matmuls) says how fast the kernels stream, and the parts
beside them what a faster kernel cannot win back.

Each part is the profiler's self time of the events it names (an op called inside another op counts
once, in the inner one); "everything else" is the step's wall time under the profiler less those: the
Python between the events, and the profiler's own cost (about a microsecond per event; the step's time
without the profiler is the benchmark's own row, measured apart). A kernel that inductor's C++ calls
directly rather than through torch's dispatcher (torch's int8 matmul, in a compiled step) has no event
of its own: its time counts in the graph's own code, and `matmul_GBps` is then None.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable

import torch

from ... import _checks

# part -> the profiler event names (or, ending in "*", name prefixes) whose self time it sums
PARTS = {
    "matmuls, our kernel": ("cs336::dense_gemv", "cs336::int4_gemv"),
    "matmuls, torch's": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
                         "aten::_weight_int4pack_mm*", "aten::_int_mm", "aten::_weight_int8pack_mm"),
    "attention": ("cs336::decode_attention", "aten::_scaled_dot_product*", "aten::scaled_dot_product_attention"),
    "compiled graph's own code": ("## Call CompiledFxGraph*",),
    "dynamo's guard check": ("TorchDynamo Cache Lookup",),
}
MATMULS = ("matmuls, our kernel", "matmuls, torch's")


def part_of(event: str) -> str | None:
    """The part of `PARTS` whose names match the profiler event `event`, or None."""
    for part, names in PARTS.items():
        if any(event.startswith(n[:-1]) if n.endswith("*") else event == n for n in names):
            return part
    return None


def step_anatomy(step: Callable[[], object], steps: int, weight_bytes: int) -> dict:
    """Profile `steps` calls of `step` (one decode step each, after one unprofiled call) and split their
    time: {"profiled_ms_per_step", "ms": {part: ms per step, ..., "everything else": ...},
    "matmul_GBps": weight_bytes / the time in the matmuls (None if none ran), "calls": {event: per step}}."""
    _checks.positive_int("steps", steps)
    step()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():
        prof.start()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    finally:
        with _quiet_stderr():
            prof.stop()
    ms, calls = dict.fromkeys(PARTS, 0.0), {}
    for event in prof.key_averages():
        if (part := part_of(event.key)) is not None:
            ms[part] += event.self_cpu_time_total / steps / 1e3   # microseconds in all steps -> ms per step
            name = "## Call CompiledFxGraph ##" if part == "compiled graph's own code" else event.key   # no hash
            calls[name] = calls.get(name, 0.0) + event.count / steps
    ms["everything else"] = wall_ms - sum(ms.values())
    matmul_ms = sum(ms[p] for p in MATMULS)
    return {"profiled_ms_per_step": wall_ms, "ms": ms, "calls": calls,
            "matmul_GBps": weight_bytes / (matmul_ms / 1e3) / 1e9 if matmul_ms > 0 else None}


@contextlib.contextmanager
def _quiet_stderr():
    """The process's stderr (its file descriptor: the profiler writes from C++) sent to /dev/null. torch's
    profiler prints a line to it as it starts and another as it stops ("USDT: ... profiler_start"),
    whatever its log level: only those two calls run under this, never the steps."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
