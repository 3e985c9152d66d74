import pytest
import torch
from adapters import make_config, make_kv_cache, make_model, run_decode_one_token, run_generate, run_model, run_prefill

CFG = dict(vocab_size=257, context_length=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)


def greedy_reference(model, prompt, n):
    """Re-run the full prefix each step and take the argmax: the definition of greedy decoding."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(run_model(model, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_cached_and_naive_greedy_agree_with_reference_on_ragged_batch():
    model = make_model(make_config(**CFG))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    cached = run_generate(model, prompts, 12, use_cache=True)
    naive = run_generate(model, prompts, 12, use_cache=False)
    assert cached.tokens == naive.tokens
    for p, toks in zip(prompts, cached.tokens):
        assert toks == greedy_reference(model, p, 12)


def test_prefill_and_decode_one_token_compose():
    model = make_model(make_config(**CFG))
    x = torch.randint(0, 257, (2, 10))
    with torch.no_grad():
        cache = make_kv_cache(model, 2)
        a = run_prefill(model, x[:, :9], cache)
        b = run_decode_one_token(model, x[:, 9], cache)
        full = run_model(model, x)
    torch.testing.assert_close(a, full[:, 8], atol=1e-5, rtol=0)
    torch.testing.assert_close(b, full[:, 9], atol=1e-5, rtol=0)


def test_stop_tokens_and_timestamps():
    model = make_model(make_config(**CFG))
    free = run_generate(model, [[3, 4, 5]], 10)
    stop = free.tokens[0][3]
    first = free.tokens[0].index(stop)
    res = run_generate(model, [[3, 4, 5]], 10, stop_tokens=[stop])
    assert res.tokens[0] == free.tokens[0][:first + 1]
    assert res.finish_reasons == ["stop"]
    assert len(res.token_times) == first + 1
    assert res.ttft > 0 and all(d >= 0 for d in res.inter_token_latencies)
    assert free.finish_reasons == ["length"] and len(free.tokens[0]) == 10


def test_seeded_sampling_is_reproducible():
    model = make_model(make_config(**CFG))
    kw = dict(temperature=1.0, top_k=20)
    a = run_generate(model, [[1, 2]], 8, generator=torch.Generator().manual_seed(3), **kw)
    b = run_generate(model, [[1, 2]], 8, generator=torch.Generator().manual_seed(3), **kw)
    assert a.tokens == b.tokens


def test_zero_new_tokens():
    model = make_model(make_config(**CFG))
    res = run_generate(model, [[1, 2]], 0)
    assert res.tokens == [[]] and res.ttft is None


@pytest.mark.parametrize("prompts, n, exc, match", [
    ([[1, 2, 999]], 3, ValueError, "vocab_size"),
    ([[]], 3, ValueError, "empty"),
    ([], 3, ValueError, "non-empty"),
    ([[1.5, 2]], 3, TypeError, "int token ids"),
    (torch.tensor([[1.0, 2.0]]), 3, TypeError, "integer"),
    ([list(range(1, 61))], 10, ValueError, "context_length"),
    ([list(range(1, 66))], 0, ValueError, "context_length"),
    ([[1, 2]], -1, ValueError, "max_new_tokens"),
    ([[1, 2]], 2.0, TypeError, "max_new_tokens"),
])
def test_generate_rejects_bad_inputs(prompts, n, exc, match):
    model = make_model(make_config(**CFG))
    with pytest.raises(exc, match=match):
        run_generate(model, prompts, n)
