"""`bench speculative` end to end on the toy workloads (a smoke run; timings are never asserted)."""

import json

import pytest
import torch

from cs336_inference.workshop.benchmarks import speculative as bench


@pytest.mark.slow
def test_quick_bench_writes_a_consistent_table(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    result = bench.bench_speculative(quick=True, workloads=bench.toy_workloads(torch.device("cpu"), quick=True))
    saved = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert (tmp_path / "speculative_quick.png").exists() and saved["rows"] == json.loads(json.dumps(result["rows"]))
    combos = {(r["workload"], r["drafter"], r["temperature"], r["gamma"]) for r in result["rows"]}
    assert len(combos) == len(result["rows"]) == (3 + 2) * 2 * 2   # drafters x temperatures x gammas (1, 4)
    for r in result["rows"]:
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_pass"] <= r["gamma"] + 1
        assert r["predicted_speedup"] > 0
        assert r["measured_speedup_min"] <= r["measured_speedup"] <= r["measured_speedup_max"]
        assert len(r["acceptance_by_position"]) == r["gamma"]
