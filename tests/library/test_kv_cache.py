import pytest
import torch
from adapters import make_config, make_kv_cache, make_model, run_model

CFG = dict(vocab_size=257, context_length=32, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48)


def test_nbytes_and_bytes_per_token_count_real_tensors():
    cfg = make_config(**CFG)
    model = make_model(cfg)
    cache = make_kv_cache(model, batch_size=2, max_seq_len=20)
    L, K, H = 3, 2, 8
    assert cache.bytes_per_token == 2 * K * H * L * 4           # K and V, fp32
    assert cache.nbytes == 2 * 20 * cache.bytes_per_token       # B * S_max tokens preallocated
    assert cache.nbytes == sum(t.nbytes for layer in cache.layers for t in (layer.k, layer.v))


def test_truncate_rolls_back_and_redecoding_matches():
    model = make_model(make_config(**CFG))
    x = torch.randint(0, 257, (2, 12))
    y = torch.randint(0, 257, (2, 3))
    with torch.no_grad():
        cache = make_kv_cache(model, 2)
        run_model(model, x[:, :8], cache)
        run_model(model, y, cache)                          # a speculative continuation ...
        cache.truncate(8)                                      # ... rejected
        got = run_model(model, x[:, 8:], cache)
        want = run_model(model, x)[:, 8:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.length == 12


def test_overflow_raises_and_leaves_cache_unchanged():
    model = make_model(make_config(**CFG))
    with torch.no_grad():
        cache = make_kv_cache(model, 1, max_seq_len=10)
        run_model(model, torch.randint(0, 257, (1, 8)), cache)
        before = [layer.k.clone() for layer in cache.layers]
        with pytest.raises(ValueError, match="overflow"):
            run_model(model, torch.randint(0, 257, (1, 3)), cache)
    assert cache.length == 8
    assert all(torch.equal(a, layer.k) for a, layer in zip(before, cache.layers))


def test_out_of_order_start_pos_is_refused():
    model = make_model(make_config(**CFG))
    with torch.no_grad():
        cache = make_kv_cache(model, 1)
        run_model(model, torch.randint(0, 257, (1, 4)), cache)
        with pytest.raises(ValueError, match="start_pos"):   # start_pos with a cache must repeat its length
            run_model(model, torch.randint(0, 257, (1, 1)), cache, start_pos=2)
        assert cache.length == 4
        run_model(model, torch.randint(0, 257, (1, 1)), cache, start_pos=4)   # the checked assertion holds
        with pytest.raises(ValueError, match="batch"):
            run_model(model, torch.randint(0, 257, (2, 1)), cache)


@pytest.mark.parametrize("n", [-1, 5, 2.0])
def test_truncate_rejects_bad_lengths(n):
    model = make_model(make_config(**CFG))
    cache = make_kv_cache(model, 1)
    with torch.no_grad():
        run_model(model, torch.randint(0, 257, (1, 4)), cache)
    with pytest.raises((ValueError, TypeError), match="n must"):
        cache.truncate(n)
    assert cache.length == 4


def test_new_cache_rejects_bad_sizes():
    model = make_model(make_config(**CFG))
    with pytest.raises(ValueError, match="max_seq_len"):
        make_kv_cache(model, 1, max_seq_len=33)
    with pytest.raises(ValueError, match="batch_size"):
        make_kv_cache(model, 0)
