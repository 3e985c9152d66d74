"""Graded: turning logits into the next token (logits_to_probs, sample_next_token), and generation with
the student's sampler. References are written here: a per-row loop over Python floats for the filters,
chi-square tests with fixed seeds for the draws (critical values for p = 1e-4, so a correct sampler
fails with probability below 1e-4 per test; with the seeds fixed the outcome is deterministic)."""

import math

import pytest
import torch
from adapters import make_config, make_model, run_generate, run_logits_to_probs, run_model, run_sample_next_token

# chi-square critical values at p = 1e-4 by degrees of freedom
CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def ref_probs(row, temperature=1.0, top_k=None, top_p=None) -> list[float]:
    """The documented order on one row of Python floats: temperature, top-k, softmax, top-p, renormalise."""
    row = [float(x) for x in row]
    if temperature == 0:
        best = max(range(len(row)), key=lambda i: row[i])
        return [1.0 if i == best else 0.0 for i in range(len(row))]
    z = [x / temperature for x in row]
    if top_k is not None and top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    if top_p is not None:
        order = sorted(range(len(p)), key=lambda i: -p[i])
        before, keep = 0.0, set()
        for i in order:
            if before < top_p:
                keep.add(i)
            before += p[i]
        p = [x if i in keep else 0.0 for i, x in enumerate(p)]
        p = [x / sum(p) for x in p]
    return p


def chi_square(counts: torch.Tensor, probs: list[float]) -> float:
    n = float(counts.sum())
    return sum((float(c) - n * q) ** 2 / (n * q) for c, q in zip(counts, probs) if q > 0)


def test_temperature_zero_is_greedy():
    logits = torch.randn(16, 50)
    probs = run_logits_to_probs(logits, temperature=0)
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    assert torch.equal(run_sample_next_token(logits, temperature=0), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_temperature_scales_the_logits_before_the_softmax(temperature):
    logits = torch.randn(5, 12) * 3
    got = run_logits_to_probs(logits, temperature=temperature)
    want = torch.tensor([ref_probs(row, temperature) for row in logits.tolist()])
    torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 5, 9, 10])
def test_top_k_keeps_exactly_the_k_largest(k):
    # distinct logits, far apart: exactly k tokens survive, renormalised among themselves
    g = torch.Generator().manual_seed(k)
    logits = torch.randperm(10, generator=g).float()[None].repeat(3, 1) * 0.7 + torch.arange(3.0)[:, None]
    got = run_logits_to_probs(logits, temperature=1.3, top_k=k)
    assert ((got > 0).sum(-1) == k).all(), f"top_k={k} kept {(got > 0).sum(-1).tolist()} tokens per row"
    want = torch.tensor([ref_probs(row, 1.3, top_k=k) for row in logits.tolist()])
    torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


def test_top_k_keeps_every_logit_tied_with_the_kth():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5, 2.0], [5.0, 5.0, 5.0, 1.0, 0.0, -1.0]])
    for k, kept in [(2, [4, 3]), (3, [4, 3]), (1, [1, 3]), (4, [4, 4])]:
        got = run_logits_to_probs(logits, temperature=1.0, top_k=k)
        assert (got > 0).sum(-1).tolist() == kept, f"top_k={k}: kept {(got > 0).sum(-1).tolist()} (ties stay)"
        want = torch.tensor([ref_probs(r, 1.0, top_k=k) for r in logits.tolist()])
        torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [6, 7, 1000])
def test_top_k_of_at_least_the_vocabulary_keeps_everything(k):
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(k))
    got = run_logits_to_probs(logits, temperature=0.9, top_k=k)
    torch.testing.assert_close(got, torch.softmax(logits / 0.9, -1), atol=1e-6, rtol=1e-5)
    assert run_sample_next_token(logits, 0.9, k, None, torch.Generator().manual_seed(0)).shape == (3,)


@pytest.mark.parametrize("V, top_p, kept", [(4, 0.5, 2), (8, 0.375, 3), (8, 0.25, 2), (4, 1.0, 4)])
def test_top_p_boundary_is_exact(V, top_p, kept):
    # Equal logits give probabilities 1/V exactly in float32, and their partial sums are exact too, so the
    # token whose predecessors sum to exactly top_p is the boundary case: it must be dropped.
    probs = run_logits_to_probs(torch.zeros(V), top_p=top_p)
    assert int((probs > 0).sum()) == kept, f"V={V}, top_p={top_p}: kept {int((probs > 0).sum())}, want {kept}"
    torch.testing.assert_close(probs.sort(descending=True).values[:kept], torch.full((kept,), 1.0 / kept))
    just_above = run_logits_to_probs(torch.zeros(V), top_p=min(1.0, top_p + 1e-3))
    assert int((just_above > 0).sum()) == min(V, kept + 1)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for top_p, want_kept in [(0.8, 2), (0.81, 3), (0.4, 1), (0.96, 4)]:
        got = run_logits_to_probs(logits, top_p=top_p)
        want = torch.tensor(ref_probs(logits.tolist(), top_p=top_p))
        assert int((got > 0).sum()) == want_kept
        torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


def test_temperature_is_applied_before_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [1.0, 0.9, -2.0, -2.5]])
    for temperature, top_p in [(3.0, 0.7), (0.5, 0.8), (3.0, 0.9)]:
        before = torch.tensor([ref_probs(r, temperature, top_p=top_p) for r in logits.tolist()])
        # the other order (nucleus of the untempered softmax) keeps a different set here: the test can fail
        after = [ref_probs(r, 1.0, top_p=top_p) for r in logits.tolist()]
        assert any((torch.tensor(a) > 0).tolist() != (b > 0).tolist() for a, b in zip(after, before))
        got = run_logits_to_probs(logits, temperature=temperature, top_p=top_p)
        torch.testing.assert_close(got.double(), before.double(), atol=1e-6, rtol=1e-5)


def test_top_k_and_top_p_together():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(3)) * 2
    got = run_logits_to_probs(logits, temperature=0.8, top_k=6, top_p=0.75)
    want = torch.tensor([ref_probs(r, 0.8, top_k=6, top_p=0.75) for r in logits.tolist()])
    torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.7), dict(temperature=1.5, top_k=3),
                                    dict(temperature=1.0, top_p=0.8)], ids=["temperature", "top_k", "top_p"])
def test_sampling_frequencies_match_the_distribution(kwargs):
    # 20k draws; chi-square over the tokens the distribution allows; tokens it forbids must never appear
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    probs = ref_probs(logits.tolist(), **kwargs)
    g = torch.Generator().manual_seed(1234)
    draws = run_sample_next_token(logits.expand(20000, 6), generator=g, **kwargs)
    assert draws.shape == (20000,)
    counts = torch.bincount(draws, minlength=6)
    assert all(int(c) == 0 for c, q in zip(counts, probs) if q == 0), f"forbidden tokens drawn: {counts.tolist()}"
    dof = sum(q > 0 for q in probs) - 1
    chi2 = chi_square(counts, probs)
    assert chi2 < CHI2_1E4[dof], f"chi-square {chi2:.1f} (dof {dof}): counts {counts.tolist()} vs probs {probs}"


def test_one_row_gives_one_token_and_seeds_reproduce():
    logits = torch.randn(30)
    token = run_sample_next_token(logits, generator=torch.Generator().manual_seed(7))
    assert token.shape == () and 0 <= int(token) < 30
    batch = torch.randn(4, 30)
    a = run_sample_next_token(batch, generator=torch.Generator().manual_seed(7))
    b = run_sample_next_token(batch, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


CFG = dict(vocab_size=257, context_length=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)


def test_generation_with_the_students_sampler_greedy_and_sampled():
    """The library's generate loop, drawing every token with the student's sample_next_token."""
    model = make_model(make_config(**CFG))
    prompt = [5, 6, 7]
    greedy = run_generate(model, [prompt], 8, temperature=0.0, sampler=run_sample_next_token).tokens[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):   # the definition of greedy: argmax of a full forward over the prefix
            seq.append(int(run_model(model, torch.tensor([seq]))[0, -1].argmax()))
    assert greedy == seq[len(prompt):]
    # the first sampled token of 4000 copies of the prompt follows the top-5 distribution of that forward
    with torch.no_grad():
        last = run_model(model, torch.tensor([prompt]))[0, -1]
    probs = ref_probs(last.tolist(), 1.0, top_k=5)
    result = run_generate(model, [prompt] * 4000, 1, temperature=1.0, top_k=5, sampler=run_sample_next_token,
                          generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([t[0] for t in result.tokens]), minlength=257)
    assert all(int(c) == 0 for c, q in zip(counts, probs) if q == 0)
    assert chi_square(counts, probs) < CHI2_1E4[4]
