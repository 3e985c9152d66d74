"""The decode data path: the cache owns its position, padding is a forward argument, a forward that
fails midway leaves every cache kind usable, and rollback (`truncate`) works on every kind.

References are fresh runs: a new cache fed the same tokens, or the full forward without a cache.
"""

import dataclasses

import pytest
import torch
from adapters import (make_cache_step, make_config, make_kv_cache, make_model, make_quantized_kv_cache,
                      run_decode_one_token, run_model)
from test_kv_variants import BASE, VARIANTS, WINDOW

pytestmark = pytest.mark.usefixtures("one_thread")

# Every layer-cache kind: contiguous (GQA), rolling (sliding window), latent (MLA), quantized (int8),
# one shared by two layers (CLA), and a model mixing rolling and contiguous layers (hybrid).
KINDS = {"contiguous": "gqa", "rolling": "window", "latent": "mla", "quantized": "gqa", "shared": "cla",
         "hybrid": "hybrid", "shared_rolling": "cla_window"}


def _setup(kind):
    model = make_model(make_config(**{**BASE, **VARIANTS[KINDS[kind]]}))

    def new_cache(batch_size, max_seq_len, **kwargs):
        if kind == "quantized":
            return make_quantized_kv_cache(model, batch_size, max_seq_len)
        return make_kv_cache(model, batch_size, max_seq_len, **kwargs)
    return model, new_cache


class Boom(Exception):
    pass


def _greedy(model, cache, logits, steps):
    """Continue greedily from last-position logits (B, V) for `steps` tokens: (tokens (B, steps), logits)."""
    tokens, seen = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = run_decode_one_token(model, nxt, cache)
        seen.append(logits)
    return torch.stack(tokens, 1), torch.stack(seen, 1)


@pytest.mark.parametrize("chunk", [1, 3])   # an interrupted decode step, an interrupted multi-token verify
@pytest.mark.parametrize("kind", KINDS)
def test_exception_mid_forward_leaves_the_cache_as_it_was(kind, chunk):
    model, new_cache = _setup(kind)
    B, P = 2, 2 * WINDOW + 1          # the prompt already wrapped the rolling rings
    x = torch.randint(0, 257, (B, P + 2))
    with torch.no_grad():
        cache = new_cache(B, 40)
        run_model(model, x[:, :P], cache)
        handle = model.layers[2].register_forward_hook(lambda *args: (_ for _ in ()).throw(Boom()))
        try:
            with pytest.raises(Boom):      # layers 0 and 1 already wrote their caches when layer 2 fails
                run_model(model, torch.randint(0, 257, (B, chunk)), cache)
        finally:
            handle.remove()
        assert cache.length == P, "a failed forward must not advance the cache"
        # The documented recovery is: nothing. Continue as if the failed call never happened.
        got_tokens, got_logits = _greedy(model, cache, run_model(model, x[:, P:], cache)[:, -1], 6)
        fresh = new_cache(B, 40)
        run_model(model, x[:, :P], fresh)
        want_tokens, want_logits = _greedy(model, fresh, run_model(model, x[:, P:], fresh)[:, -1], 6)
    assert torch.equal(got_tokens, want_tokens), f"{kind}: generation after the failed forward differs"
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_several_tokens_then_truncate_matches_a_fresh_run(kind):
    """Speculative decoding's pattern: one forward over gamma + 1 tokens, then roll back the rejected ones."""
    model, new_cache = _setup(kind)
    gamma = 4
    B, P = 2, 2 * WINDOW + 1
    x = torch.randint(0, 257, (B, P + 8))
    with torch.no_grad():
        cache = new_cache(B, 40, max_rollback=gamma + 1) if kind != "quantized" else new_cache(B, 40)
        run_model(model, x[:, :P], cache)
        run_model(model, torch.randint(0, 257, (B, gamma + 1)), cache)   # every draft rejected
        cache.truncate(P)
        got = run_model(model, x[:, P:], cache)
        fresh = new_cache(B, 40)
        run_model(model, x[:, :P], fresh)
        want = run_model(model, x[:, P:], fresh)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rolling_ring_without_spare_slots_refuses_a_deep_rollback_and_says_how_to_fix_it():
    model, new_cache = _setup("rolling")
    with torch.no_grad():
        cache = new_cache(1, 40)
        run_model(model, torch.randint(0, 257, (1, 2 * WINDOW)), cache)
        run_model(model, torch.randint(0, 257, (1, 3)), cache)
        with pytest.raises(ValueError, match="max_rollback"):
            cache.truncate(2 * WINDOW)
    assert cache.length == 2 * WINDOW + 3


def test_the_cache_owns_the_position_and_start_pos_is_only_an_assertion():
    model, new_cache = _setup("contiguous")
    x = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        cache = new_cache(1, 20)
        run_model(model, x[:, :5], cache)
        assert cache.length == 5
        got = run_model(model, x[:, 5:], cache, start_pos=5)
        with pytest.raises(ValueError, match=r"start_pos \(3\) must equal the number of cached tokens \(9\)"):
            run_model(model, x[:, :1], cache, start_pos=3)
        want = run_model(model, x)[:, 5:]
        # Without a cache start_pos offsets the positions: RoPE is relative, so a shifted window
        # over the same tokens gives the same logits.
        shifted = run_model(model, x, start_pos=7)
    assert cache.length == 9
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(shifted, run_model(model, x), atol=1e-4, rtol=0)


def test_padding_is_an_argument_of_every_forward_not_state_of_the_cache():
    model, new_cache = _setup("rolling")
    a, b = torch.randint(1, 257, (4,)), torch.randint(1, 257, (7,))
    batch = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    pad = torch.tensor([3, 0])
    nxt = torch.randint(1, 257, (2, 1))
    with torch.no_grad():
        cache = new_cache(2, 12)
        run_model(model, batch, cache, pad=pad)
        assert not hasattr(cache, "pad")
        padded = run_model(model, nxt, cache, pad=pad)[:, 0]
        alone_a = run_model(model, torch.cat([a, nxt[0]])[None])[0, -1]
    torch.testing.assert_close(padded[0], alone_a, atol=1e-5, rtol=0)


def test_a_forward_step_is_the_whole_contract_between_model_and_cache():
    """The model needs from its cache only a `ForwardStep`: positions, one layer cache per layer (each
    writes with `update` and attends with `attend`), `select_last` and `commit`. A step written here
    (the cache's own step, choosing the first row for the LM head) drives the model: every layer,
    owners and CLA followers, attends through its layer cache, and commit comes once, after them all."""
    model, new_cache = _setup("shared")
    x = torch.randint(0, 257, (1, 9))
    events = []
    with torch.no_grad():
        cache = new_cache(1, 20)

        class Recording(type(cache.layers[0])):
            def attend(self, q, kv, step, scale=None, kernel="reference"):
                events.append("attend")
                return super().attend(q, kv, step, scale, kernel)
        for layer in cache.unique_layers():
            layer.__class__ = Recording

        class FirstRow(make_cache_step(0, 1).__class__):
            def select_last(self, h):
                return h[:, :1]

            def commit(self):
                events.append("commit")
                super().commit()
        begun = cache.begin(9)
        step = FirstRow(**{f.name: getattr(begun, f.name) for f in dataclasses.fields(begun)})
        got = run_model(model, x, step=step, last_only=True)
        want = run_model(model, x)[:, :1]
    assert events == ["attend"] * 4 + ["commit"], events
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.length == 9
    with pytest.raises(ValueError, match="either a step"):
        run_model(model, x, cache, step=step)
