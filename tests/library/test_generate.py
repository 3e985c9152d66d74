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


def _count_reference_attention(monkeypatch) -> list:
    """Every call of the hand-written attention (the "reference" entry of the attention registry) from here on."""
    from cs336_inference.model import attention

    calls, reference = [], attention.ATTENTION.kernels["reference"]

    def counted(*args, **kwargs):
        calls.append(1)
        return reference(*args, **kwargs)
    monkeypatch.setitem(attention.ATTENTION.kernels, "reference", counted)
    return calls


@pytest.mark.parametrize("variant", [{}, dict(sliding_window=4)])
def test_generate_runs_fused_attention_by_default_and_the_reference_on_request(monkeypatch, variant):
    """`generate` runs torch's fused kernel where the model runs the reference (robust when other work shares
    the cores); attention_kernel="reference" runs the hand-written one. Same greedy tokens as the definition
    (`greedy_reference`: full forwards on the model's own reference kernel), and afterwards every layer runs
    the kernel it ran before."""
    model = make_model(make_config(**CFG, **variant))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    expected = [greedy_reference(model, p, 10) for p in prompts]
    calls = _count_reference_attention(monkeypatch)
    fused = run_generate(model, prompts, 10)
    assert calls == [] and fused.tokens == expected
    reference = run_generate(model, prompts, 10, attention_kernel="reference")
    assert len(calls) >= 10 * len(model.layers) and reference.tokens == expected
    assert all("attention_kernel" not in block.attn.__dict__ for block in model.layers)   # the class default again
    calls.clear()
    model(torch.tensor([prompts[0]]))
    assert len(calls) == len(model.layers)   # the model itself still runs the reference


def test_generate_keeps_a_chosen_kernel_and_restores_kernels_after_an_error(monkeypatch):
    model = make_model(make_config(**CFG)).set_attention_kernel("reference")
    calls = _count_reference_attention(monkeypatch)
    run_generate(model, [[1, 2, 3]], 4)
    assert calls == []   # even a model set to the reference explicitly: generate's default is the fused kernel
    assert [block.attn.attention_kernel for block in model.layers] == ["reference"] * 2
    handle = model.lm_head.register_forward_hook(lambda m, args, out: out.fill_(float("nan")))
    with pytest.raises(ValueError, match="got NaN"):
        run_generate(model, [[1, 2, 3]], 4, attention_kernel="sdpa")
    handle.remove()
    assert [block.attn.attention_kernel for block in model.layers] == ["reference"] * 2
    with pytest.raises(ValueError, match="attention kernel must be one of .* got 'flash'"):
        run_generate(model, [[1, 2, 3]], 4, attention_kernel="flash")
