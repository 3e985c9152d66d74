"""`benchmarks.step_anatomy`: a decode step's time split by torch's profiler into the parts `bench generation`
prints. Checked against what each step is known to do: its matmul calls counted from the model, and time
spent in Python (a sleep) landing in "everything else", not in a kernel.

Not graded: this checks the library's own benchmark.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

import adapters
from cs336_inference.workshop import cpu_tuning
from cs336_inference.accounting.model_roofline import decode_step_fn, weight_bytes_per_step
from cs336_inference.workshop.benchmarks.step_anatomy import part_of, step_anatomy
from cs336_inference.workshop.kernels import cpu_attention


def test_each_profiler_event_lands_in_its_part():
    assert part_of("cs336::dense_gemv") == part_of("cs336::int4_gemv") == "matmuls, our kernel"
    assert part_of("aten::mm") == part_of("aten::_weight_int4pack_mm_for_cpu") == "matmuls, torch's"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert part_of("cs336::decode_attention") == "attention"
    assert part_of("## Call CompiledFxGraph fajj2zur2ynp ##") == "compiled graph's own code"
    assert part_of("TorchDynamo Cache Lookup") == "dynamo's guard check"
    for other in ("aten::add", "aten::mm_extra", "cs336::dense_gemv2", "aten::empty"):
        assert part_of(other) is None, other


def test_python_time_is_everything_else_and_matmul_calls_are_counted():
    w = torch.randn(256, 256)

    def step():
        for _ in range(3):
            torch.mm(w, w)
        time.sleep(0.004)

    a = step_anatomy(step, 3, weight_bytes=3 * w.nbytes)
    assert a["calls"] == {"aten::mm": 3.0}                  # 3 matmuls per step, nothing else named
    assert a["ms"]["everything else"] >= 3.5                 # the sleep: not in any kernel
    assert 0 < a["ms"]["matmuls, torch's"] < a["profiled_ms_per_step"] - 3.5
    assert a["ms"]["matmuls, our kernel"] == a["ms"]["attention"] == 0
    assert a["matmul_GBps"] == pytest.approx(3 * w.nbytes / (a["ms"]["matmuls, torch's"] / 1e3) / 1e9)


@pytest.mark.skipif(cpu_attention.build() is not None,
                    reason=f"our CPU kernels cannot run here: {cpu_attention.build()}")
def test_a_tuned_decode_step_is_one_kernel_call_per_linear():
    config = adapters.make_config(vocab_size=97, context_length=64, d_model=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, d_ff=128)
    model = cpu_tuning.tune_for_cpu(adapters.make_model(config), split=False, threads=False)
    linears = sum(isinstance(m, cpu_tuning.CPULinear) for m in model.modules())
    a = step_anatomy(decode_step_fn(model, 1, 8, 8), 4, weight_bytes_per_step(model))
    assert a["calls"]["cs336::dense_gemv"] == linears       # every linear of a decode step, once
    assert a["ms"]["matmuls, our kernel"] > 0 and a["matmul_GBps"] > 0


def test_the_profiler_prints_nothing_and_errors_still_reach_stderr(capfd):
    def step():
        torch.ones(8).sum()

    step_anatomy(step, 2, weight_bytes=1)
    out, err = capfd.readouterr()
    assert out == "" and err == ""                       # torch's profiler says "profiler_start" otherwise

    calls = []

    def failing():   # the unprofiled first call passes; the first profiled one fails
        calls.append(1)
        if len(calls) == 2:
            print("the step's own complaint", file=sys.stderr)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step_anatomy(failing, 2, weight_bytes=1)
    assert "the step's own complaint" in capfd.readouterr().err   # stderr is back, and the steps used it


def test_steps_must_be_a_positive_int():
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="steps must be a positive int"):
            step_anatomy(lambda: None, bad, 1)
