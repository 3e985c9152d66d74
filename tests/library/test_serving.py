"""The serving engine on the shipped target model: a ragged paged forward equals the plain forward,
and served outputs equal per-request `generate` token for token, whatever the scheduler, with and
without prefix sharing, preemption and forked samples."""

from __future__ import annotations

import random

import pytest
import torch

import adapters
from cs336_inference.model import load_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

NEWLINE = 10  # the byte tokenizer's "\n": answers end with their line


@pytest.fixture(scope="module")
def model():
    return load_pretrained("target").eval()


@pytest.fixture(scope="module")
def trace():
    """12 requests arriving over ~0.2 s; half start with the same 40-token system prompt."""
    text = adapters.run_load_corpus("val")[:20_000].tolist()
    rng = random.Random(0)
    system = text[:40]
    requests, t = [], 0.0
    for i in range(12):
        t += rng.expovariate(60.0)
        start = rng.randrange(100, len(text) - 50)
        prompt = text[start:start + rng.randint(3, 30)]
        if i % 2 == 0:
            prompt = system + prompt
        requests.append(adapters.make_request(i, prompt, rng.randint(4, 24), t, stop_tokens=(NEWLINE,)))
    return requests


@pytest.fixture(scope="module")
def reference(model, trace):
    """Each request alone through `generate` (contiguous cache, batch 1)."""
    return [adapters.run_generate(model, [list(r.prompt)], r.max_new_tokens, stop_tokens=[NEWLINE]).tokens[0]
            for r in trace]


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_paged_forward_of_a_ragged_batch_matches_the_plain_forward(kernel):
    """Three sequences, part already cached, run as one row: the last-token logits of each equal a
    full forward of that sequence alone (with either attention kernel of the model)."""
    model = adapters.run_set_attention_kernel(load_pretrained("target").eval(), kernel)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 5, 20)]
    bs = 4
    cache = adapters.make_paged_kv_cache(model, num_blocks=32, block_size=bs)
    order = torch.randperm(32, generator=g).tolist()          # scattered blocks
    tables = [order[0:4], order[4:6], order[6:11]]
    first = [7, 1, 20]                                         # tokens written by a first forward
    with torch.no_grad():
        ids = [t for s, n in zip(seqs, first) for t in s[:n]]
        out1 = adapters.run_model(model, torch.tensor([ids]), step=cache.step(tables, first, first),
                                  last_only=True)[0]
        rest = [1, 4, 0]                                       # a decode, a prefill chunk, nothing
        ids = [t for s, n, r in zip(seqs, first, rest) for t in s[n:n + r]]
        active = [b for b in range(3) if rest[b]]
        out2 = adapters.run_model(model, torch.tensor([ids]), step=cache.step(
            [tables[b] for b in active], [first[b] + rest[b] for b in active], [rest[b] for b in active]),
            last_only=True)[0]
        for b in range(3):
            want = adapters.run_model(model, torch.tensor([seqs[b][:first[b]]]))[0, -1]
            torch.testing.assert_close(out1[b], want, atol=1e-4, rtol=0)
        for row, b in enumerate(active):
            want = adapters.run_model(model, torch.tensor([seqs[b][:first[b] + rest[b]]]))[0, -1]
            torch.testing.assert_close(out2[row], want, atol=1e-4, rtol=0)


CONFIGS = {
    "continuous": dict(scheduler="continuous", block_size=8, max_num_seqs=6),
    "static": dict(scheduler="static", block_size=8, max_num_seqs=6),
    # one reserved run of prompt + max_new_tokens slots per request (no sharing), 240 slots in all
    "continuous_contiguous": dict(scheduler="continuous", kv_layout="contiguous", block_size=8, num_blocks=30,
                                  max_num_seqs=6),
    "continuous_no_prefix_cache": dict(scheduler="continuous", block_size=8, max_num_seqs=6, prefix_caching=False),
    # 12 blocks of 4 tokens: far less than the batch wants, so running sequences get preempted
    "continuous_preempting": dict(scheduler="continuous", block_size=4, num_blocks=24, max_num_seqs=6,
                                  watermark_blocks=0),
    # prompts cut into chunks of a 16-token budget, beside the decodes, under preemption
    "continuous_chunked": dict(scheduler="continuous", block_size=4, num_blocks=24, max_num_seqs=6,
                               watermark_blocks=0, max_num_batched_tokens=16, chunked_prefill=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_greedy_outputs_equal_generate(model, trace, reference, name):
    result = adapters.run_engine(model, trace, **CONFIGS[name])
    for request, output, want in zip(trace, result.outputs, reference):
        assert output.request_id == request.request_id
        assert output.tokens == [want], f"request {request.request_id} differs from generate"
        assert output.finish_reasons == ["stop" if want[-1] == NEWLINE else "length"]
        times = output.token_times[0]
        assert request.arrival_time <= output.first_scheduled_time < times[0]
        assert all(a <= b for a, b in zip(times, times[1:])) and output.finish_time == times[-1]
        assert output.ttft >= output.queueing_time >= 0
    summary = result.summary()
    assert summary["requests"] == len(trace)
    assert result.free_blocks_at_end == result.num_blocks, "every block returns to the free list"
    cached = summary["cached_prompt_tokens"]
    if name in ("continuous_no_prefix_cache", "continuous_contiguous"):
        assert cached == 0
    else:
        assert cached > 0, "requests behind the shared system prompt should reuse its blocks"
    if name in ("continuous_preempting", "continuous_chunked"):
        assert summary["preemptions"] > 0
    if name == "static":  # a batch only starts once the previous one has completely finished
        spans = sorted((o.first_scheduled_time, o.finish_time) for o in result.outputs)
        starts = sorted({s for s, _ in spans})
        for a, b in zip(starts, starts[1:]):
            assert max(f for s, f in spans if s == a) <= b


@pytest.mark.parametrize("kv_layout", ["paged", "contiguous"])
def test_forked_samples_equal_seeded_generate(model, trace, kv_layout):
    """n = 3 samples at temperature 0.9 share the prompt's blocks (fork) and diverge at once, so every
    write to the shared last block must copy it first (contiguous: the fork copies the prompt's K/V);
    sample i equals `generate` seeded seed + i."""
    requests = [adapters.make_request(r.request_id, r.prompt, 12, r.arrival_time, temperature=0.9, n=3,
                                      seed=100 * i) for i, r in enumerate(trace[:6])]
    result = adapters.run_engine(model, requests, block_size=4, max_num_seqs=12, kv_layout=kv_layout)
    distinct = 0
    for i, (request, output) in enumerate(zip(requests, result.outputs)):
        assert len(output.tokens) == 3
        for j, tokens in enumerate(output.tokens):
            gen = torch.Generator().manual_seed(100 * i + j)
            want = adapters.run_generate(model, [list(request.prompt)], 12, temperature=0.9, generator=gen).tokens[0]
            assert tokens == want, f"request {i} sample {j}"
        distinct += len({tuple(t) for t in output.tokens}) > 1
    assert distinct > 0
    assert result.free_blocks_at_end == result.num_blocks


def test_both_schedulers_finish_a_poisson_trace_and_agree(model):
    text = adapters.run_load_corpus("val")[:5000]
    requests = adapters.make_poisson_trace(text, system_prompt=text[:20].tolist(), num_requests=10, rate=100.0,
                                           prompt_len=(4, 20), max_new_tokens=10, seed=3)
    static = adapters.run_engine(model, requests, scheduler="static", max_num_seqs=4)
    continuous = adapters.run_engine(model, requests, scheduler="continuous", max_num_seqs=4)
    assert [o.tokens for o in static.outputs] == [o.tokens for o in continuous.outputs]
    assert all(len(o.tokens[0]) == 10 for o in static.outputs)


def test_engine_refuses_bad_requests_and_configs(model):
    ok = adapters.make_request("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="unique"):
        adapters.run_engine(model, [ok, ok])
    with pytest.raises(ValueError, match="scheduler"):
        adapters.run_engine(model, [ok], scheduler="fifo")
    with pytest.raises(ValueError, match="max_new_tokens"):
        adapters.make_request("zero", [1], 0)
    with pytest.raises(ValueError, match="n must be"):
        adapters.make_request("n0", [1], 3, n=0)
    with pytest.raises(ValueError, match="block_size"):
        adapters.run_engine(model, [ok], block_size=0)
    with pytest.raises(ValueError, match="watermark_blocks"):  # at construction, not mid-run
        adapters.run_engine(model, [ok], watermark_blocks=-1)
    with pytest.raises(TypeError, match="model"):
        adapters.run_engine(None, [ok])
    with pytest.raises(ValueError, match="arrival_time"):
        adapters.make_request("inf", [1], 3, float("inf"))
    with pytest.raises(TypeError, match="num_requests"):
        adapters.make_poisson_trace(list(range(100)), num_requests=2.5)


def test_a_trace_with_impossible_requests_serves_every_other_request(model, trace, reference):
    """Too long for the context, never fitting the KV pool, out-of-vocabulary stop token, more samples
    than the static batch can reserve: each is refused alone with a message naming the limit; every
    other request of the trace is served exactly."""
    bad = [adapters.make_request("long", [1] * 500, 100, 0.01),
           adapters.make_request("huge", [1] * 200, 200, 0.02),
           adapters.make_request("oov", [1, 2], 4, 0.03, stop_tokens=(300,)),
           adapters.make_request("wide", [5] * 30, 30, 0.04, n=5, temperature=0.5, seed=1)]
    reasons = {"long": "context_length", "huge": "KV blocks", "oov": "vocab_size", "wide": "KV blocks"}
    for scheduler in ("continuous", "static"):
        result = adapters.run_engine(model, trace + bad, scheduler=scheduler, block_size=8, num_blocks=40,
                                     max_num_seqs=6)
        by_id = {o.request_id: o for o in result.outputs}
        for request, want in zip(trace, reference):
            assert by_id[request.request_id].tokens == [want]
        for rid, words in reasons.items():
            if rid == "wide" and scheduler == "continuous":
                assert by_id[rid].error is None and len(by_id[rid].tokens) == 5  # one sample at a time fits
                continue
            assert set(by_id[rid].finish_reasons) == {"error"} and words in by_id[rid].error, (rid, by_id[rid].error)
        assert result.free_blocks_at_end == result.num_blocks
        assert result.summary()["failed"] == (4 if scheduler == "static" else 3)


@pytest.mark.slow
def test_engine_on_smollm2_equals_generate():
    """The real model (tied embeddings, 30 layers, K=3 of N=9 heads) through the engine: chat requests,
    one with 2 greedy samples (fork), outputs equal `generate` alone."""
    from smollm2_reference import INSTALL, smollm2_file
    if smollm2_file() is None:
        pytest.skip(f"SmolLM2 not installed: {INSTALL}")
    model = adapters.run_load_pretrained("smollm2-135m")
    tokenizer = adapters.get_model_tokenizer("smollm2-135m")
    stop = tuple(tokenizer.stop_ids)
    questions = ["What is the capital of France?", "Name one use of a KV cache.", "Why is the sky blue?"]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    requests = [adapters.make_request(i, p, 12, 0.01 * i, stop_tokens=stop, n=2 if i == 1 else 1)
                for i, p in enumerate(prompts)]
    result = adapters.run_engine(model, requests, block_size=16, max_num_seqs=8)
    for request, output in zip(requests, result.outputs):
        want = adapters.run_generate(model, [list(request.prompt)], 12, stop_tokens=list(stop)).tokens[0]
        assert output.tokens == [want] * request.sampling.n
