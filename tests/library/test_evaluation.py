"""Quality metrics against references written here: naive per-window loops and hand-built models."""

import math

import pytest
import torch
from adapters import (make_config, make_model, run_compare_to_reference, run_evaluate_lm,
                      run_long_range_recall, run_recall_nll, run_recall_probes)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


CFG = dict(vocab_size=257, context_length=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)


def _data(n=2000, seed=0):
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(seed))


def test_evaluate_lm_matches_a_naive_loop():
    model = make_model(make_config(**CFG))
    data, T = _data(), 64
    out = run_evaluate_lm(model, data, T, batch_size=3, max_batches=None)
    losses = []
    with torch.no_grad():
        for w in range((data.numel() - 1) // T):  # every full window, one at a time
            x, y = data[w * T:(w + 1) * T], data[w * T + 1:(w + 1) * T + 1]
            logits = model(x[None])[0]
            probs = torch.softmax(logits.double(), -1)
            losses += (-probs[torch.arange(T), y].log()).tolist()
    expected = sum(losses) / len(losses)
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    assert out["bits_per_byte"] == pytest.approx(expected / math.log(2), rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_uniform_model_scores_log_vocab():
    model = make_model(make_config(**CFG))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits 0 everywhere -> the uniform distribution over 257 ids
    out = run_evaluate_lm(model, _data(), 32, max_batches=2)
    assert out["bits_per_byte"] == pytest.approx(math.log2(257), rel=1e-6)


def test_compare_to_reference_against_naive_kl():
    a, b = make_model(make_config(**CFG), seed=0), make_model(make_config(**CFG), seed=1)
    data, T = _data(600), 50
    same = run_compare_to_reference(a, a, data, seq_len=T)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    out = run_compare_to_reference(a, b, data, seq_len=T, batch_size=4, max_batches=None)
    kls, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for w in range((data.numel() - 1) // T):
            x = data[w * T:(w + 1) * T][None]
            p_ref = torch.softmax(b(x)[0].double(), -1)
            p_model = torch.softmax(a(x)[0].double(), -1)
            for t in range(T):
                kls += float((p_ref[t] * (p_ref[t].log() - p_model[t].log())).sum())
                agree += int(p_ref[t].argmax() == p_model[t].argmax())
                n += 1
    assert out["kl"] == pytest.approx(kls / n, rel=1e-4)
    assert out["top1_agreement"] == pytest.approx(agree / n)


def test_decode_kl_to_reference_steps_through_the_cache_like_a_full_forward():
    """`decode_kl_to_reference` runs the model one position per step through its cache; the same KL
    and agreement, in doubles, from one full forward of each model per sequence."""
    from cs336_inference.data.evaluation import decode_kl_to_reference

    a, b = make_model(make_config(**CFG), seed=0), make_model(make_config(**CFG), seed=1)
    ids = _data(2 * 24).view(2, 24)
    assert decode_kl_to_reference(a, a, ids) == (pytest.approx(0.0, abs=1e-5), 1.0)
    kl, top1 = decode_kl_to_reference(a, b, ids)
    with torch.no_grad():
        p_ref, p_model = torch.softmax(b(ids).double(), -1), torch.softmax(a(ids).double(), -1)
    expected = (p_ref * (p_ref.log() - p_model.log())).sum(-1).mean()
    assert kl == pytest.approx(float(expected), rel=1e-3)
    assert top1 == pytest.approx(float((p_ref.argmax(-1) == p_model.argmax(-1)).double().mean()))


def test_evaluation_rejects_bad_inputs():
    model = make_model(make_config(**CFG))
    with pytest.raises(ValueError, match="context_length"):
        run_evaluate_lm(model, _data(), 1024)
    with pytest.raises(ValueError, match="data"):
        run_evaluate_lm(model, torch.zeros(3, 3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="seq_len"):
        run_evaluate_lm(model, _data(10), 64)
    other = make_model(make_config(**{**CFG, "vocab_size": 300}))
    with pytest.raises(ValueError, match="vocab"):
        run_compare_to_reference(model, other, _data(), seq_len=16)


def _always_says(digit: str):
    """A real TransformerLM whose greedy output is `digit` at every position.

    Embeddings are all ones and every block's output projection is zero, so the residual stream is
    the ones vector everywhere; the lm_head row of `digit` is the only non-zero one.
    """
    model = make_model(make_config(**CFG))
    with torch.no_grad():
        model.token_embeddings.weight.fill_(1.0)
        for block in model.layers:
            block.attn.output_proj.weight.zero_()
            block.ffn.w2.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[ord(digit)] = 1.0
    return model


def test_long_range_recall_counts_exact_matches():
    model = _always_says("4")
    distances, trials = [100, 300], 40
    acc = run_long_range_recall(model, distances, num_trials=trials, seed=5, digits=1, batch_size=16)
    assert sorted(acc) == distances
    for d in distances:  # reference: the share of these probes whose one-digit answer is "4"
        probes = run_recall_probes(d, trials, seed=5, digits=1)
        expected = sum(p.answer == "4" for p in probes) / trials
        assert acc[d] == pytest.approx(expected), f"distance {d}"
        assert 0 < expected < 1  # the check can fail: some answers are 4, some are not
    two = run_long_range_recall(model, distances, num_trials=trials, seed=5, digits=1, batch_size=16)
    assert two == acc, "the probe must be deterministic for a seed"
    with pytest.raises(ValueError, match="context"):
        run_long_range_recall(model, [600], num_trials=2)


def test_recall_nll_of_a_uniform_model_is_log_vocab():
    model = make_model(make_config(**CFG))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every next-token distribution is uniform over 257 ids
    out = run_recall_nll(model, [100, 200], num_trials=3)
    assert out == pytest.approx({100: math.log(257), 200: math.log(257)}, rel=1e-5)
    with pytest.raises(ValueError, match="context"):
        run_recall_nll(model, [600], num_trials=1)
