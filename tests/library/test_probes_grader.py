"""Bad-input probes, one group per class of mistake, for sampling, speculative decoding, prompt lookup,
the tokenizers, boolean flags and attention kernels: each refusal is a ValueError / TypeError naming the
argument, never a silent wrong answer or an error from deep inside torch."""

import math

import pytest
import torch

import adapters
from cs336_inference import _checks
from cs336_inference.generation import generate, logits_to_probs, prompt_lookup_propose, sample_next_token
from cs336_inference.generation import speculative_accept, speculative_generate
from cs336_inference.generation.speculative_theory import acceptance_rate
from cs336_inference.model import ByteTokenizer
from cs336_inference.model.bpe_tokenizer import BPETokenizer

CFG = dict(vocab_size=40, context_length=48, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=24)


@pytest.fixture(scope="module")
def models():
    cfg = adapters.make_config(**CFG)
    return adapters.make_model(cfg, seed=0), adapters.make_model(cfg, seed=1)


# --- logits with no distribution to sample -----------------------------------------------------------

BAD_LOGITS = {"nan": [float("nan"), 1.0, 2.0], "+inf": [math.inf, 0.0, 0.0], "all -inf": [-math.inf] * 3}


@pytest.mark.parametrize("kind", BAD_LOGITS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_without_a_distribution_are_refused(kind, temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0], BAD_LOGITS[kind]])     # the second row is the bad one
    for fn in (sample_next_token, logits_to_probs):
        with pytest.raises(ValueError, match="logits must be finite or -inf"):
            fn(logits, temperature)
    ok = torch.tensor([0.0, -math.inf, 1.0])                       # -inf alone is a forbidden token: fine
    assert int(sample_next_token(ok, 0.0)) == 2 and float(logits_to_probs(ok, 1.0)[1]) == 0.0


# --- probability rows for the accept rule -------------------------------------------------------------

P, Q, X = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.2, 0.8, 0.0], [0.3, 0.3, 0.4]]), torch.tensor([0])


@pytest.mark.parametrize("which", ["p_draft", "q_target"])
@pytest.mark.parametrize("bad", ["nan", "negative", "unnormalised", "logits"])
def test_the_accept_rule_refuses_rows_that_are_not_distributions(which, bad):
    p, q = P.clone(), Q.clone()
    x = p if which == "p_draft" else q
    if bad == "nan":
        x[0, 0] = float("nan")
    elif bad == "negative":
        x[0] = torch.tensor([1.5, -0.5, 0.0])
    elif bad == "unnormalised":
        x.mul_(3)
    else:
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=which):
        speculative_accept(p, q, X)
    with pytest.raises(TypeError, match="generator"):
        speculative_accept(P, Q, X, generator="seed")


def test_acceptance_rates_need_distributions():
    with pytest.raises(ValueError, match="p must sum to 1"):
        acceptance_rate([0.5, 0.9], [0.5, 0.5])
    with pytest.raises(ValueError, match="q must hold probability rows"):
        acceptance_rate(torch.tensor([0.5, 0.5]), torch.tensor([2.0, -1.0]))
    assert acceptance_rate([0.5, 0.5], [0.25, 0.75]) == 0.75


# --- stop tokens: speculative decoding accepts them exactly as generate does ---------------------------

def test_stop_tokens_are_read_by_one_rule_for_generate_and_speculative_decoding(models):
    target, draft = models
    free = generate(target, [[1, 2, 3]], 6).tokens[0]
    stop = free[2]
    want = free[:free.index(stop) + 1]
    for form in (stop, torch.tensor(stop), [stop], {stop}, torch.tensor([stop])):   # 0 counts as a token too
        assert generate(target, [[1, 2, 3]], 6, stop_tokens=form).tokens[0] == want
        assert speculative_generate(target, draft, [1, 2, 3], 2, max_new_tokens=6, stop_tokens=form).tokens == want
    for bad, error in [([1.5], TypeError), ([True], TypeError), ("a", TypeError), ([40], ValueError),
                       (-1, ValueError), (torch.tensor([0.5]), TypeError)]:
        with pytest.raises(error, match="stop_tokens"):
            generate(target, [[1, 2, 3]], 4, stop_tokens=bad)
        with pytest.raises(error, match="stop_tokens"):
            speculative_generate(target, draft, [1, 2, 3], 2, max_new_tokens=4, stop_tokens=bad)


def test_stop_token_zero_is_a_stop_token(models):
    target, draft = models
    out = speculative_generate(target, draft, [1, 2, 3], 2, max_new_tokens=8).tokens
    first = out[0]
    again = speculative_generate(target, draft, [1, 2, 3], 2, max_new_tokens=8, stop_tokens=first)
    assert again.tokens == [first] and again.finish_reason == "stop"


# --- prompt lookup -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, error", [(([1.5, 2, 1.5], 2), TypeError), (([1, 2, 1], -1), ValueError),
                                         (([1, 2, 1], 2, 0), ValueError), (([1, 2, 1], 2, 1, 2), ValueError),
                                         (("abc", 2), TypeError), (([1, 2, 1], 2.0), TypeError)])
def test_prompt_lookup_refuses_bad_arguments(args, error):
    with pytest.raises(error):
        prompt_lookup_propose(*args)
    assert prompt_lookup_propose([4, 5, 6, 4, 5], 2) == [6, 4]


# --- token ids and text in the tokenizers -----------------------------------------------------------

@pytest.mark.parametrize("ids", [[65.7], [True], [65, "66"], torch.tensor([65.0]), "AB", None])
def test_token_ids_that_are_not_integers_are_refused(ids):
    with pytest.raises(TypeError, match="ids"):
        ByteTokenizer().decode(ids)
    assert ByteTokenizer().decode(torch.tensor([72, 105])) == ByteTokenizer().decode([72, 105]) == "Hi"


def test_text_that_is_not_unicode_is_refused_by_name():
    with pytest.raises(ValueError, match="text is not valid Unicode"):
        ByteTokenizer().encode("caf\udce9")


TINY = {"tokens": ["a", "b", "ab", "<|endoftext|>"], "merges": ["a b"], "special": [3]}


@pytest.mark.parametrize("field", ["tokens", "merges", "special"])
def test_a_tokenizer_spec_with_a_missing_or_mistyped_field_names_it(field):
    assert BPETokenizer.from_spec(TINY).encode("ab") == [2]
    with pytest.raises(ValueError, match=f"field '{field}'"):
        BPETokenizer.from_spec({k: v for k, v in TINY.items() if k != field})
    with pytest.raises(ValueError, match=f"field '{field}'"):
        BPETokenizer.from_spec({**TINY, field: "abc"})


# --- boolean flags: a truthy string is not True ------------------------------------------------------------

def test_boolean_flags_refuse_strings(models, tmp_path):
    target, _ = models
    from cs336_inference.accounting.formulas import num_parameters
    from cs336_inference.homework.skeleton import write_skeleton
    from cs336_inference.quantization import quantize_tensor
    calls = [lambda: generate(target, [[1, 2]], 2, use_cache="no"),
             lambda: quantize_tensor(torch.randn(2, 4), 8, "no"),
             lambda: target.num_parameters(exclude_embeddings="no"),
             lambda: num_parameters(target.config, include_norms="no"),
             lambda: write_skeleton(tmp_path / "pkg", force="no")]
    for call in calls:
        with pytest.raises(TypeError, match="True or False"):
            call()
    with pytest.raises(TypeError):
        _checks.boolean("flag", 1)


def test_an_unknown_attention_kernel_is_refused_where_it_is_used():
    from cs336_inference.model.attention import grouped_attention
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="attention kernel"):
        grouped_attention(q, k, k, None, kernel="flash")
