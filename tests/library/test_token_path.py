"""The path a token takes stays lean and never stalls a GPU.

- package calls per generated token (`decode_one_token` then `sample_next_token`), counted with
  `sys.setprofile` on a 4-layer GQA model, at 1 and 2 threads: at most 60 (gpt-fast's `model.py`
  makes 59 under the same counter);
- package calls in one serving decode step of 4 running requests (schedule -> run -> sample ->
  postprocess): at most 130, of which paging (`KVCacheManager` and its `BlockPool`) at most 20
  (issue 47 measured 274 before paging became one pool validated at the manager's edge);
- host syncs (a value read back from the device) in a decode step and in the serving model
  runner's step: none (`host_syncs.HostSyncCounter`); in `generate`: one per token, the token's copy to
  the host, which also carries the check of its logits.
Not graded (properties of the library's own decode path).
"""

import collections
import sys
from pathlib import Path

import pytest
import torch

import adapters
import cs336_inference
from cs336_inference import decode_one_token, generate, sample_next_token
from host_syncs import HostSyncCounter

PACKAGE = str(Path(cs336_inference.__file__).parent)
CFG = dict(vocab_size=257, context_length=64, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=128)
MAX_CALLS_PER_TOKEN = 60
MAX_CALLS_PER_SERVING_STEP = 130      # 4 requests decoding; 121 measured when set
MAX_PAGING_CALLS_PER_SERVING_STEP = 20


def _model(**overrides):
    return adapters.make_model(adapters.make_config(**{**CFG, **overrides}), seed=0).eval()


def _count_package_calls(fn) -> collections.Counter:
    """Calls of functions whose code lives in the package while `fn()` runs, by file:function."""
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _calls_per_token(model, threads: int) -> collections.Counter:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache(1, 64)
        with torch.inference_mode():
            token = model(torch.randint(0, 257, (1, 8)), cache=cache)[:, -1].argmax(-1)
            for _ in range(3):   # warm: nothing cached lazily on the first steps is counted
                token = sample_next_token(decode_one_token(model, token, cache), temperature=0)
            last = token
            calls = _count_package_calls(lambda: sample_next_token(decode_one_token(model, last, cache), temperature=0))
    finally:
        torch.set_num_threads(previous)
    return calls


@pytest.mark.parametrize("threads", [1, 2])
def test_a_generated_token_costs_at_most_60_package_calls(threads):
    calls = _calls_per_token(_model(), threads)
    total = sum(calls.values())
    assert total <= MAX_CALLS_PER_TOKEN, f"{total} calls per token: {calls.most_common()}"
    assert calls["generate.py:decode_one_token"] == 1 and calls["transformer.py:forward"] == 5   # model + 4 blocks


def test_a_serving_decode_step_of_4_requests_costs_at_most_130_package_calls():
    """One engine step while 4 requests decode (one of them fills a block, so a block is allocated and
    named in the prefix cache): the bookkeeping around the forward stays small, and paging costs a few
    calls per sequence, not a validation per block id at every level."""
    from cs336_inference.serving import Engine, SamplingParams

    engine = Engine(_model(), block_size=4)
    for i in range(4):
        engine.add_request(list(range(1, 6 + i)), SamplingParams(max_tokens=20))
    for _ in range(3):   # the prefills, then decode steps: nothing lazily built on a first step is counted
        engine.step()
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting
    outputs = []
    with torch.inference_mode():
        calls = _count_package_calls(lambda: outputs.extend(engine.step()))
    assert len(engine.last_step.tokens_per_sequence) == 4 and engine.last_step.num_prefills == 0
    assert sorted(len(o.new_token_ids) for o in outputs) == [1, 1, 1, 1]
    total = sum(calls.values())
    paging = sum(n for name, n in calls.items() if name.split(":")[0] in ("kv_cache_manager.py", "block_pool.py"))
    assert total <= MAX_CALLS_PER_SERVING_STEP, f"{total} calls in a serving step: {calls.most_common()}"
    assert paging <= MAX_PAGING_CALLS_PER_SERVING_STEP, f"{paging} paging calls: {calls.most_common()}"
    assert calls["block_pool.py:allocate"] == 1, "one sequence crossed into a new block"
    assert calls["transformer.py:forward"] == 5   # one forward: the model and its 4 blocks


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


def test_a_whole_engine_step_with_sampled_requests_reads_back_only_its_one_copy():
    """Schedule -> run -> sample -> postprocess, greedy and sampled requests mixed: the logits' check and
    every draw stay on the device until the step's one `.tolist()`. On a CPU that copy reads host memory
    directly and is not counted, so the count must be 0 (on a GPU it is the step's one device->host copy)."""
    from cs336_inference.serving import Engine, SamplingParams

    engine = Engine(_model(), block_size=4)
    for i in range(4):
        params = SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.8, seed=i, n=2 if i == 2 else 1)
        engine.add_request(list(range(1, 6 + i)), params)
    steps = 0
    while engine.has_unfinished():
        with HostSyncCounter() as syncs:
            engine.step()
        steps += 1
        assert syncs.count == 0, syncs.seen
    assert steps >= 5


def test_the_engine_refuses_nan_logits_naming_the_requests_and_keeps_serving():
    """A model whose logits turn NaN for one sequence: the step raises, naming the request; its batch ends in
    an error (the engine stays consistent) and a later request is served."""
    from cs336_inference.serving import Engine, SamplingParams

    model = _model()
    engine = Engine(model, block_size=4)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.7, seed=0), request_id="poisoned")
    handle = model.lm_head.register_forward_hook(lambda m, args, out: out.fill_(float("nan")))
    with pytest.raises(ValueError, match="NaN or \\+inf .*poisoned"):
        engine.step()
    handle.remove()
    errors = [o for o in engine.step() if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["poisoned"]
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), request_id="after")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "after") == 3


@pytest.mark.parametrize("poison", ["+inf", "all -inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_engine_refuses_inf_and_all_minus_inf_logit_rows(poison, temperature):
    """A row with a +inf logit (argmax would pick it as if it were a real distribution) or with every logit
    -inf (no token allowed; argmax silently returns token 0) is refused like a NaN one, greedy or sampled."""
    from cs336_inference.serving import Engine, SamplingParams

    def hook(module, args, out):
        if poison == "+inf":
            out[..., 5] = float("inf")
        else:
            out.fill_(float("-inf"))

    model = _model()
    engine = Engine(model, block_size=4)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=temperature, seed=0), request_id="bad")
    handle = model.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(ValueError, match="NaN or \\+inf \\(or allow no token\\) for requests \\['bad'\\]"):
            engine.step()
    finally:
        handle.remove()
    assert [o.request_id for o in engine.step() if o.finish_reason == "error"] == ["bad"]
    assert not engine.has_unfinished()


def _generate_syncs(monkeypatch, model, max_new_tokens: int, **kwargs) -> int:
    """Host syncs of one `generate` call: the ops `HostSyncCounter` sees, plus every `.tolist()`: a CPU
    tensor's copy reads host memory without dispatching an op, but on a GPU each one is a device->host
    copy that waits for the device."""
    copies = []
    tolist = torch.Tensor.tolist

    def counted(self):
        copies.append(tuple(self.shape))
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    try:
        with HostSyncCounter() as syncs:
            result = generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens, **kwargs)
    finally:
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert [len(t) for t in result.tokens] == [max_new_tokens] * 2   # no stop token: every step ran
    return syncs.count + len(copies)


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.8, top_k=50, top_p=0.9),
                                    dict(attention_kernel="reference")])
def test_generate_makes_one_host_sync_per_token(monkeypatch, kwargs):
    """What a token adds to `generate` (the difference between 9 and 1 new tokens, so the edge's checks of
    the prompt cancel out): its one copy to the host, with the logits' check folded into it. A separate
    `bool(...)` of the check, or a `.item()` anywhere in the step, makes it 2 or more."""
    model = _model()
    if "temperature" in kwargs:
        kwargs["generator"] = torch.Generator().manual_seed(0)
    one = _generate_syncs(monkeypatch, model, 1, **kwargs)
    if "generator" in kwargs:
        kwargs["generator"] = torch.Generator().manual_seed(0)
    nine = _generate_syncs(monkeypatch, model, 9, **kwargs)
    assert (nine - one) / 8 <= 1, f"{(nine - one) / 8} host syncs per generated token"


@pytest.mark.parametrize("poison", ["NaN", "+inf", "all -inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("at_call", [1, 3])   # the prefill's logits, or a later decode step's
def test_generate_refuses_bad_logits_with_the_samplers_error(poison, temperature, at_call):
    """Folding the check into the token's copy keeps the error `sample_next_token` gives for the same logits."""
    def spoil(logits):
        if poison == "NaN":
            logits[-1, ..., 7] = float("nan")     # one row of the batch
        elif poison == "+inf":
            logits[-1, ..., 7] = float("inf")
        else:
            logits[-1].fill_(float("-inf"))
        return logits

    calls = []

    def hook(module, args, out):
        calls.append(1)
        return spoil(out) if len(calls) == at_call else out

    model = _model()
    handle = model.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(ValueError) as raised:
            generate(model, [[1, 2, 3], [4, 5, 6]], 6, temperature=temperature,
                     generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert len(calls) == at_call   # refused at the token whose logits went bad, not later
    with pytest.raises(ValueError) as expected:
        sample_next_token(spoil(torch.zeros(2, 257)), temperature)
    assert str(raised.value) == str(expected.value)
    what = {"NaN": "got NaN", "+inf": "got +inf", "all -inf": "got a row where every logit is -inf"}[poison]
    assert what in str(raised.value)
