"""`bench alternatives`: the set-up (one parameter budget), the hybrid shapes at real scale by hand, and a
quick smoke run (slow) that trains a few models briefly and writes its JSON and figure."""

import json

import pytest

from cs336_inference.accounting.fixed_state import HYBRIDS
from cs336_inference.workshop.benchmarks import alternatives as bench
from cs336_inference.model import TransformerLM


def test_every_variant_gets_the_same_parameter_budget_and_fits_the_task():
    budget = TransformerLM(bench.variant_config(bench.VARIANTS["attention"])).num_parameters()
    for name, overrides in bench.VARIANTS.items():
        config = bench.variant_config(overrides, budget=budget)
        params = TransformerLM(config).num_parameters()
        assert abs(params - budget) <= 3 * config.d_model * config.num_layers / 2, (name, params, budget)
        assert config.vocab_size == bench.TASK.vocab_size and config.context_length >= bench.TASK.seq_len
    assert max(bench.PAIRS) <= bench.TASK.max_pairs()
    assert set(bench.SHIPPED) <= set(bench.VARIANTS) and set(bench.LATENCY_VARIANTS) <= set(bench.VARIANTS)


def test_hybrid_memory_at_real_scale_by_hand():
    jamba = HYBRIDS["jamba-52b"].memory(256 * 1024)
    assert jamba["kv_bytes"] == 4 * 2 * 8 * 128 * 2 * 256 * 1024 == 4 * 2**30      # the paper's "4GB" at 256K
    assert jamba["state_bytes"] == 28 * (8192 * 16 + 3 * 8192) * 2
    assert jamba["all_attention_kv_bytes"] == 8 * jamba["kv_bytes"] == 32 * 2**30   # Mixtral-like: 32 GB
    minimax = HYBRIDS["minimax-01"].memory(1024)
    assert minimax["state_bytes"] == 70 * 64 * 128 * 128 * 2
    assert minimax["kv_bytes"] == 10 * 2 * 8 * 128 * 2 * 1024


@pytest.mark.slow
def test_quick_bench_writes_json_and_figure(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    result = bench.bench_alternatives(quick=True, device="cpu")
    saved = json.loads((tmp_path / "alternatives_quick.json").read_text())
    assert (tmp_path / "alternatives_quick.png").exists() and saved["variant_order"] == result["variant_order"]
    for name in bench.LATENCY_VARIANTS:
        r = saved["variants"][name]
        assert set(r["decode_ms"]) == {str(T) for T in saved["latency"]["contexts"]}
        grows = r["bytes"][str(saved["latency"]["contexts"][-1])] > r["bytes"][str(saved["latency"]["contexts"][0])]
        assert grows == (name in ("attention", "hybrid: SSD n=4 + attention")), name   # a window and a state do not
    recalls = [v for name in saved["variant_order"] for v in saved["variants"][name].get("recall", {}).values()]
    assert recalls and all(0 <= v <= 1 for v in recalls)
