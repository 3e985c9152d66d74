"""`serving.Workload` (a named trace and batch limit) refuses bad fields by name and makes the trace it
describes; `serving.serve_one_at_a_time` (the one-sequence baseline) times and serves like `generate`."""

import pytest
import torch

from cs336_inference import ModelConfig, TransformerLM, generate
from cs336_inference.serving import Request, SamplingParams, Workload, serve_one_at_a_time


@pytest.mark.parametrize("field, value", [("concurrency", 0), ("output_len", 0), ("num_requests", 0),
                                          ("samples", 0), ("rate", 0.0), ("prompt_len", (0, 4))])
def test_workload_refuses(field, value):
    with pytest.raises(ValueError, match=field):
        Workload("w", **{"prompt_len": (4, 8), "output_len": 4, "concurrency": 1, "num_requests": 1, field: value})


def test_workload_makes_the_trace_it_describes():
    source = list(range(2, 200))
    w = Workload("w", prompt_len=(4, 8), output_len=5, concurrency=2, num_requests=6, rate=10.0, samples=3,
                 temperature=1.0, stop_at_eos=True, system_prompt_len=3, system_prompt_fraction=1.0)
    requests = w.requests(source, stop_tokens=(7,))
    assert len(requests) == 6 and all(r.prompt[:3] == tuple(source[:3]) for r in requests)
    assert all(4 <= len(r.prompt) - 3 <= 8 and r.max_new_tokens == 5 for r in requests)
    assert all(r.sampling.n == 3 and r.sampling.temperature == 1.0 and r.sampling.stop_token_ids == (7,)
               for r in requests)
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    greedy = w.replace(samples=1, temperature=0.0, stop_at_eos=False).requests(source, stop_tokens=(7,))
    assert all(r.sampling.n == 1 and r.sampling.temperature == 0 and not r.sampling.stop_token_ids for r in greedy)


def test_one_at_a_time_server_times_and_tokens(one_thread):
    """Requests served in arrival order, one at a time: a request that arrives while another runs waits
    exactly until that one's last token; greedy speculative tokens equal plain `generate`'s."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, context_length=64, d_model=32, num_layers=2, num_heads=4,
                                      d_ff=64)).eval()
    prompts = [(1, 2, 3, 1, 2, 3, 1, 2), (5, 6, 7, 5, 6, 7)]
    requests = [Request(0, prompts[0], 12, 0.0), Request(1, prompts[1], 9, 1e-6, SamplingParams())]
    for draft in (None, "prompt_lookup"):
        outputs, stats = serve_one_at_a_time(model, requests, draft, gamma=3)
        first, second = outputs
        assert first.first_scheduled_time == 0.0 and second.first_scheduled_time == first.token_times[0][-1]
        for o, r in zip(outputs, requests):
            times = o.token_times[0]
            assert len(times) == len(o.tokens[0]) == r.max_new_tokens
            assert all(a <= b for a, b in zip(times, times[1:])) and times[0] > o.first_scheduled_time
            assert o.tokens[0] == generate(model, [list(r.prompt)], r.max_new_tokens).tokens[0]
        if draft is not None:   # tokens of one pass share its end time: passes = distinct times after the first
            distinct = sum(len(set(o.token_times[0][1:]) - {o.token_times[0][0]}) for o in outputs)
            assert stats["passes"] == distinct and stats["accepted"] <= stats["proposed"]
