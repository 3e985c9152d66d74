"""Post-hoc attention changes on a trained model: a window / hybrid / sinks over shared weights, and
GQA's mean-pooling conversion to fewer K/V heads, against references written here."""

import pytest
import torch
from adapters import make_config, make_model, run_mean_pool_kv_heads, run_model, run_with_attention
from reference_model import ref_forward
from test_kv_variants import ref_variant_forward

BASE = dict(vocab_size=97, context_length=48, d_model=48, num_layers=3, num_heads=6, num_kv_heads=3, d_ff=64,
            tie_embeddings=True)


def test_with_attention_shares_weights_and_equals_a_model_built_with_that_config():
    model = make_model(make_config(**BASE))
    x = torch.randint(0, 97, (2, 20))
    for changes in (dict(sliding_window=6), dict(sliding_window=6, attention_sinks=2),
                    dict(sliding_window=4, global_every=3)):
        local = run_with_attention(model, **changes)
        assert local.layers[1].ffn.w1.weight.data_ptr() == model.layers[1].ffn.w1.weight.data_ptr()
        assert local.lm_head.weight is local.token_embeddings.weight
        want = ref_variant_forward({**model.state_dict(), "lm_head.weight": model.token_embeddings.weight},
                                   local.config, x)
        torch.testing.assert_close(run_model(local, x), want, atol=1e-5, rtol=1e-4, msg=str(changes))
    back = run_with_attention(run_with_attention(model, sliding_window=6, attention_sinks=2), sliding_window=None)
    torch.testing.assert_close(run_model(back, x), run_model(model, x))
    with pytest.raises(ValueError, match="num_heads"):
        run_with_attention(model, num_heads=3)
    with pytest.raises(ValueError, match="attention_sinks needs sliding_window"):
        run_with_attention(model, attention_sinks=4)


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_mean_pooled_kv_heads_match_pooling_by_hand(num_kv_heads):
    model = make_model(make_config(**BASE))
    pooled = run_mean_pool_kv_heads(model, num_kv_heads)
    assert pooled.config.num_kv_heads == num_kv_heads and pooled.config.num_heads == 6
    H, g = 8, 3 // num_kv_heads
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(3):
        for name in ("k_proj", "v_proj"):
            w = state[f"layers.{i}.attn.{name}.weight"]            # rows: head 0 (H rows), head 1, head 2
            heads = [w[j * H:(j + 1) * H] for j in range(3)]
            state[f"layers.{i}.attn.{name}.weight"] = torch.cat(
                [sum(heads[n * g:(n + 1) * g]) / g for n in range(num_kv_heads)])
    x = torch.randint(0, 97, (2, 16))
    want = ref_forward(state, pooled.config, x)
    torch.testing.assert_close(run_model(pooled, x), want, atol=1e-5, rtol=1e-4)
    if num_kv_heads == 3:
        torch.testing.assert_close(run_model(pooled, x), run_model(model, x))
    cache = pooled.new_cache(2, 16)
    assert cache.bytes_per_token * 3 // num_kv_heads == model.new_cache(2, 16).bytes_per_token


def test_mean_pool_refuses_a_non_divisor():
    model = make_model(make_config(**BASE))
    with pytest.raises(ValueError, match="positive divisor of the model's 3"):
        run_mean_pool_kv_heads(model, 2)
