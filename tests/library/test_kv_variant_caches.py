"""Layer caches of the attention variants: bytes match the accounting formulas, rolling-buffer rollback
and overflow, and invalid variant combinations are refused with clear errors."""

import pytest
import torch
from adapters import (make_cache_step, make_config, make_kv_cache, make_latent_kv_cache, make_model,
                      make_rolling_kv_cache, run_model)
from test_kv_variants import BASE, VARIANTS, WINDOW

from cs336_inference.accounting.formulas import kv_cache_bytes, kv_cache_bytes_per_token


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("S_max", [3, 24])  # shorter and longer than the window
def test_measured_cache_bytes_equal_the_accounting_formulas(name, S_max):
    cfg = make_config(**{**BASE, **VARIANTS[name]})
    model = make_model(cfg)
    B = 3
    cache = make_kv_cache(model, B, S_max)
    tensors = {id(t): t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)}
    assert cache.nbytes == sum(t.nbytes for t in tensors.values()), "nbytes must count real tensor bytes"
    assert cache.bytes_per_token == kv_cache_bytes_per_token(cfg, bytes_per_element=4)
    assert cache.nbytes == kv_cache_bytes(cfg, B, S_max, 4)


def test_accounting_by_hand_for_each_variant():
    """Independent arithmetic (fp32, L=4 layers, N=4 heads, H=8)."""
    per_token = {"mha": 4 * 2 * 4 * 8 * 4, "gqa": 4 * 2 * 2 * 8 * 4, "mqa": 4 * 2 * 1 * 8 * 4,
                 "mla": 4 * (12 + 4) * 4, "cla": 2 * 2 * 2 * 8 * 4, "cla_mla": 2 * 16 * 4,
                 "window": 4 * 2 * 2 * 8 * 4}
    for name, want in per_token.items():
        assert kv_cache_bytes_per_token(make_config(**{**BASE, **VARIANTS[name]}), 4) == want, name
    hybrid = make_config(**{**BASE, **VARIANTS["hybrid"]})     # layers 0, 2 local; 1, 3 global
    assert kv_cache_bytes(hybrid, 2, 30, 4) == 2 * (2 * WINDOW + 2 * 30) * (2 * 2 * 8 * 4)


def _filled_window_model(length):
    model = make_model(make_config(**{**BASE, **VARIANTS["window"]}))
    x = torch.randint(0, 257, (2, length + 4))
    cache = make_kv_cache(model, 2, 30)
    with torch.no_grad():
        run_model(model, x[:, :length], cache)
    return model, cache, x


def test_rolling_buffer_rollback_by_one_then_redecode_matches():
    model, cache, x = _filled_window_model(12)
    with torch.no_grad():
        run_model(model, torch.randint(0, 257, (2, 1)), cache)   # a rejected draft token
        cache.truncate(12)
        got = run_model(model, x[:, 12:15], cache)
        want = run_model(model, x[:, :15])[:, 12:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rolling_buffer_refuses_a_rollback_deeper_than_it_holds_and_changes_nothing():
    model, cache, _ = _filled_window_model(12)
    before = [(layer.k.clone(), layer.oldest) for layer in cache.layers]
    with pytest.raises(ValueError, match="sliding-window cache back to 8"):
        cache.truncate(8)
    assert cache.length == 12
    for (k, oldest), layer in zip(before, cache.layers):
        assert torch.equal(k, layer.k) and layer.oldest == oldest


def test_a_second_rollback_after_the_ring_wrapped_is_refused_or_exact():
    """Issue 15, hole 10: window 5, 7 slots (max_rollback=3). A 3-token draft is rejected after the ring wrapped,
    then one token is accepted and a second, deeper rollback is asked for: the slots it needs were
    overwritten by the rejected draft, so the cache must refuse it; every rollback it accepts must give
    the full forward's logits."""
    model = make_model(make_config(**{**BASE, **VARIANTS["window"]}))
    x = torch.randint(0, 257, (1, 24))
    with torch.no_grad():
        full = run_model(model, x)
        cache = make_kv_cache(model, 1, 30, max_rollback=3)
        run_model(model, x[:, :12], cache)
        run_model(model, torch.randint(0, 257, (1, 3)), cache)   # rejected draft: overwrites slots of 5..7
        cache.truncate(12)
        torch.testing.assert_close(run_model(model, x[:, 12:13], cache)[0, 0], full[0, 12], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="sliding-window cache back to 10"):
            cache.truncate(10)                                     # needs positions 6..9: 6 and 7 are gone
        assert cache.length == 13
        torch.testing.assert_close(run_model(model, x[:, 13:16], cache), full[:, 13:16], atol=1e-5, rtol=0)
        cache.truncate(14)                                         # needs 10..13: intact
        torch.testing.assert_close(run_model(model, x[:, 14:20], cache), full[:, 14:20], atol=1e-5, rtol=0)


def test_rolling_buffer_allows_any_rollback_before_it_wraps():
    model = make_model(make_config(**{**BASE, **VARIANTS["window"]}))
    x = torch.randint(0, 257, (1, 8))
    with torch.no_grad():
        cache = make_kv_cache(model, 1, 30)
        run_model(model, x[:, :4], cache)                       # 4 < window: nothing overwritten
        cache.truncate(1)
        got = run_model(model, x[:, 1:8], cache)
        want = run_model(model, x)[:, 1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _write(cache, k, start):
    """One forward's worth of a layer cache: update then commit (what KVCache does per layer)."""
    step = make_cache_step(start, k.shape[2])
    out = cache.update(k, k[..., :cache.kv_lora_rank] if hasattr(cache, "kv_lora_rank") else k, step)
    cache.commit(step)
    return out


def test_rolling_buffer_layer_cache_overflow_is_refused_before_writing():
    cache = make_rolling_kv_cache(1, 2, 8, window=4, max_seq_len=6)
    k = torch.randn(1, 2, 5, 8)
    _write(cache, k, 0)
    snapshot = cache.k.clone()
    with pytest.raises(ValueError, match="overflow"):
        _write(cache, torch.randn(1, 2, 2, 8), 5)
    with pytest.raises(ValueError, match="shape"):
        _write(cache, torch.randn(1, 3, 1, 8), 5)
    with pytest.raises(ValueError, match="no longer holds"):   # a query at 5 needs 2.. but 0, 1 were overwritten
        _write(cache, torch.randn(1, 2, 1, 8), 1)
    assert torch.equal(snapshot, cache.k)
    # It returns exactly the positions a query at 5 may see (5 - 4 + 1 = 2 .. 5), in order.
    new = torch.randn(1, 2, 1, 8)
    keys, _ = _write(cache, new, 5)
    torch.testing.assert_close(keys, torch.cat([k[:, :, 2:5], new], 2))
    assert cache.nbytes == 2 * 2 * 4 * 8 * 4
    # The ring now holds positions 2..5 (4 slots); read() returns them oldest first.
    held_k, _ = cache.read(6)
    torch.testing.assert_close(held_k, torch.cat([k[:, :, 2:5], new], 2))


def test_rolling_buffer_writes_its_ring_only_at_commit():
    cache = make_rolling_kv_cache(1, 1, 2, window=2, max_seq_len=8)
    _write(cache, torch.randn(1, 1, 2, 2), 0)
    snapshot = cache.k.clone()
    cache.update(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2), make_cache_step(2, 3))   # never committed
    assert torch.equal(snapshot, cache.k) and cache.oldest == 0
    with pytest.raises(RuntimeError, match="not staged"):
        cache.commit(make_cache_step(2, 3))


def test_latent_cache_overflow_is_refused_before_writing():
    cache = make_latent_kv_cache(2, kv_lora_rank=6, rope_head_dim=2, max_seq_len=4)
    _write(cache, torch.ones(2, 1, 3, 8), 0)
    with pytest.raises(ValueError, match="overflow"):
        _write(cache, torch.full((2, 1, 2, 8), 7.0), 3)
    with pytest.raises(ValueError, match="H=8"):
        _write(cache, torch.ones(2, 1, 1, 6), 3)
    latent = torch.ones(2, 1, 1, 8)
    with pytest.raises(ValueError, match="view of k"):              # the values are the latent's first C dims
        cache.update(latent, latent[..., :6].clone(), make_cache_step(3, 1))
    assert cache.latent[:, :, 3].abs().sum() == 0 and cache.bytes_per_token == 8 * 4


@pytest.mark.parametrize("kw, match", [
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(sliding_window=-3), "sliding_window must be a positive int"),
    (dict(attention_type="mla", kv_lora_rank=0, rope_head_dim=4), "kv_lora_rank must be a positive int"),
    (dict(attention_type="mla", rope_head_dim=4), "needs kv_lora_rank"),
    (dict(attention_type="mla", kv_lora_rank=8), "needs rope_head_dim"),
    (dict(attention_type="mla", kv_lora_rank=8, rope_head_dim=3), "rope_head_dim must be even"),
    (dict(attention_type="mla", kv_lora_rank=8, rope_head_dim=4, num_kv_heads=2), "num_kv_heads"),
    (dict(attention_type="mla", kv_lora_rank=8, rope_head_dim=4, sliding_window=4), "not supported"),
    (dict(kv_lora_rank=8), "only apply to attention_type='mla'"),
    (dict(attention_type="linear"), "attention_type must be one of"),
    (dict(kv_share_group=3), "must divide num_layers"),
    (dict(num_heads=4, num_kv_heads=3), "divisible by num_kv_heads"),
    (dict(global_every=2), "needs sliding_window"),
    (dict(sliding_window=4, global_every=1), "every layer global"),
    (dict(sliding_window=4, global_every=2, kv_share_group=2), "local and global"),
])
def test_invalid_variant_combinations_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make_config(**{**BASE, **kw})


def test_window_and_sharing_combine_when_groups_are_homogeneous():
    # layers 0-3 local, 4-5 ... global_every=3 over 6 layers: L L G L L G; groups of 1 only
    cfg = make_config(**{**BASE, "num_layers": 6, "sliding_window": 4, "global_every": 3})
    assert [cfg.layer_window(i) for i in range(6)] == [4, 4, None, 4, 4, None]
