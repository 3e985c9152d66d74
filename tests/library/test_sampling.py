"""The library's sampler refuses bad arguments clearly (not graded: the distribution itself is graded in
tests/graded/test_sampling_rules.py, through the adapters)."""

import pytest
import torch

from cs336_inference.generation import logits_to_probs, sample_next_token


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next_token(torch.randn(2, 5), **kwargs)
    with pytest.raises(ValueError, match=match):
        logits_to_probs(torch.randn(2, 5), **kwargs)


def test_integer_logits_rejected():
    with pytest.raises(TypeError, match="logits"):
        sample_next_token(torch.ones(2, 5, dtype=torch.long))


def test_sampling_on_the_generators_device_returns_tokens_on_the_logits_device():
    logits = torch.randn(3, 7)
    tokens = sample_next_token(logits, generator=torch.Generator().manual_seed(0))
    assert tokens.device == logits.device and tokens.dtype == torch.int64


@pytest.mark.parametrize("row, what", [([0.0, float("inf"), 1.0], r"\+inf"),
                                       ([float("-inf")] * 3, "a row where every logit is -inf"),
                                       ([0.0, float("nan"), 1.0], "NaN")])
def test_logits_with_nan_plus_inf_or_no_allowed_token_are_refused(row, what):
    """Only finite logits and -inf (a forbidden token) describe a distribution, with at least one token allowed:
    +inf and an all -inf row are refused like NaN (by both functions, for a row in a batch too)."""
    batch = torch.tensor([[0.5, 0.0, -1.0], row])
    for fn in (logits_to_probs, sample_next_token):
        with pytest.raises(ValueError, match=f"logits must be finite or -inf.*got {what}"):
            fn(batch)
    assert logits_to_probs(torch.tensor([0.0, float("-inf"), 0.0]))[1] == 0        # -inf alone is allowed


def test_invalid_rows_flags_nan_plus_inf_and_rows_with_nothing_allowed():
    """The engine's one-reduction check (serving/sampler.py) against rows listed by hand."""
    from cs336_inference.generation.sampling import invalid_rows
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[0.0, inf, 1.0], [-inf, -inf, -inf], [nan, 0.0, 1.0], [0.0, -inf, 1.0], [-inf, 2.0, -inf]])
    assert invalid_rows(rows).tolist() == [True, True, True, False, False]
