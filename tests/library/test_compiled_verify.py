"""`compile_verify`: a speculative pass's T tokens through one compiled graph. Against the eager forward
written out here (logits and hidden states, on a second cache fed the same tokens), for draft lengths that
change from pass to pass and caches rolled back between passes; speculation with it equals plain greedy
decoding; bad input is refused eagerly, the cache untouched."""

import pytest
import torch

import adapters
from cs336_inference.generation import compile_verify, speculative_generate
from cs336_inference.generation.eagle import EagleDraft, EagleDrafter, eagle_config

CFG = dict(vocab_size=97, context_length=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=96)


@pytest.fixture(scope="module")
def model_and_verify():
    torch._dynamo.reset()
    model = adapters.make_model(adapters.make_config(**CFG), seed=0)
    return model, compile_verify(model, frozen=True)


@pytest.mark.slow
@torch.inference_mode()   # as the speculative loop runs it (grad mode is part of a graph's guards)
def test_verify_passes_of_changing_length_match_eager_on_one_graph_per_output(model_and_verify):
    """Passes of 3, 5, 2, 4 and 7 tokens, each rolled back to keep a different number of them (as the
    speculative loop does), with and without hidden states: every logit and hidden state equals an eager
    forward of the same tokens on a second cache, and a recompile limit of 1 per output kind makes a new
    graph per token count (or per cache length) an error."""
    model, verify = model_and_verify
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (1, 8), generator=g)
    ours, eager = adapters.make_kv_cache(model, 1, 60), adapters.make_kv_cache(model, 1, 60)
    for cache in (ours, eager):
        verify(ids, cache)                                 # an empty cache: its prefill runs eagerly, checked
    with torch._dynamo.config.patch(recompile_limit=1):
        for T, keep, hidden in [(3, 1, False), (5, 5, False), (2, 0, True), (4, 2, True), (7, 3, False), (3, 3, True)]:
            new = torch.randint(0, 97, (1, T), generator=g)
            got = verify(new, ours, return_hidden=hidden)
            want = model(new, cache=eager, return_hidden=hidden)
            for a, b in zip(got, want) if hidden else [(got, want)]:
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert ours.length == eager.length
            for cache in (ours, eager):                    # the rejected drafts are rolled back
                cache.truncate(cache.length - T + keep)


@pytest.mark.slow
def test_speculation_with_a_compiled_verify_equals_plain_greedy_decoding(model_and_verify):
    """Prompt lookup (a prompt that repeats, so drafts get proposed) and an EAGLE draft (its passes ask for
    the target's features): greedy speculation through the compiled verify emits plain greedy decoding's
    tokens, and every pass with drafts went through it."""
    model, verify = model_and_verify
    calls = []

    def counting(ids, cache, return_hidden=False):
        calls.append(ids.shape[1])
        return verify(ids, cache, return_hidden=return_hidden)

    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    plain = adapters.run_generate(model, [prompt], 30).tokens[0]
    torch.manual_seed(1)
    eagle = EagleDrafter(model, EagleDraft(eagle_config(model.config)))
    for draft in ("prompt_lookup", eagle):
        calls.clear()
        out = speculative_generate(model, draft, prompt, 3, max_new_tokens=30, verify_step=counting)
        assert out.tokens == plain
        assert len(calls) == len(out.accepted) and max(calls) > 1


def test_bad_input_is_refused_before_anything_runs_and_the_cache_is_unchanged():
    model = adapters.make_model(adapters.make_config(**CFG), seed=0)
    verify = compile_verify(model)
    cache = adapters.make_kv_cache(model, 1, 12)
    with torch.no_grad():
        verify(torch.arange(8)[None], cache)
        before = [t.clone() for layer in cache.unique_layers() for t in (layer.k, layer.v)]
        with pytest.raises(ValueError, match="2-D integer tensor"):
            verify(torch.arange(3), cache)
        with pytest.raises(ValueError, match="2-D integer tensor"):
            verify(torch.zeros(1, 3), cache)
        with pytest.raises(ValueError, match="cache overflow: 8 cached \\+ 5 new tokens exceeds max_seq_len 12"):
            verify(torch.arange(5)[None], cache)
        with pytest.raises(ValueError, match="batch 2"):
            verify(torch.arange(4).repeat(2, 1), cache)
    assert cache.length == 8
    assert all(torch.equal(a, b) for a, b in
               zip(before, [t for layer in cache.unique_layers() for t in (layer.k, layer.v)]))
    with pytest.raises(ValueError, match="reduce-overhead"):
        compile_verify(model, mode="reduce-overhead")
    with pytest.raises(TypeError, match="frozen"):
        compile_verify(model, frozen="yes")
    with pytest.raises(TypeError, match="verify_step must be a callable"):
        speculative_generate(model, "prompt_lookup", [1, 2, 3], 2, max_new_tokens=4, verify_step="compiled")
