"""`bench plain_under_load`: its measurement on a tiny model (the numbers' shape and consistency, not speed).

Not graded (the library's own benchmark)."""

import matplotlib.pyplot as plt
import pytest
import torch

import adapters
from cs336_inference.workshop.benchmarks import plain_under_load
from cs336_inference.workshop.benchmarks.base import Run


def test_measure_times_both_kernels_idle_and_busy_with_consistent_ratios(monkeypatch):
    model = adapters.make_model(adapters.make_config(vocab_size=257, context_length=64, d_model=32, num_layers=2,
                                                     num_heads=4, num_kv_heads=2, d_ff=64))
    monkeypatch.setattr(plain_under_load, "plain_model", lambda name, quick, device: (model, "tiny"))
    result = plain_under_load.measure(Run("plain_under_load", torch.device("cpu"), quick=True))
    rows = {(r["state"], r["kernel"]): r for r in result["rows"]}
    assert set(rows) == {(s, k) for s in ("idle", "busy") for k in ("reference", "default (sdpa)")}
    assert result["same_greedy_tokens"] is True
    for (state, kernel), r in rows.items():
        assert r["tok_per_s_min"] <= r["tok_per_s"] <= r["tok_per_s_max"] and r["tok_per_s"] > 0
        assert r["vs_reference"] == pytest.approx(r["tok_per_s"] / rows[(state, "reference")]["tok_per_s"])
        busy, idle = rows[("busy", kernel)]["tok_per_s"], rows[("idle", kernel)]["tok_per_s"]
        assert r["busy_over_idle"] == pytest.approx(busy / idle)
    assert [block.attn.attention_kernel for block in model.layers] == ["reference"] * 2   # generate restored them
    plt.close(plain_under_load.plot(result))
