"""`bench serving --quick` runs end to end and writes its table and figures (numbers are not checked:
timings belong to the benchmark, not to tests)."""

import json

import pytest


@pytest.mark.slow
def test_bench_serving_quick_writes_json_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    from cs336_inference.workshop.benchmarks.serving import bench_serving
    bench_serving(quick=True, device="cpu")
    written = {p.name for p in tmp_path.iterdir()}
    assert {"serving_quick.json", "serving_quick.png", "serving_memory_quick.png",
            "serving_chunked_prefill_quick.png"} <= written
    data = json.loads((tmp_path / "serving_quick.json").read_text())
    s, layouts = data["scheduling"], data["memory"]["layouts"]
    assert s["static"]["generated_tokens"] == s["continuous"]["generated_tokens"] > 0
    assert layouts["contiguous"]["max_running"] <= layouts["paged, block 16"]["max_running"]
    chunked = data["chunked_prefill"]["configs"]
    assert chunked["chunks of 128"]["longest_step_tokens"] <= 128 < chunked["whole prompts"]["longest_step_tokens"]
