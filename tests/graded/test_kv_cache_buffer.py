"""Graded: a preallocated KV cache with rollback (ContiguousKVCache: one layer). The reference is a Python list of every
position's key and value, cut on rollback."""

import pytest
import torch
from adapters import make_graded_contiguous_kv_cache

B, K, H, MAX = 2, 3, 4, 12


def _kv(T, g):
    return torch.randn(B, K, T, H, generator=g), torch.randn(B, K, T, H, generator=g)


def _stack(kept):
    return torch.stack([k for k, _ in kept], 2), torch.stack([v for _, v in kept], 2)


def test_appends_return_every_position_so_far_and_truncate_rolls_back():
    g = torch.Generator().manual_seed(0)
    cache, kept = make_graded_contiguous_kv_cache(B, K, H, MAX), []
    for op in [("append", 3), ("append", 1), ("append", 2), ("truncate", 4), ("append", 1), ("truncate", 0),
               ("append", 5), ("append", 1), ("truncate", 5), ("truncate", 5), ("append", 7)]:
        if op[0] == "append":
            k, v = _kv(op[1], g)
            keys, values = cache.append(k, v)
            kept += [(k[:, :, t], v[:, :, t]) for t in range(op[1])]
            want_k, want_v = _stack(kept)
            assert keys.shape == want_k.shape, f"after {op}: keys {tuple(keys.shape)}, want {tuple(want_k.shape)}"
            torch.testing.assert_close(keys, want_k, atol=0, rtol=0, msg=f"keys after {op}")
            torch.testing.assert_close(values, want_v, atol=0, rtol=0, msg=f"values after {op}")
        else:
            cache.truncate(op[1])
            kept = kept[:op[1]]
        assert cache.length == len(kept), f"after {op}: length {cache.length}, want {len(kept)}"
    assert cache.length == MAX


def test_overflow_and_bad_rollbacks_are_refused_and_change_nothing():
    g = torch.Generator().manual_seed(1)
    cache = make_graded_contiguous_kv_cache(B, K, H, MAX)
    k, v = _kv(10, g)
    cache.append(k, v)
    for bad in (lambda: cache.append(*_kv(3, g)), lambda: cache.truncate(11), lambda: cache.truncate(-1)):
        with pytest.raises(ValueError):
            bad()
        assert cache.length == 10
    keys, _ = cache.append(*_kv(2, g))
    torch.testing.assert_close(keys[:, :, :10], k, atol=0, rtol=0, msg="a refused call overwrote cached keys")


@pytest.mark.parametrize("batch, heads, dim, max_len", [(2, 3, 4, 12), (1, 8, 64, 100), (4, 1, 2, 7)])
def test_bytes_of_the_preallocated_buffers(batch, heads, dim, max_len):
    cache = make_graded_contiguous_kv_cache(batch, heads, dim, max_len)
    assert cache.nbytes == 2 * batch * heads * max_len * dim * 4, "keys and values, preallocated, float32"
    assert cache.bytes_per_token == 2 * heads * dim * 4, "one position of one sequence: K and V of every head"
