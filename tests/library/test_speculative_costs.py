"""`generation.speculative_costs`: the measured c and v come back in the shape the theory takes, and
the prediction from them is the theory's formula, worked out here by hand."""

import pytest
import torch

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.generation.speculative_costs import measure_costs, predicted_speedup


def tiny(d_model: int, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=64, context_length=64, d_model=d_model, num_layers=2, num_heads=2,
                                     d_ff=2 * d_model)).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_measured_costs_cover_every_gamma_and_drafter(one_thread, temperature):
    target = tiny(32, 0)
    context = list(range(1, 20)) * 2
    costs = measure_costs(target, {"draft": tiny(16, 1), "lookup": "prompt_lookup"}, context, (1, 3),
                          temperature, repeats=2)
    assert costs["token"]["wall"] > 0 and costs["token"]["cpu"] >= 0
    assert sorted(costs["verify"]) == [0, 1, 2, 3]                  # g = 0 .. max(gammas)
    assert all(v["wall"] > 0 for v in costs["verify"].values())
    assert sorted(costs["draft"]) == [1, 3] and sorted(costs["lookup"]) == [1, 3]
    assert all(costs["draft"][g]["draft"]["wall"] > 0 and costs["draft"][g]["verify"]["wall"] > 0 for g in (1, 3))
    assert all(costs["lookup"][g]["wall"] > 0 for g in (1, 3))


def test_prediction_is_the_theory_from_the_measured_costs():
    v = {g: {"wall": 1.0 + 0.2 * g} for g in range(3)}
    costs = {"verify": v, "draft": {2: {"draft": {"wall": 0.25}, "verify": {"wall": 1.6}}},
             "lookup": {2: {"wall": 0.1}}}
    alpha, proposed = 0.5, [2, 2, 1]                 # the last pass drafted one token (near the end)
    e = {g: (1 - alpha ** (g + 1)) / (1 - alpha) for g in (1, 2)}   # E[tokens | alpha, g]
    tokens = (2 * e[2] + e[1]) / 3
    model = predicted_speedup(costs, "draft", alpha, 2, proposed)
    # a model drafter: g c + v(g), v(gamma) as measured in the loop's rhythm
    assert model["predicted_speedup"] == pytest.approx(tokens / ((2 * (0.5 + 1.6) + 0.25 + 1.2) / 3))
    assert model["paper_speedup"] == pytest.approx(e[2] / (2 * 0.25 + 1))
    assert model["cost_ratio"] == 0.25 and model["verify_cost"] == 1.6
    lookup = predicted_speedup(costs, "lookup", alpha, 2, proposed)
    # prompt lookup: one search per pass, whatever it drafts
    assert lookup["predicted_speedup"] == pytest.approx(tokens / ((2 * (0.1 + 1.4) + 0.1 + 1.2) / 3))
    assert lookup["cost_ratio"] == pytest.approx(0.05) and lookup["verify_cost"] == pytest.approx(1.4)


def test_bad_arguments_are_named():
    target = tiny(16, 0)
    with pytest.raises(ValueError, match="gammas"):
        measure_costs(target, {}, [1, 2, 3], ())
    with pytest.raises(ValueError, match="repeats"):
        measure_costs(target, {}, [1, 2, 3], (1,), repeats=0)
