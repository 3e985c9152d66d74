"""The online engine API on the shipped target model: add_request / step / abort / has_unfinished /
stats. The streamed deltas equal `generate` token for token; refusals are per request; an abort frees
its blocks at once; chunked prefill and same-step prefix hits change when tokens are computed,
never which."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adapters
from cs336_inference.serving import Engine, RequestOutput, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def _drain(engine) -> dict:
    """Step until done: {(request_id, sample): (tokens, [RequestOutput...])}."""
    streams: dict = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return streams
        for out in engine.step():
            assert isinstance(out, RequestOutput)
            tokens, outs = streams.setdefault((out.request_id, out.index), ([], []))
            tokens.extend(out.new_token_ids)
            outs.append(out)
    raise AssertionError("the engine did not finish")


def _generate(model, prompt, max_tokens, **kwargs):
    return adapters.run_generate(model, [list(prompt)], max_tokens, **kwargs).tokens[0]


def test_step_deltas_equal_generate_and_run(model, text):
    engine = Engine(model, block_size=4, max_num_seqs=4)
    prompts = [text[100:120], text[500:507], text[900:931]]
    greedy = SamplingParams(max_tokens=9, stop_token_ids=(10,))
    sampled = SamplingParams(0.8, max_tokens=6, n=2, seed=7)
    ids = [engine.add_request(prompts[0], greedy), engine.add_request(prompts[1], sampled, request_id="s"),
           engine.add_request(prompts[2], greedy, arrival_time=0.0)]
    assert ids[1] == "s" and isinstance(ids[0], str) and len(set(ids)) == 3
    assert engine.has_unfinished() and engine.stats()["waiting"] == 3
    streams = _drain(engine)
    assert set(streams) == {(ids[0], 0), ("s", 0), ("s", 1), (ids[2], 0)}
    for tokens, outs in streams.values():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]   # finished exactly once, last
        assert [o.num_output_tokens for o in outs] == list(range(1, len(tokens) + 1))
        assert all(len(o.new_token_ids) == 1 and o.error is None for o in outs)
        assert outs[-1].finish_reason in ("stop", "length")
        assert all(a.time <= b.time for a, b in zip(outs, outs[1:]))
    for rid, prompt in ((ids[0], prompts[0]), (ids[2], prompts[2])):
        assert streams[(rid, 0)][0] == _generate(model, prompt, 9, stop_tokens=[10])
        assert streams[(rid, 0)][1][0].num_prompt_tokens == len(prompt)
    for k in range(2):
        want = _generate(model, prompts[1], 6, temperature=0.8, generator=torch.Generator().manual_seed(7 + k))
        assert streams[("s", k)][0] == want
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert stats["kv_blocks_total"] == engine.num_blocks

    trace = [adapters.make_request(i, p, 9, stop_tokens=(10,)) for i, p in enumerate(prompts)]
    result = Engine(model, block_size=4, max_num_seqs=4).run(trace)
    assert [o.tokens[0] for o in result.outputs] == [streams[(ids[0], 0)][0], _generate(model, prompts[1], 9,
                                                     stop_tokens=[10]), streams[(ids[2], 0)][0]]


def test_abort_frees_blocks_at_once_and_the_others_continue(model, text):
    engine = Engine(model, block_size=4, max_num_seqs=4)
    keep = engine.add_request(text[0:30], SamplingParams(max_tokens=12))
    drop = engine.add_request(text[40:70], SamplingParams(max_tokens=12, n=2))
    got: dict = {}
    for _ in range(3):
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    used = engine.stats()["kv_blocks_used"]
    assert engine.abort(drop) is True
    assert engine.stats()["kv_blocks_used"] < used and engine.stats()["running"] == 1
    assert engine.abort(drop) is False and engine.abort("nobody") is False
    first = engine.step()
    aborted = [o for o in first if o.request_id == drop]
    assert sorted(o.index for o in aborted) == [0, 1]
    assert all(o.finished and o.finish_reason == "abort" and o.new_token_ids == [] for o in aborted)
    for out in first:
        got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    for key, (tokens, _) in _drain(engine).items():
        got.setdefault(key, []).extend(tokens)
    assert got[(keep, 0)] == _generate(model, text[0:30], 12)
    assert engine.abort(keep) is False  # finished
    assert engine.stats()["kv_blocks_used"] == 0


def test_add_request_validates_at_the_edge(model):
    engine = Engine(model)
    V, context = model.config.vocab_size, model.config.context_length
    params = SamplingParams(max_tokens=4)
    cases = [(([1, V], params), ValueError, "token ids in"), (([1, -2], params), ValueError, "token ids in"),
             (([1, 2.0], params), TypeError, "prompt_token_ids"), (([], params), ValueError, "empty"),
             (("abc", params), TypeError, "list of int"), (([1], {"max_tokens": 3}), TypeError, "SamplingParams"),
             (([1], SamplingParams(stop_token_ids=(V,))), ValueError, "stop_token_ids"),
             (([1] * (context - 3), params), ValueError, "context_length")]
    for args, error, words in cases:
        with pytest.raises(error, match=words):
            engine.add_request(*args)
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request([1], params, arrival_time=float("nan"))
    engine.add_request([1, 2], params, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], params, request_id="x")
    with pytest.raises(TypeError, match="n must be"):
        SamplingParams(n=1.5)
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens="8")
    # a seed torch.Generator cannot take is refused by name (sample i seeds seed + i), not as an overflow
    for seed, n in [(2**70, 1), (-1, 1), (2**64 - 1, 2)]:
        with pytest.raises(ValueError, match=r"^seed must be .*2\*\*64 - n"):
            engine.add_request([1], SamplingParams(0.8, max_tokens=4, n=n, seed=seed))
    engine.add_request([4, 5], SamplingParams(0.8, max_tokens=4, n=2, seed=2**64 - 2), request_id="max-seed")
    assert engine.abort("max-seed")
    with pytest.raises(TypeError, match="model"):
        Engine(None)
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine(model, block_sise=8)
    assert engine.stats()["waiting"] == 1  # only the good request is queued


def test_a_request_that_can_never_fit_is_refused_alone(model, text):
    engine = Engine(model, block_size=8, num_blocks=12)
    big = engine.add_request(text[:100], SamplingParams(max_tokens=20))       # 15 blocks > 12
    small = engine.add_request(text[200:220], SamplingParams(max_tokens=5))
    first = engine.step()
    refused = [o for o in first if o.request_id == big]
    assert len(refused) == 1 and refused[0].finished and refused[0].finish_reason == "error"
    assert "12 KV blocks of 8 tokens" in refused[0].error
    streams = _drain(engine)
    tokens = [t for o in first if o.request_id == small for t in o.new_token_ids] + streams[(small, 0)][0]
    assert tokens == _generate(model, text[200:220], 5)


def test_chunked_prefill_runs_long_prompts_in_pieces_beside_decodes(model, text):
    """A token budget of 24: prompts of up to 90 tokens run in chunks while the others decode; the
    outputs equal `generate`, no step exceeds the budget, and decodes never wait for a whole prompt."""
    lengths = [10, 90, 60, 12, 75]
    trace = [adapters.make_request(i, text[300 * i:300 * i + n], 8, 0.001 * i) for i, n in enumerate(lengths)]
    result = adapters.run_engine(model, trace, block_size=8, max_num_batched_tokens=24, chunked_prefill=True)
    for request, output in zip(trace, result.outputs):
        assert output.tokens == [_generate(model, request.prompt, 8)]
    assert all(s.num_tokens <= 24 for s in result.steps)
    assert any(s.num_decodes and s.num_prefills and s.num_tokens == 24 for s in result.steps)
    unchunked = adapters.run_engine(model, trace, block_size=8, max_num_batched_tokens=24)
    assert max(s.num_tokens for s in unchunked.steps) == 90          # a whole prompt in one step


def test_identical_prompts_admitted_in_the_same_step_share_their_blocks(model, text):
    prompt = text[1000:1040]                                          # 5 blocks of 8
    trace = [adapters.make_request(i, prompt, 6) for i in range(3)]
    result = adapters.run_engine(model, trace, block_size=8)
    first = result.steps[0]
    assert first.num_prefills == 3
    assert [o.cached_prompt_tokens for o in result.outputs] == [0, 32, 32]
    assert first.reserved_tokens == 8 * (5 + 1 + 1)                   # 4 shared blocks + one last block each
    want = _generate(model, prompt, 6)
    assert all(o.tokens == [want] for o in result.outputs)


class _HostSyncs(TorchDispatchMode):
    """Counts what makes the host wait for the device: a tensor read back as a Python number
    (`aten._local_scalar_dense`: item(), int(t), bool(t), ...) and `Tensor.tolist` (which torch
    does not dispatch on a CPU tensor, so it is counted by wrapping it). `phase` labels each one."""

    def __init__(self):
        super().__init__()
        self.syncs, self.phase = [], "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append((self.phase, "item"))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        real, counter = torch.Tensor.tolist, self

        def tolist(t):
            counter.syncs.append((counter.phase, "tolist"))
            return real(t)
        self._real, torch.Tensor.tolist = real, tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._real
        return super().__exit__(*exc)


def test_an_engine_step_syncs_with_the_device_once(model, text):
    """Steps with prefill chunks, decodes, a fork and sampled rows: the model's execution reads
    nothing back from the device, and the whole step reads exactly once (the sampled ids)."""
    engine = Engine(model, block_size=4, max_num_batched_tokens=24, chunked_prefill=True)
    engine.add_request(text[0:40], SamplingParams(max_tokens=6))
    engine.add_request(text[50:60], SamplingParams(0.8, top_k=20, top_p=0.9, max_tokens=6, n=2, seed=3))
    execute = engine.runner.execute
    counter = _HostSyncs()

    def counted_execute(*args, **kwargs):
        counter.phase = "model"
        try:
            return execute(*args, **kwargs)
        finally:
            counter.phase = "step"
    engine.runner.execute = counted_execute
    ran = 0
    while engine.has_unfinished():
        counter.syncs.clear()
        with counter:
            engine.step()
        if engine.last_step is not None:
            ran += 1
            assert counter.syncs == [("step", "tolist")], f"step {ran}: {counter.syncs}"
    assert ran >= 6


def test_a_forward_that_raises_leaves_the_engine_consistent(model, text):
    """The batch's requests end with finish_reason "error" (reported by the next step), their blocks
    are freed, the prefix cache forgets blocks named that step, and the engine keeps serving."""
    engine = Engine(model, block_size=4)
    prompt = text[0:30]
    for _ in range(2):
        engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()
    execute = engine.runner.execute

    def broken(*args, **kwargs):
        engine.runner.execute = execute
        raise RuntimeError("device lost")
    engine.runner.execute = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    outs = engine.step()
    assert len(outs) == 2 and all(o.finish_reason == "error" and "device lost" in o.error for o in outs)
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8))
    assert _drain(engine)[(rid, 0)][0] == _generate(model, prompt, 8)


def _staggered(engine, text) -> dict:
    """Three greedy requests, the later ones joining while the first decodes: decode-only steps of one
    sequence and of several, and steps that mix a prefill with decodes."""
    params = SamplingParams(max_tokens=12)
    engine.add_request(text[100:123], params, request_id="a")
    for _ in range(4):
        engine.step()
    engine.add_request(text[500:505], params, request_id="b")   # a prompt inside one block
    engine.add_request(text[900:940], params, request_id="c")
    return {key: tokens for key, (tokens, _) in _drain(engine).items()}


def test_a_decode_callable_runs_exactly_the_decode_only_steps_past_one_block(model, text):
    """Engine(decode=...) hands the steps that only decode, once the tables span more than one block, to
    `decode(token_ids (1, B), step)`; every other step runs the model. With the model's own forward as
    `decode`, every token equals a plain engine's."""
    seen = []

    def decode(token_ids, step):
        seen.append((token_ids.shape[1], step.layout.num_queries))
        return model(token_ids, step=step, last_only=True)[0]

    plain = Engine(model, block_size=8, max_num_seqs=4)
    routed = Engine(model, block_size=8, max_num_seqs=4, decode=decode)
    want = _staggered(plain, text)
    steps = []
    runner_execute = routed.runner.execute

    def execute(batch, manager):
        before = len(seen)
        out = runner_execute(batch, manager)
        contexts = [manager.table(s.seq_id).num_tokens for s in batch.decodes]
        steps.append((len(batch.prefills), contexts, len(seen) > before))
        return out

    routed.runner.execute = execute
    assert _staggered(routed, text) == want
    for prefills, contexts, used in steps:
        assert used == (prefills == 0 and max(contexts) > 8), (prefills, contexts, used)
    batch_sizes = {B for B, _ in seen}
    assert 1 in batch_sizes and max(batch_sizes) > 1            # alone, and beside others
    assert all(B == queries for B, queries in seen)             # one token per sequence
    with pytest.raises(TypeError, match="decode must be None or a callable"):
        Engine(model, decode="compiled")


def test_warm_up_leaves_an_idle_empty_engine(model, text):
    engine = Engine(model, block_size=8, max_num_seqs=4)
    free = engine.manager.num_free_blocks
    engine.warm_up()
    assert not engine.has_unfinished() and engine.manager.num_free_blocks == free and engine.stats()["running"] == 0
    assert _staggered(engine, text) == _staggered(Engine(model, block_size=8, max_num_seqs=4), text)
    engine.add_request(text[:10], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()


@pytest.mark.slow
def test_compiled_engine_decode_matches_the_eager_engine(model, text):
    """The fast path's compiled decode (`serve`'s default): the same greedy tokens as the eager engine,
    after a warm-up that compiled one graph for a single sequence and one for several, shared by every
    block (not one per layer), with no recompilation after it and the model's blocks left eager."""
    from cs336_inference.workshop.fast_path import compiled_engine_decode

    torch._dynamo.reset()
    decode, how = compiled_engine_decode(model)
    if decode is None:
        pytest.skip(how)
    compiled = Engine(model, block_size=8, max_num_seqs=4, decode=decode)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.warm_up()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert len(model.layers) > 2 and frames - before == 2      # every layer runs the same two graphs
    assert _staggered(compiled, text) == _staggered(Engine(model, block_size=8, max_num_seqs=4), text)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames   # no new graph after the warm-up
    assert not any("forward" in vars(block) for block in model.layers)


def test_compiled_engine_decode_falls_back_to_eager_and_restores_the_blocks(model, text, monkeypatch, capsys):
    """A compiler failure inside a decode step: said once, the step and the rest run eagerly with the same
    tokens, and no block keeps the compiled forward (the model is the user's)."""
    from cs336_inference.workshop import fast_path

    calls = []

    def broken_compile(fn, **options):
        def run(*args):
            calls.append(args[0])
            raise RuntimeError("inductor failed")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    decode, how = fast_path.compiled_engine_decode(model)
    if decode is None:
        pytest.skip(how)
    got = _staggered(Engine(model, block_size=8, max_num_seqs=4, decode=decode), text)
    assert len(calls) == 1 and calls[0] is model.layers[0]   # the first block, then eagerly from there
    assert "torch.compile failed (RuntimeError)" in capsys.readouterr().err
    assert got == _staggered(Engine(model, block_size=8, max_num_seqs=4), text)
    assert not any("forward" in vars(block) for block in model.layers)


def test_a_failed_forward_leaves_no_prefix_cache_names_behind(model, text):
    """The scheduler names a prompt's full blocks in the prefix cache when it schedules them, before the
    forward writes their K/V. A forward that raises before any layer ran leaves those blocks empty: their
    names must go (state as before the step), so the same prompt afterwards computes its K/V again and
    decodes exactly as `generate`."""
    prompt = text[500:510]                                             # 2 full blocks of 4, and 2 tokens
    engine = Engine(model, block_size=4)
    engine.add_request(prompt, SamplingParams(max_tokens=4), request_id="failed")

    def boom(module, args):
        raise RuntimeError("boom")

    handle = model.token_embeddings.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.step()
    finally:
        handle.remove()
    assert [o.finish_reason for o in engine.step()] == ["error"]
    assert engine.manager.num_cached_tokens(prompt) == 0, "blocks whose K/V were never written are still named"
    engine.add_request(prompt, SamplingParams(max_tokens=4), request_id="again")
    streams = _drain(engine)
    assert streams[("again", 0)][1][0].num_cached_tokens == 0
    assert streams[("again", 0)][0] == _generate(model, prompt, 4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_bad_logit_row_among_good_ones_is_refused_naming_its_request(temperature):
    """A step of two running requests whose logits are NaN for one sequence only: the step raises a ValueError
    naming that request (and not the other), greedy or sampled; a bad row must not pass because others are good."""
    model = adapters.make_model(adapters.make_config(vocab_size=257, context_length=64, d_model=32, num_layers=2,
                                                     num_heads=4, num_kv_heads=2, d_ff=64), seed=0).eval()
    engine = Engine(model, block_size=4, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=0)
    engine.add_request([1, 2, 3], params, request_id="good")
    engine.add_request([4, 5, 6, 7], params, request_id="poisoned")
    engine.step()                                  # both prefilled: the next step decodes both
    assert len(engine.scheduler.running) == 2

    def poison(module, args, out):                 # (rows, V) of this step, one row per running sequence
        out.view(-1, out.shape[-1])[0] = float("nan")
    handle = model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(ValueError, match=r"NaN or \+inf") as err:
            engine.step()
    finally:
        handle.remove()
    named = [rid for rid in ("good", "poisoned") if repr(rid) in str(err.value)]
    assert len(named) == 1, f"exactly the poisoned row's request must be named: {err.value}"
