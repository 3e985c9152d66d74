"""The KV-variant experiment's set-up (the training itself runs in the benchmark, not here), and its
accounting-only part at real scale (`accounting.kv_variants`)."""

from cs336_inference.accounting.kv_variants import cache_bytes_vs_context
from cs336_inference.workshop.benchmarks import kv_variants as bench
from cs336_inference.model import TransformerLM


def test_every_variant_gets_the_same_parameter_budget():
    budget = TransformerLM(bench.variant_config(bench.VARIANTS["MHA"])).num_parameters()
    for name, overrides in bench.VARIANTS.items():
        config = bench.variant_config(overrides, budget=budget)
        params = TransformerLM(config).num_parameters()
        # d_ff moves in steps of 3 * D * L parameters, so the budget is met to within half a step
        assert abs(params - budget) <= 3 * config.d_model * config.num_layers / 2, (name, params, budget)


def test_cache_bytes_at_real_scale_by_hand():
    lengths = [1024, 8192, 131072]
    scale = cache_bytes_vs_context(lengths)
    llama, ds = scale["Llama-2-13B"], scale["DeepSeek-V2"]
    assert llama["MHA"] == [2 * 40 * 128 * 40 * 2 * S for S in lengths]           # 2 K H L bytes
    assert llama["GQA (K=8)"] == [v // 5 for v in llama["MHA"]]
    assert ds["MLA (C=512, R=64)"] == [(512 + 64) * 60 * 2 * S for S in lengths]
    assert ds["MHA"] == [2 * 128 * 128 * 60 * 2 * S for S in lengths]
    window = llama["window 4096"]
    assert window[1] == window[2] == 2 * 40 * 128 * 40 * 2 * 4096               # flat past the window
    assert llama["CLA (2 layers) + GQA (K=8)"] == [v // 2 for v in llama["GQA (K=8)"]]
