"""Roofline: measure_hardware gives positive finite numbers with units and refuses nonsense; the sweep
compares each measured point with the roofline computed here; the benchmarks write their outputs."""

import json
import math

import pytest
import torch

import adapters
from cs336_inference.accounting import HardwareMeasurement


def test_measure_hardware_returns_positive_finite_numbers_with_units():
    hw = adapters.run_measure_hardware("cpu", quick=True)
    for value in (hw.peak_flops, hw.memory_bandwidth, hw.accelerator_intensity):
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    assert (hw.flops_unit, hw.bandwidth_unit, hw.intensity_unit) == ("FLOP/s", "B/s", "FLOP/B")
    assert hw.accelerator_intensity == pytest.approx(hw.peak_flops / hw.memory_bandwidth)
    assert hw.device.startswith("cpu") and hw.dtype == "float32"
    # usable as hardware for the accounting (capacity unknown -> fits_in_memory is None)
    stats = adapters.run_transformer_performance_stats(adapters.config_from_name("tiny"), hw.to_spec(), 2, 32, "fp32")
    assert stats.fits_in_memory is None and stats.latency_per_token_s > 0


def test_measure_hardware_divides_the_work_by_the_measured_time(monkeypatch):
    """With the clock replaced by known durations, the two roofs are exactly work / time: the quick CPU
    measurement streams 128 MiB (a sum) and times a 1024^3 matmul (2 * 1024^3 FLOPs), as documented.
    A measurement that does not time anything (constants) fails here."""
    from cs336_inference.accounting import roofline
    durations = iter([0.016, 0.25])          # the bandwidth run is timed first, then the matmul
    calls = []

    def fake_median_seconds(fn, device, repeats):
        calls.append(repeats)
        return next(durations)
    monkeypatch.setattr(roofline, "median_seconds", fake_median_seconds)
    hw = adapters.run_measure_hardware("cpu", quick=True)
    assert calls == [3, 3], "quick mode times each kernel 3 times"
    assert hw.memory_bandwidth == pytest.approx(128 * 2**20 / 0.016, rel=1e-12)
    assert hw.peak_flops == pytest.approx(2 * 1024**3 / 0.25, rel=1e-12)
    assert hw.accelerator_intensity == pytest.approx((2 * 1024**3 / 0.25) / (128 * 2**20 / 0.016), rel=1e-12)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(device="tpu"), ValueError, "not a supported device"),
    (dict(device=3), TypeError, "prefer must be"),
    (dict(device="cpu", dtype=torch.int32), ValueError, "dtype"),
    (dict(device="cpu", dtype="float32"), ValueError, "dtype"),
    (dict(device="cpu", quick="yes"), TypeError, "quick"),
])
def test_measure_hardware_refuses_nonsense(kwargs, error, match):
    with pytest.raises(error, match=match):
        adapters.run_measure_hardware(**kwargs)


def test_measure_hardware_refuses_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="cuda"):
        adapters.run_measure_hardware("cuda")


FAKE = HardwareMeasurement(device="fake", dtype="float32", peak_flops=50e9, memory_bandwidth=10e9)


def test_roofline_sweep_against_the_roofline_computed_here():
    d_in, d_out, sizes = 256, 192, [1, 8, 64]
    sweep = adapters.run_roofline_sweep("cpu", batch_sizes=sizes, d_in=d_in, d_out=d_out, repeats=1, hardware=FAKE)
    assert sweep.batch_sizes == sizes and len(sweep.seconds) == 3
    for b, ai, achieved, predicted, t in zip(sizes, sweep.intensity, sweep.achieved_flops, sweep.predicted_flops,
                                            sweep.seconds):
        flops = 2 * b * d_in * d_out
        assert ai == pytest.approx(flops / (4 * (b * d_in + d_in * d_out + b * d_out)))
        assert predicted == pytest.approx(min(50e9, ai * 10e9))
        assert achieved == pytest.approx(flops / t) and t > 0
    # the ridge: the B whose intensity times the bandwidth equals the peak
    b = sweep.ridge_batch_size
    ridge_ai = 2 * b * d_in * d_out / (4 * (b * d_in + d_in * d_out + b * d_out))
    assert ridge_ai * 10e9 == pytest.approx(50e9)
    assert sweep.knee_batch_size() in sizes
    json.dumps(sweep.to_dict())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_sizes=[]), ValueError, "batch_sizes"), (dict(batch_sizes=[0, 2]), ValueError, "batch_sizes"),
    (dict(d_in=3), ValueError, "d_in"), (dict(repeats=0), ValueError, "repeats"),
    (dict(hardware="H100"), TypeError, "HardwareMeasurement"),
])
def test_roofline_sweep_refuses_nonsense(kwargs, error, match):
    args = dict(batch_sizes=[1], d_in=64, d_out=64, repeats=1, hardware=FAKE) | kwargs
    with pytest.raises(error, match=match):
        adapters.run_roofline_sweep("cpu", **args)


def test_bench_accounting_writes_json_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    from cs336_inference.workshop.benchmarks.accounting import bench_accounting
    bench_accounting(quick=False)   # formulas only: the full run is fast
    names = {p.name for p in tmp_path.iterdir()}
    assert {"accounting.json", "accounting_latency_throughput.png", "accounting_kv_memory.png"} <= names
    data = json.loads((tmp_path / "accounting.json").read_text())
    wanted = {"llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "deepseek-v2"}
    assert {row["model"] for row in data["models"]} >= wanted


@pytest.mark.slow
def test_bench_roofline_quick_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    from cs336_inference.workshop.benchmarks.roofline import bench_roofline
    data = bench_roofline(quick=True, device="cpu")
    assert (tmp_path / "roofline_cpu_quick.json").exists() and (tmp_path / "roofline_matmul_cpu_quick.png").exists()
    assert all(d["seconds"] > 0 for d in data["model"]["decode"])
