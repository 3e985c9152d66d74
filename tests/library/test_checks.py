"""The package's validation module: TypeError for a wrong type, ValueError for a wrong value, and every
message names the argument, the value given and what is allowed.

Not graded (the library's own helper, imported directly rather than through adapters.py).
"""

import math

import pytest
import torch
from adapters import make_config, make_kv_cache, make_model, run_generate

from cs336_inference import _checks
from cs336_inference.generation import sample_next_token


@pytest.mark.parametrize("check, bad_type, bad_value, allowed", [
    (_checks.positive_int, 2.0, 0, "a positive int"),
    (_checks.non_negative_int, "3", -1, "a non-negative int"),
    (_checks.finite_positive_float, "1e-5", math.inf, "a finite positive number"),
    (_checks.probability, None, 1.5, "a number in [0, 1]"),
])
def test_each_check_separates_wrong_types_from_wrong_values(check, bad_type, bad_value, allowed):
    with pytest.raises(TypeError) as info:
        check("knob", bad_type)
    assert "knob" in str(info.value) and repr(bad_type) in str(info.value) and allowed in str(info.value)
    with pytest.raises(ValueError) as info:
        check("knob", bad_value)
    assert "knob" in str(info.value) and repr(float(bad_value) if check in (
        _checks.finite_positive_float, _checks.probability) else bad_value) in str(info.value)
    assert allowed in str(info.value)


@pytest.mark.parametrize("check", [_checks.positive_int, _checks.non_negative_int, _checks.finite_positive_float,
                                   _checks.probability])
def test_bools_are_never_numbers(check):
    with pytest.raises(TypeError, match="got bool True"):
        check("flag", True)


def test_valid_values_come_back_normalised():
    assert _checks.positive_int("n", 3) == 3
    assert _checks.finite_positive_float("eps", 1) == 1.0 and isinstance(_checks.finite_positive_float("eps", 1), float)
    assert _checks.probability("top_p", 1) == 1.0
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 0.0"):
        _checks.probability("top_p", 0, allow_zero=False)
    assert _checks.one_of("split", "val", ("train", "val")) == "val"
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val'\), got 'test'"):
        _checks.one_of("split", "test", ("train", "val"))
    ids = _checks.token_ids("ids", torch.tensor([1, 2], dtype=torch.uint8), vocab_size=3)
    assert ids.dtype == torch.int64
    with pytest.raises(ValueError, match=r"ids must be in \[0, vocab_size=3\), got values in \[1, 7\]"):
        _checks.token_ids("ids", torch.tensor([1, 7]), vocab_size=3)
    with pytest.raises(TypeError, match="ids must have an integer dtype"):
        _checks.token_ids("ids", torch.tensor([1.0]))


def test_the_library_uses_one_convention():
    """A sample of public entry points: the same argument mistakes give the same exception kinds."""
    model = make_model(make_config(vocab_size=257, context_length=16, d_model=16, num_layers=1, num_heads=2,
                                   d_ff=32))
    for bad, error in ((1.0, TypeError), (0, ValueError), (True, TypeError)):
        with pytest.raises(error, match="batch_size"):
            make_kv_cache(model, bad)
        with pytest.raises(error, match="vocab_size"):
            make_config(vocab_size=bad)
    with pytest.raises(TypeError, match="max_new_tokens must be a non-negative int, got float 2.0"):
        run_generate(model, [[1, 2]], 2.0)
    with pytest.raises(TypeError, match="top_k must be a positive int or None, got float 2.0"):
        sample_next_token(torch.zeros(3), top_k=2.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0 \(0 = greedy\), got -1.0"):
        sample_next_token(torch.zeros(3), temperature=-1)
