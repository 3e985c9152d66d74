import pytest
import torch
from adapters import run_logits_to_probs, run_sample_next_token


def test_temperature_zero_is_argmax():
    logits = torch.randn(16, 50)
    assert torch.equal(run_sample_next_token(logits, temperature=0), logits.argmax(-1))


def test_top_k_never_leaves_the_k_largest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100)
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(200):
        tok = run_sample_next_token(logits, temperature=2.0, top_k=5, generator=g)
        assert (allowed == tok[:, None]).any(-1).all()


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = run_logits_to_probs(logits, temperature=1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    probs = run_logits_to_probs(logits, top_p=0.81)   # 0.5 + 0.3 < 0.81: third token needed
    assert probs[2] > 0 and probs[3] == 0
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        assert int(run_sample_next_token(logits, top_p=0.8, generator=g)) in (0, 1)


def test_sampling_frequencies_match_softmax_chi_square():
    # 20k draws from a 6-way softmax at temperature 0.7; chi-square with 5 dof, critical value for
    # p = 1e-4 is 25.74, so with a fixed seed the false-failure rate is below 1e-4.
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    expected = torch.softmax(logits / 0.7, -1) * 20000
    g = torch.Generator().manual_seed(1234)
    draws = run_sample_next_token(logits.expand(20000, 6), temperature=0.7, generator=g)
    counts = torch.bincount(draws, minlength=6).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.74, f"chi-square {chi2:.1f} too large: counts {counts.tolist()} vs expected {expected.tolist()}"


def test_same_seed_same_tokens():
    logits = torch.randn(4, 30)
    a = run_sample_next_token(logits, generator=torch.Generator().manual_seed(7))
    b = run_sample_next_token(logits, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_sample_next_token(torch.randn(2, 5), **kwargs)


def test_integer_logits_rejected():
    with pytest.raises(TypeError, match="logits"):
        run_sample_next_token(torch.ones(2, 5, dtype=torch.long))
