"""Decode-speed options give the same model: fused projections (with the CS336 state-dict keys kept
on save and load) and torch's fused attention kernel, both against the plain model in this test."""

import copy
from unittest import mock

import pytest
import torch

import adapters
from cs336_inference.workshop.kernels import cpu_attention

CFG = dict(vocab_size=97, context_length=48, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96)
VARIANTS = {"gqa": {}, "mha": dict(num_kv_heads=4), "window": dict(sliding_window=6),
            "cla": dict(kv_share_group=2)}


def _model(**overrides):
    return adapters.make_model(adapters.make_config(**{**CFG, **overrides}), seed=0).eval()


def _cached_logits(model, ids, prompt=8):
    """Prefill `prompt` tokens, then decode the rest one by one: logits (B, T, V)."""
    cache = adapters.make_kv_cache(model, ids.shape[0], ids.shape[1])
    steps = [adapters.run_model(model, ids[:, :prompt], cache)]
    steps += [adapters.run_model(model, ids[:, t:t + 1], cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_projections_give_the_same_logits_and_tokens(variant):
    plain = _model(**VARIANTS[variant])
    fused = adapters.run_fuse_projections(copy.deepcopy(plain))
    assert any(n.endswith("qkv_proj") for n, _ in fused.named_modules())
    assert any(n.endswith("w13") for n, _ in fused.named_modules())
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        for run in (lambda m: adapters.run_model(m, ids), lambda m: _cached_logits(m, ids)):
            torch.testing.assert_close(run(fused), run(plain), rtol=0, atol=1e-5)
    prompt = [[1, 2, 3, 4], [5, 6]]
    assert adapters.run_generate(fused, prompt, 12).tokens == adapters.run_generate(plain, prompt, 12).tokens


def test_fused_state_dict_keeps_cs336_keys_and_round_trips(tmp_path):
    plain = _model()
    fused = adapters.run_fuse_projections(copy.deepcopy(plain))
    expected = plain.state_dict()
    got = fused.state_dict()
    assert list(got) == list(expected)                      # same keys, same order
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert "layers.0.attn.q_proj.weight" in got and "layers.0.ffn.w3.weight" in got
    # save a fused model, load it as a plain CS336 model: identical weights
    adapters.run_save_checkpoint(tmp_path / "fused.pt", fused)
    loaded = adapters.run_load_checkpoint(tmp_path / "fused.pt")
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)
    # a CS336 state dict loads into a fused model, which then computes the plain model's logits
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fused.load_state_dict(other.state_dict())
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(adapters.run_model(fused, ids), adapters.run_model(other, ids), rtol=0, atol=1e-5)
    unfused = adapters.run_unfuse_projections(copy.deepcopy(fused))
    assert not any(n.endswith("qkv_proj") for n, _ in unfused.named_modules())
    assert all(torch.equal(unfused.state_dict()[k], other.state_dict()[k]) for k in expected)


def test_quantizing_a_fused_model_and_refusing_to_fuse_a_quantized_one():
    plain = _model()
    fused = adapters.run_fuse_projections(copy.deepcopy(plain))
    q_fused = adapters.run_quantize_model(fused, "rtn", bits=8, group_size=None, symmetric=True,
                                          kernel="reference")
    q_plain = adapters.run_quantize_model(plain, "rtn", bits=8, group_size=None, symmetric=True,
                                          kernel="reference")
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():   # per-row codes: quantizing [Wq; Wk; Wv] = stacking the quantized parts
        torch.testing.assert_close(adapters.run_model(q_fused, ids), adapters.run_model(q_plain, ids),
                                   rtol=0, atol=1e-5)
    with pytest.raises(TypeError, match="fuse before quantizing"):
        adapters.run_fuse_projections(copy.deepcopy(q_plain))


def test_a_compiled_step_refuses_a_full_cache_and_another_batch_size_with_the_caches_error():
    """Past the end of its cache, or with a batch the cache does not hold, the compiled step raises the
    cache's own ValueError before tracing anything (traced, it surfaced as a dynamo error), and the cache
    is left as it was."""
    from cs336_inference.generation import compile_decode

    model = _model()
    step = compile_decode(model)
    full, three = adapters.make_kv_cache(model, 1, 8), adapters.make_kv_cache(model, 3, 16)
    with torch.no_grad():
        adapters.run_model(model, torch.randint(0, 97, (1, 8)), full)
        adapters.run_model(model, torch.randint(0, 97, (3, 4)), three)
    k = full.layers[0].k.clone()
    with pytest.raises(ValueError, match="cache overflow: 8 cached"):
        step(torch.tensor([5]), full)
    with pytest.raises(ValueError, match="cache holds 3 sequences but token_ids has batch 1"):
        step(torch.tensor([5]), three)
    assert (full.length, three.length) == (8, 4) and torch.equal(full.layers[0].k, k)


def test_the_fast_paths_step_passes_bad_input_errors_on_and_stays_compiled(monkeypatch, capsys):
    """The CLI's step falls back to eager after a compiler failure; a refused input is not one: its
    ValueError reaches the caller, nothing says "torch.compile failed", and the next step still runs
    the compiled function (here a stand-in that records its calls, so nothing compiles)."""
    from cs336_inference.workshop import fast_path

    calls = []

    def fake_compile(fn, **options):
        def run(*args, **kwargs):
            calls.append(len(args))
            return fn(*args, **kwargs)
        return run

    model = _model()
    monkeypatch.setattr(torch, "compile", fake_compile)
    step, how = fast_path.compiled_decode_step(model)
    if step is None:
        pytest.skip(how)
    full, cache = adapters.make_kv_cache(model, 1, 8), adapters.make_kv_cache(model, 1, 16)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        adapters.run_model(model, ids[:, :8], full)
        adapters.run_model(model, ids[:, :8], cache)
        with pytest.raises(ValueError, match="cache overflow"):
            step(ids[:, 8], full)
        assert calls == []
        torch.testing.assert_close(step(ids[:, 8], cache), _cached_logits(model, ids)[:, -1], rtol=0, atol=1e-5)
    assert calls == [1] and "torch.compile failed" not in capsys.readouterr().err


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sdpa_kernel_equals_the_hand_written_attention(variant):
    plain = _model(**VARIANTS[variant])
    fast = adapters.run_set_attention_kernel(copy.deepcopy(plain), "sdpa")
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        for run in (lambda m: adapters.run_model(m, ids), lambda m: _cached_logits(m, ids)):
            torch.testing.assert_close(run(fast), run(plain), rtol=0, atol=1e-5)
        pad = torch.tensor([0, 3])   # left padding: the mask path
        torch.testing.assert_close(adapters.run_model(fast, ids, pad=pad), adapters.run_model(plain, ids, pad=pad),
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="attention kernel"):
        adapters.run_set_attention_kernel(plain, "flash")


@pytest.mark.slow
def test_compiled_decode_has_no_graph_break_and_matches_eager():
    """fullgraph=True makes a graph break an error, and a recompile limit of 2 makes recompiling per
    position, per cache object or per thread count an error: positions 8.. of fresh caches, batch 1
    then 3, twice over (the second time on one thread, as `cpu_tuning.decode_threads` does under
    contention), run on at most two graphs (batch 1 is specialised, then the batch size becomes a symbol).
    The model is the plain one: nothing in it is special-cased for the compiler."""
    from cs336_inference.generation import compile_decode
    from cs336_inference.timing import num_threads
    from host_syncs import profiled_host_syncs

    torch._dynamo.reset()
    model = adapters.run_set_attention_kernel(adapters.run_fuse_projections(_model()), "sdpa")
    step = compile_decode(model)             # fullgraph=True, dynamic=True
    with torch._dynamo.config.patch(recompile_limit=2), num_threads(2):    # restores the count afterwards
        for B, threads in ((1, 2), (3, 2), (1, 1), (3, 1)):   # the second pass as under contention (one thread)
            torch.set_num_threads(threads)
            ids = torch.randint(0, 97, (B, 14))
            # room beyond the last position: filling a cache to the brim is its own (third) graph
            eager_cache = adapters.make_kv_cache(model, B, 16)
            cache = adapters.make_kv_cache(model, B, 16)
            with torch.no_grad():
                adapters.run_model(model, ids[:, :8], eager_cache)
                adapters.run_model(model, ids[:, :8], cache)
                for t in range(8, 14):
                    expected = adapters.run_decode_one_token(model, ids[:, t], eager_cache)
                    torch.testing.assert_close(step(ids[:, t], cache), expected, rtol=0, atol=1e-5)
            assert cache.length == 14
        with torch.no_grad():   # the compiled step reads nothing back (torch.compile refuses a dispatch mode)
            assert profiled_host_syncs(lambda: step(ids[:, 13], cache)) == []
    with pytest.raises(ValueError, match="vocab_size"):   # an empty cache: its first forward runs eagerly, checked
        step(torch.tensor([97]), adapters.make_kv_cache(model, 1, 4))


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_compiled_step_traces_the_models_floats_and_weights_into_the_graph(frozen):
    """dynamic=True makes each float attribute of the model (every RMSNorm's eps) a graph input, turned
    into a tensor before every step, and dynamo fetches each weight through the module tree before every
    step to pass it in. frozen=True promises the model never changes: its floats are constants, its
    weights (and buffers) the graph's own, and the only inputs are the ids, the cache's tensors and its
    length. Not frozen, floats and weights stay inputs. Either way the step equals eager decoding, also
    after a weight changed in place, and the settings do not leak."""
    from cs336_inference.generation import compile_decode
    seen = {"floats": [], "tensor_inputs": 0, "graph_parameters": 0}

    def backend(graph, example_inputs):   # records the graph's inputs and its own parameters
        for node in graph.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.SymFloat) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                                     and value.dtype == torch.float64):
                seen["floats"].append(node.name)
            elif isinstance(value, torch.Tensor):
                seen["tensor_inputs"] += 1
        seen["graph_parameters"] += len(list(graph.parameters())) + len(list(graph.buffers()))
        return graph.forward

    torch._dynamo.reset()
    model = _model()
    step = compile_decode(model, frozen=frozen, backend=backend)
    config = {name: getattr(torch._dynamo.config, name) for name in ("specialize_float", "install_free_tensors")}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    eager, cache = adapters.make_kv_cache(model, 1, 16), adapters.make_kv_cache(model, 1, 16)
    with torch.no_grad():
        adapters.run_model(model, ids[:, :3], eager)
        adapters.run_model(model, ids[:, :3], cache)
        for t in (3, 4, 5):
            if t == 5:   # the same weight tensors, not copies: an in-place change shows at the next step
                model.layers[0].ffn.w2.weight.mul_(3)
            expected = adapters.run_decode_one_token(model, ids[:, t], eager)
            torch.testing.assert_close(step(ids[:, t], cache), expected, rtol=0, atol=1e-5)
    weights = len(list(model.parameters())) + len(list(model.buffers()))   # the buffers: RoPE tables
    eps = [name for name in seen["floats"] if name.endswith("_eps")]
    assert (seen["floats"] == []) if frozen else len(eps) == 2 * len(model.layers) + 1, seen["floats"]
    cache_and_ids = 2 * len(model.layers) + 1
    if frozen:
        assert (seen["tensor_inputs"], seen["graph_parameters"]) == (cache_and_ids, weights), seen
    else:
        assert (seen["tensor_inputs"], seen["graph_parameters"]) == (cache_and_ids + weights, 0), seen
    assert {name: getattr(torch._dynamo.config, name) for name in config} == config


@pytest.mark.parametrize("frozen", [True, False])
def test_a_dropped_compiled_step_lets_its_model_be_freed(frozen):
    """A frozen graph holds the model's weights as its own parameters; once the step and the model are
    dropped, the weights are freed, not kept alive by dynamo for the life of the process."""
    import gc
    import weakref

    from cs336_inference.generation import compile_decode

    model = _model()
    weight = weakref.ref(next(model.parameters()))
    step = compile_decode(model, frozen=frozen, backend="eager")
    cache = adapters.make_kv_cache(model, 1, 8)
    with torch.no_grad():
        adapters.run_model(model, torch.tensor([[1, 2, 3]]), cache)
        step(torch.tensor([4]), cache)
    del model, step, cache
    gc.collect()
    assert weight() is None


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32)])
def test_a_compiled_step_keeps_packed_weights_at_fixed_shapes(bits, group_size):
    """dynamic=True makes every input's sizes symbols, and each relation between symbols a guard checked
    before every step. A packed weight's shape never changes: its sizes stay constants in the graph,
    while the cache's (whose length varies) stay symbols. (Not frozen: a frozen step's weights are the
    graph's own, not inputs at all.)"""
    from cs336_inference.generation import compile_decode
    seen = {}

    def backend(graph, example_inputs):   # records each graph input: (dtype, whether a size is a symbol)
        for node in graph.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                seen[node.name] = any(isinstance(size, torch.SymInt) for size in value.shape)
        return graph.forward

    torch._dynamo.reset()
    model = adapters.run_quantize_model(_model(), "rtn", bits=bits, group_size=group_size)
    step = compile_decode(model, backend=backend)
    cache = adapters.make_kv_cache(model, 1, 16)
    with torch.no_grad():
        adapters.run_model(model, torch.tensor([[1, 2, 3]]), cache)
        step(torch.tensor([4]), cache)
    packed = {name: symbolic for name, symbolic in seen.items() if "_packed_" in name}
    assert packed, f"no packed weight among the graph's inputs: {sorted(seen)[:5]}"
    assert not any(packed.values()), [name for name, symbolic in packed.items() if symbolic]
    assert seen["l_cache_layers_0_k"], "the cache's sizes should stay symbols (one graph for every length)"


@pytest.mark.slow
def test_the_fast_path_guards_only_the_inputs_of_its_compiled_step(monkeypatch):
    """`fast_path.compile_fast` (CPU) drops the guards on the model and keeps those on the ids and the
    cache: the guards it keeps name no module of the model, and the cache's tensors are among them.
    Each step still equals eager decoding, compiles a new graph for a new batch size (a cache guard
    fails) rather than running the batch-1 graph on it, and models compiled in one process (one of
    them int8, with other modules; one bf16, on other compile options) never run each other's graphs."""
    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.workshop import fast_path
    from cs336_inference.generation import compiled

    decided = []

    def recording(entries):
        keep = compiled_filter(entries)
        decided.extend((entry.name, kept) for entry, kept in zip(entries, keep))
        return keep

    compiled_filter = compiled.without_model_guards
    monkeypatch.setattr(compiled, "without_model_guards", recording)
    torch._dynamo.reset()
    plain = adapters.run_set_attention_kernel(adapters.run_fuse_projections(_model()), "sdpa")
    int8 = adapters.run_quantize_model(_model(), "rtn", bits=8, group_size=None, symmetric=True)
    # bf16 with the CPU tuning: its linears stream, and the fast path stores each norm's output once
    bf16 = cpu_tuning.tune_for_cpu(_model().to(torch.bfloat16), split=False, threads=False)
    steps = {model: fast_path.compile_fast(model) for model in (plain, int8, bf16)}
    # bf16 activations (int8's kernel takes them too): inductor rounds at other points than eager does
    # (rtol, atol); bf16 logits are themselves rounded to 2^-8 of their size
    tolerance = {plain: (0, 1e-5), int8: (0, 3e-2), bf16: (2 ** -6, 3e-2)}
    # batch 3 on the fp32 model only: one recompile shows the cache guard firing (each compile costs ~10 s)
    for B, models in ((1, steps), (3, [plain])):
        for model in models:
            step = steps[model]
            ids = torch.randint(0, 97, (B, 12))
            eager_cache, cache = adapters.make_kv_cache(model, B, 16), adapters.make_kv_cache(model, B, 16)
            with torch.no_grad():
                adapters.run_model(model, ids[:, :8], eager_cache)
                adapters.run_model(model, ids[:, :8], cache)
                for t in range(8, 12):
                    expected = adapters.run_decode_one_token(model, ids[:, t], eager_cache)
                    rtol, atol = tolerance[model]
                    torch.testing.assert_close(step(ids[:, t], cache), expected, rtol=rtol, atol=atol)
    kept = [name for name, keep in decided if keep]
    dropped = [name for name, keep in decided if not keep]
    on_model = [name for name in kept if "._modules[" in name or "._parameters[" in name]
    assert not on_model, f"guards on the model were kept: {on_model[:3]}"
    assert any("._modules[" in name for name in dropped)
    assert any(name.startswith("cache.layers[0].k") for name in kept) and "ids" in kept


@pytest.mark.parametrize("variant", ["gqa", "cla"])
def test_the_static_decode_step_of_cuda_graphs_equals_the_plain_step(variant):
    """What `compile_decode(mode="reduce-overhead")` records, run eagerly: the position as a device tensor,
    writes with index_copy_, attention over the whole buffer under a mask. Same logits as `decode_one_token`,
    no host sync, and the buffers keep their addresses (a CUDA graph replays on fixed addresses)."""
    from cs336_inference.generation.compiled import static_decode
    from host_syncs import HostSyncCounter

    model = _model(**VARIANTS[variant])
    ids = torch.randint(0, 97, (2, 14))
    plain, static = adapters.make_kv_cache(model, 2, 16), adapters.make_kv_cache(model, 2, 16)
    addresses = [layer.k.data_ptr() for layer in static.layers]
    with torch.no_grad():
        adapters.run_model(model, ids[:, :8], plain)
        adapters.run_model(model, ids[:, :8], static)
        for t in range(8, 14):
            want = adapters.run_decode_one_token(model, ids[:, t], plain)
            position = torch.full((1,), static.length)
            with HostSyncCounter() as syncs:
                got = static_decode(model, ids[:, t:t + 1], position, static)[:, -1]
            static.length += 1
            assert syncs.count == 0, syncs.seen
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert [layer.k.data_ptr() for layer in static.layers] == addresses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_decode_with_cuda_graphs_matches_eager_and_never_syncs():
    from cs336_inference.generation import compile_decode
    from host_syncs import profiled_host_syncs

    torch._dynamo.reset()
    model = _model().to("cuda", torch.bfloat16)
    step = compile_decode(model, mode="reduce-overhead")
    ids = torch.randint(0, 97, (2, 20), device="cuda")
    plain, graphed = adapters.make_kv_cache(model, 2, 24), adapters.make_kv_cache(model, 2, 24)
    with torch.no_grad():
        adapters.run_model(model, ids[:, :8], plain)
        adapters.run_model(model, ids[:, :8], graphed)
        for t in range(8, 19):
            want = adapters.run_decode_one_token(model, ids[:, t], plain)
            torch.testing.assert_close(step(ids[:, t], graphed), want, rtol=2e-2, atol=2e-2)
        assert graphed.length == 19
        assert profiled_host_syncs(lambda: step(ids[:, 19], graphed)) == []
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


def test_other_cpu_load_subtracts_our_own_cpu_time(monkeypatch):
    """The formula on controlled samples: (all CPUs' busy seconds - ours) / wall seconds."""
    from cs336_inference.workshop.cpu_tuning import _OtherLoad

    meter = _OtherLoad(interval=0.0)
    samples = iter([(10.0, 100.0, 5.0), (12.0, 103.0, 6.5), (13.0, 104.0, 7.0)])   # (wall, all busy, ours)
    monkeypatch.setattr(meter, "_sample", lambda: next(samples))
    assert meter() is None                       # one sample: no interval yet
    assert meter() == pytest.approx((3.0 - 1.5) / 2.0)
    assert meter() == pytest.approx((1.0 - 0.5) / 1.0)


def test_a_busy_process_is_seen_as_contention():
    from cs336_inference.workshop.cpu_tuning import _OtherLoad
    from cs336_inference.timing import busy_cpu

    meter = _OtherLoad(interval=0.0)
    if meter() is None and meter._sample() is None:
        pytest.skip("no /proc/stat here")
    with busy_cpu(1):
        meter()
        import time
        time.sleep(0.6)
        assert meter() >= 0.5                   # the loop holds (nearly) a whole core


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_streaming_matmul_equals_a_float64_matmul(dtype, tol):
    """The compiled batch-1 linear's formula against x W^T in float64 (bf16: inputs rounded to bf16,
    then one rounding of the fp32-accumulated output, so ~2^-8 relative)."""
    from cs336_inference.workshop.cpu_tuning import streaming_matmul

    torch.manual_seed(0)
    w = torch.randn(48, 40).to(dtype)
    for x in (torch.randn(40).to(dtype), torch.randn(1, 1, 40).to(dtype), torch.randn(2, 3, 40).to(dtype)):
        expected = x.double() @ w.double().T
        got = streaming_matmul(x, w)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_a_compiled_graph_routes_only_one_row_inference_linears_to_streaming_matmul():
    """What `CPULinear` does while a graph is traced (is_compiling patched on, eagerly): one row without
    autograd -> streaming_matmul; several rows, or autograd on -> F.linear."""
    from cs336_inference.workshop import cpu_tuning

    seen = []

    def recording(x, w):
        seen.append(tuple(x.shape))
        return x @ w.T

    lin = cpu_tuning.CPULinear(8, 6, bias=False)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True), \
            mock.patch.object(cpu_tuning, "streaming_matmul", recording):
        with torch.no_grad():
            for shape in ((1, 1, 8), (8,), (3, 1, 8)):
                assert lin(torch.randn(shape)).shape == (*shape[:-1], 6)
        lin(torch.randn(1, 8))                     # grad enabled: a training graph keeps F.linear
        assert seen == [(1, 1, 8), (8,)]
        lin.split = False                          # calibrated off: fp32 rows go to F.linear, bf16 rows stream
        with torch.no_grad():
            lin(torch.randn(1, 8))
            assert seen == [(1, 1, 8), (8,)]
            lin.to(torch.bfloat16)(torch.randn(1, 8, dtype=torch.bfloat16))
    assert seen == [(1, 1, 8), (8,), (1, 8)]


@pytest.mark.parametrize("split_ms, gemm_ms, threads, splits", [(1.0, 2.0, 2, True), (2.0, 1.0, 2, False),
                                                                (1.0, 2.0, 1, False)])
def test_tune_for_cpu_keeps_the_few_row_split_only_where_it_measured_faster(monkeypatch, split_ms, gemm_ms, threads,
                                                                              splits):
    """split="auto" (the default) follows `calibrate_split`'s timing on the model's own linears (one
    thread: nothing to split, nothing timed); either way every linear is a `CPULinear` computing x W^T,
    and describe() says what was measured and chosen."""
    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.timing import num_threads

    plain = _model()
    timed = []
    monkeypatch.setattr(cpu_tuning, "calibrate_split", lambda linears, rounds=5: timed.append(len(linears)) or
                        {"split": split_ms / 1e3, "gemm": gemm_ms / 1e3})
    monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: False)
    with num_threads(threads):
        tuned = cpu_tuning.tune_for_cpu(copy.deepcopy(plain), gemv=False)   # a row through the split, not our kernel
        linears = [m for m in tuned.modules() if isinstance(m, torch.nn.Linear)]
        assert {type(m) for m in linears} == {cpu_tuning.CPULinear} and {m.split for m in linears} == {splits}
        assert timed == ([len(linears)] if threads > 1 else [])
        text = cpu_tuning.describe(tuned)
        assert ("linears split" in text) == splits and ("no few-row split" in text) == (threads > 1 and not splits)
        if threads > 1:
            assert f"{split_ms:.1f} ms split vs {gemm_ms:.1f} ms F.linear" in text
        calls = []
        monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or torch.ops.aten.bmm(*a))
        x = torch.randn(1, 1, 64)
        with torch.no_grad():
            for m in linears[:3]:
                torch.testing.assert_close(m(x), x @ m.weight.T, rtol=0, atol=1e-5)
        assert bool(calls) == splits           # the split runs through bmm; F.linear does not


def test_calibrate_split_times_both_kernels_over_every_linear(monkeypatch):
    """Both kernels are timed on every weight, once per round after a warm-up round, alternating."""
    from cs336_inference.workshop import cpu_tuning

    linears = [torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 24, bias=False).to(torch.bfloat16)]
    seen = []
    monkeypatch.setattr(cpu_tuning.F, "linear", lambda x, w: seen.append(("gemm", x.dtype, w.shape)) or x @ w.T)
    monkeypatch.setattr(cpu_tuning, "few_row_matmul", lambda x, w: seen.append(("split", x.dtype, w.shape)) or x @ w.T)
    times = cpu_tuning.calibrate_split(linears, rounds=3)
    assert set(times) == {"gemm", "split"} and all(t >= 0 for t in times.values())
    one_round = [(k, lin.weight.dtype, lin.weight.shape) for k in ("gemm", "split") for lin in linears]
    assert seen == one_round * 4


def test_decode_threads_drops_to_one_thread_only_under_contention(monkeypatch):
    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.workshop.cpu_tuning import decode_threads
    from cs336_inference.timing import num_threads

    with num_threads(2):
        monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: True)
        with decode_threads():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2          # restored
        monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: False)
        with decode_threads():
            assert torch.get_num_threads() == 2


def test_tune_for_cpu_is_opt_in_reversible_and_changes_no_result(monkeypatch):
    """The plain model has plain `nn.Linear`s and no hooks; `tune_for_cpu` swaps in `CPULinear` (same state
    dict), makes a decode step under contention run on one thread (restored after, also when the forward
    raises), says what it did, is idempotent, and `untune_cpu` gives the plain model back."""
    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.timing import num_threads

    plain = _model()
    assert {type(m) for m in plain.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    tuned = cpu_tuning.tune_for_cpu(cpu_tuning.tune_for_cpu(copy.deepcopy(plain)), split=True)   # twice: idempotent
    assert {type(m) for m in tuned.modules() if isinstance(m, torch.nn.Linear)} == {cpu_tuning.CPULinear}
    assert len(tuned._forward_pre_hooks) == 1 and len(tuned._forward_hooks) == 1
    assert "linears split" in cpu_tuning.describe(tuned) and "one thread" in cpu_tuning.describe(tuned)
    assert cpu_tuning.describe(plain) == "CPU tuning: none (plain model)"
    assert list(tuned.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 97, (2, 9))
    seen = []
    with num_threads(2):
        monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: True)
        caches = [adapters.make_kv_cache(m, 2, 10) for m in (plain, tuned)]
        with torch.no_grad():
            for m, cache in zip((plain, tuned), caches):
                adapters.run_model(m, ids[:, :8], cache)
            handle = tuned.lm_head.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
            want = adapters.run_decode_one_token(plain, ids[:, 8], caches[0])
            got = adapters.run_decode_one_token(tuned, ids[:, 8], caches[1])
            handle.remove()
        assert seen == [1] and torch.get_num_threads() == 2    # one thread inside the step, restored after
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        boom = tuned.lm_head.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            adapters.run_decode_one_token(tuned, ids[:, 8], caches[1])
        boom.remove()
        assert torch.get_num_threads() == 2
    back = cpu_tuning.untune_cpu(tuned)
    assert {type(m) for m in back.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert not back._forward_pre_hooks and not back._forward_hooks and not hasattr(back, "cpu_tuning")


def test_compile_decode_refuses_a_frozen_flag_that_is_not_a_bool():
    """`frozen` drops the guards on the model: a truthy string must not switch that on by accident."""
    from cs336_inference.generation import compile_decode

    with pytest.raises(TypeError, match="frozen"):
        compile_decode(_model(), frozen="yes")


def test_the_fast_path_stores_the_norm_once_only_where_its_linears_stream(monkeypatch):
    """A bf16 model's tuned linears stream inside the compiled step where our few-row kernel is off, and
    only there does the fast path ask inductor to store each norm's output rather than recompute it per
    weight row; fp32, int4 and our kernel's steps (library matmuls) compile with the default options."""
    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.workshop import fast_path
    from cs336_inference.generation import compiled

    seen = []
    monkeypatch.setattr(compiled, "compile_decode", lambda model, **kwargs: seen.append(kwargs))
    monkeypatch.setattr(cpu_tuning, "calibrate_split", lambda linears: {"split": 2.0, "gemm": 1.0})
    fp32 = _model()
    int4 = adapters.run_quantize_model(_model(), "rtn", 4, 32, symmetric=True, quantize_lm_head=True)
    for model, gemv in ((_model().to(torch.bfloat16), False), (_model().to(torch.bfloat16), True), (fp32, True),
                        (int4.to(torch.bfloat16), True)):
        fast_path.compile_fast(cpu_tuning.tune_for_cpu(model, gemv=gemv))
    ours = cpu_attention.build() is None   # where our kernel cannot run, a bf16 model streams either way
    assert [kwargs["options"].get("realize_cpu_opcount_threshold") for kwargs in seen] == [1, None if ours else 1,
                                                                                          None, None]
    assert all(kwargs["frozen"] is True and kwargs["options"]["cpp_wrapper"] is True for kwargs in seen)
    assert all(kwargs["options"]["size_asserts"] is False for kwargs in seen)   # the guards check the inputs
