"""The path a token takes stays lean and never stalls a GPU.

- package calls per generated token (`decode_one_token` then `sample_next_token`), counted with
  `sys.setprofile` on a 4-layer GQA model, at 1 and 2 threads: at most 60 (gpt-fast's is ~41);
- host syncs (a value read back from the device) in a decode step and in the serving model
  runner's step: none (`host_syncs.HostSyncCounter`).
Not graded (properties of the library's own decode path).
"""

import collections
import sys
from pathlib import Path

import pytest
import torch

import adapters
import cs336_inference
from cs336_inference import decode_one_token, sample_next_token
from host_syncs import HostSyncCounter

PACKAGE = str(Path(cs336_inference.__file__).parent)
CFG = dict(vocab_size=257, context_length=64, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=128)
MAX_CALLS_PER_TOKEN = 60


def _model(**overrides):
    return adapters.make_model(adapters.make_config(**{**CFG, **overrides}), seed=0).eval()


def _calls_per_token(model, threads: int) -> collections.Counter:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache(1, 64)
        with torch.inference_mode():
            token = model(torch.randint(0, 257, (1, 8)), cache=cache)[:, -1].argmax(-1)
            for _ in range(3):   # warm: nothing cached lazily on the first steps is counted
                token = sample_next_token(decode_one_token(model, token, cache), temperature=0)
            calls = collections.Counter()

            def profile(frame, event, arg):
                if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
                    calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
            sys.setprofile(profile)
            try:
                token = sample_next_token(decode_one_token(model, token, cache), temperature=0)
            finally:
                sys.setprofile(None)
    finally:
        torch.set_num_threads(previous)
    return calls


@pytest.mark.parametrize("threads", [1, 2])
def test_a_generated_token_costs_at_most_60_package_calls(threads):
    calls = _calls_per_token(_model(), threads)
    total = sum(calls.values())
    assert total <= MAX_CALLS_PER_TOKEN, f"{total} calls per token: {calls.most_common()}"
    assert calls["generate.py:decode_one_token"] == 1 and calls["transformer.py:forward"] == 5   # model + 4 blocks


@pytest.mark.parametrize("variant", [{}, dict(sliding_window=4), dict(kv_share_group=2),
                                     dict(attention_type="mla", kv_lora_rank=16, rope_head_dim=8, num_kv_heads=None)])
@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_step_reads_nothing_back_from_the_device(variant, padded):
    """Eager `decode_one_token` over every kind of cache, padded batches too: no `.item()`, no
    `bool(tensor)`, no device->host copy. (The prefill, an edge, checks values and may sync.)"""
    model = _model(**variant)
    pad = torch.tensor([3, 0]) if padded else None
    with torch.inference_mode():
        cache = model.new_cache(2, 32)
        ids = torch.randint(1, 257, (2, 9))
        model(ids, cache=cache, pad=pad)
        token = ids[:, -1]
        for _ in range(3):   # the ring of the sliding window wraps within these steps
            with HostSyncCounter() as syncs:
                logits = decode_one_token(model, token, cache, pad=pad)
            assert syncs.count == 0, syncs.seen
            token = logits.argmax(-1)


def test_a_quantized_kv_cache_decode_step_reads_nothing_back():
    model = _model()
    with torch.inference_mode():
        cache = adapters.make_quantized_kv_cache(model, 1, 32)
        model(torch.randint(0, 257, (1, 6)), cache=cache)
        with HostSyncCounter() as syncs:
            decode_one_token(model, torch.tensor([5]), cache)
    assert syncs.count == 0, syncs.seen


def test_the_serving_model_runner_step_reads_nothing_back(monkeypatch):
    """Every `ModelRunner.execute` of an engine run (prefills, decodes, mixed steps): the step is built
    from host lists and the forward reads nothing back (sampling the ids, after it, is the engine's)."""
    from cs336_inference.serving import model_runner

    execute, seen, steps = model_runner.ModelRunner.execute, [], []

    def counted(self, batch, manager):
        with HostSyncCounter() as syncs:
            out = execute(self, batch, manager)
        steps.append(len(batch.prefills) + len(batch.decodes))
        seen.extend(syncs.seen)
        return out
    monkeypatch.setattr(model_runner.ModelRunner, "execute", counted)
    requests = [adapters.make_request(i, list(range(1, 5 + 3 * i)), 6, arrival_time=0.0) for i in range(4)]
    adapters.run_engine(_model(), requests, block_size=4)
    assert len(steps) >= 6 and max(steps) > 1, steps
    assert seen == [], seen
