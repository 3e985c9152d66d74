"""`bench serving --quick` runs end to end and writes its table and figures (numbers are not checked:
timings belong to the benchmark, not to tests)."""

import json

import pytest


@pytest.mark.slow
def test_bench_serving_quick_writes_json_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    from cs336_inference.benchmarks.serving import bench_serving
    bench_serving(quick=True, device="cpu")
    assert {"serving_quick.json", "serving_quick.png", "serving_quick_memory.png"} <= {p.name for p in tmp_path.iterdir()}
    data = json.loads((tmp_path / "serving_quick.json").read_text())
    assert data["static_generated_tokens"] == data["continuous_generated_tokens"] > 0
    assert data["contiguous_max_running"] <= data["paged_b16_max_running"]
