"""Our few-row dense matmul (`workshop.kernels.cpu_attention`' `dense_gemv`, run by `cpu_tuning.CPULinear`): against a
float64 product written here, routed only where it applies, inside a model against torch's matmuls, and
compiled. Skipped where the CPU cannot run it.

Not graded: this checks the library's own kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch

import adapters
from decode_checks import OpCalls, assert_compiled_decode_matches_eager
from cs336_inference.workshop import cpu_tuning
from cs336_inference.workshop.kernels import cpu_attention

why_not = cpu_attention.build()   # builds it here once, where the CPU can run it
needs_kernel = pytest.mark.skipif(why_not is not None, reason=f"our CPU kernels cannot run here: {why_not}")


@pytest.fixture(params=[256, 512])
def load_bits(request):
    """Run the test with the kernel's 256-bit loads and with its 512-bit ones (each CPU uses one by default:
    `dense_gemv_load_bits`), then go back to the default."""
    assert torch.ops.cs336.dense_gemv_load_bits(request.param) == request.param
    yield request.param
    torch.ops.cs336.dense_gemv_load_bits(0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 5, 7), (2, 33, 576), (3, 96, 100), (4, 7, 1536), (5, 64, 64),
                                   (7, 3, 250), (16, 40, 576), (1, 4100, 24)])
def test_dense_gemv_equals_a_float64_product(dtype, M, N, K, load_bits):
    """Every row count (tiles of 4 and the 1 to 3 left over), K with a partial last chunk of either load
    width, N not a multiple of anything, and enough rows for both threads."""
    g = torch.Generator().manual_seed(M * 1000 + K)
    x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    y = torch.ops.cs336.dense_gemv(x, w, 16)
    assert y.shape == (M, N) and y.dtype == dtype
    want = x.double() @ w.double().T                     # the inputs as they are (already rounded to dtype)
    # fp32 accumulation (about sqrt(K) roundings of 2^-24 relative to sum |x w|), then, for bf16, one
    # rounding of the output (2^-9 relative)
    scale = (x.double().abs() @ w.double().abs().T)
    accumulate = 1e-6 * scale
    rounding = want.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0
    assert ((y.double() - want).abs() <= accumulate + rounding).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv_hands_more_than_max_rows_to_torchs_matmul(dtype):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 40, generator=g).to(dtype), torch.randn(24, 40, generator=g).to(dtype)
    assert torch.equal(torch.ops.cs336.dense_gemv(x, w, 8), torch.nn.functional.linear(x, w))   # 9 > 8: torch's
    ours = torch.ops.cs336.dense_gemv(x, w, 9)                                                 # 9 rows: ours
    torch.testing.assert_close(ours.float(), (x.double() @ w.double().T).float(), rtol=2 ** -7, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_dense_gemv_gives_every_row_once_when_threads_take_rows_from_each_other(threads):
    """Each thread streams its own share and a thread done early takes chunks from the back of another's:
    more threads than cores (so some fall behind and others take over), shares of unequal length, and
    repeated calls must still give every output row exactly once, equal to a float64 product."""
    g = torch.Generator().manual_seed(threads)
    x, w = torch.randn(3, 64, generator=g), torch.randn(20011, 64, generator=g)
    want = (x.double() @ w.double().T).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(8):
            torch.testing.assert_close(torch.ops.cs336.dense_gemv(x, w, 16), want, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_dense_gemv_loads_256_bits_on_zen4_and_512_elsewhere():
    """Zen 4 (AMD family 25) splits a 512-bit load in two and streamed faster with 256-bit ones; Intel's
    cores read 64 bytes at once (the choice and its measurements: csrc/dense_gemv.cpp). -1 reads the
    width, 0 restores the default, anything else is refused by name and changes nothing."""
    first_cpu = open("/proc/cpuinfo").read().split("\n\n")[0]
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}
    default = 256 if (info.get("vendor_id"), info.get("cpu family")) == ("AuthenticAMD", "25") else 512
    op = torch.ops.cs336.dense_gemv_load_bits
    assert op(-1) == op() == default
    try:
        assert op(256) == 256 and op(-1) == 256
        for bad in (128, 1, -2):
            with pytest.raises(ValueError, match=f"bits must be .*got {bad}"):
                op(bad)
        assert op(-1) == 256
    finally:
        assert op(0) == default


@needs_kernel
def test_dense_gemv_refuses_what_it_cannot_multiply():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    for args, match in (((x, torch.randn(3, 9)), "x must be"), ((x.double(), w.double()), "fp32 or both bf16"),
                        ((x, w.bfloat16()), "fp32 or both bf16"), ((x, torch.randn(8, 3).T), "contiguous")):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.cs336.dense_gemv(*args, 16)


def _model(dtype=torch.float32):
    config = adapters.make_config(vocab_size=97, context_length=64, d_model=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, d_ff=160)
    return adapters.make_model(config, seed=0).eval().to(dtype)


@needs_kernel
def test_cpu_linear_runs_our_kernel_only_for_a_few_rows_without_autograd():
    lin = cpu_tuning.tune_for_cpu(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), split=False)[0]
    assert isinstance(lin, cpu_tuning.CPULinear) and lin.gemv
    cases = [(torch.randn(1, 1, 64), True, False), (torch.randn(2, 8, 64), True, False),       # 1 and 16 rows
             (torch.randn(17, 64), False, False), (torch.randn(3, 64).double(), False, False),  # 17 rows, fp64
             (torch.randn(1, 64), False, True)]                                                  # autograd
    for x, ours, grad in cases:
        w = lin.weight.to(x.dtype)
        with torch.set_grad_enabled(grad), OpCalls() as calls:
            y = lin.to(x.dtype)(x)
        assert ("cs336.dense_gemv" in calls.names) == ours, (tuple(x.shape), x.dtype, grad)
        torch.testing.assert_close(y.detach(), x @ w.detach().T, rtol=1e-5, atol=1e-5)
    lin.gemv = False
    with torch.no_grad(), OpCalls() as calls:
        lin.float()(torch.randn(1, 64))
    assert "cs336.dense_gemv" not in calls.names


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_keeps_fewer_rows_on_our_kernel_where_the_cpu_has_amx(monkeypatch, amx):
    """Where AMX multiplies 16-row bf16 tiles, torch's matmul wins from 3 rows on: bf16 keeps 2 rows on
    our kernel there, 16 elsewhere; fp32 keeps 16 either way. Each result equals torch's to rounding."""
    monkeypatch.setattr(cpu_tuning, "cpu_has_amx", lambda: amx)
    lin = cpu_tuning.tune_for_cpu(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), split=False)[0]
    bar = {torch.bfloat16: 2 if amx else 16, torch.float32: 16}
    for dtype, rows in ((torch.bfloat16, 2), (torch.bfloat16, 3), (torch.bfloat16, 16), (torch.float32, 16)):
        assert cpu_tuning.gemv_max_rows(dtype) == bar[dtype]
        x = torch.randn(rows, 64).to(dtype)
        with torch.no_grad(), OpCalls() as calls:
            y = lin.to(dtype)(x)
        assert ("cs336.dense_gemv" in calls.names) == (rows <= bar[dtype]), (dtype, rows)
        want = x.double() @ lin.weight.double().T
        torch.testing.assert_close(y.double(), want, rtol=2 ** -7, atol=1e-2)
    record = cpu_tuning.tune_for_cpu(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))).cpu_tuning
    assert ("bf16: <= 2" in record.describe()) == amx


@needs_kernel
def test_a_compiled_graph_with_a_symbolic_batch_size_has_no_guard_on_it():
    """Batch 1 (a size the compiler specializes) and a batch size the graph keeps symbolic both call our
    kernel, with no guard on the size: 20 rows, past GEMV_MAX_ROWS (the kernel hands them to torch's
    matmul), reuse the graph of 3; a fixed large row count compiles to torch's matmul alone."""
    lin = cpu_tuning.tune_for_cpu(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), split=False)[0]
    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lin, backend=recording, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for rows in (1, 3, 20):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(step(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)
        assert len(graphs) == 2
        torch.compile(lin, backend=recording, dynamic=False, fullgraph=True)(torch.randn(40, 64))
    assert [any(t.startswith("cs336.dense_gemv") for t in targets) for targets in graphs] == [True, True, False]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tuned_model_decodes_on_our_kernel_like_torchs_matmuls(dtype):
    """Prefill (24 rows: torch's matmul) then decode steps (ours) give torch's logits to rounding and the
    same greedy tokens; every linear of each decode step (2 layers x 4, and the head) ran our kernel."""
    plain = _model(dtype)
    tuned = cpu_tuning.tune_for_cpu(copy.deepcopy(plain), split=False, threads=False)
    ids = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(3))
    logits, calls = {}, {}
    for name, model in (("plain", plain), ("tuned", tuned)):
        cache = adapters.make_kv_cache(model, 1, 32)
        with torch.no_grad(), OpCalls() as recorder:
            steps = [adapters.run_model(model, ids[:, :24], cache)]
            steps += [adapters.run_model(model, ids[:, t:t + 1], cache) for t in range(24, 32)]
        logits[name], calls[name] = torch.cat(steps, 1).float(), recorder.names.count("cs336.dense_gemv")
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert calls == {"plain": 0, "tuned": 8 * linears}
    atol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(logits["tuned"], logits["plain"], rtol=0, atol=atol)
    prompt = [[1, 2, 3, 4], [5, 6, 7]]
    assert (adapters.run_generate(tuned, prompt, 12).tokens == adapters.run_generate(plain, prompt, 12).tokens)


@needs_kernel
def test_a_compiled_decode_step_on_our_kernel_matches_eager():
    from cs336_inference.generation import compile_decode

    torch._dynamo.reset()
    model = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False)
    step = compile_decode(model)                                         # fullgraph=True: no graph break
    ids = torch.randint(0, 97, (1, 14), generator=torch.Generator().manual_seed(4))
    assert_compiled_decode_matches_eager(model, step, ids, prefill=8, atol=1e-5)


def test_tune_for_cpu_says_where_our_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_attention, "build", lambda: "the CPU has no AVX512-BF16 (needs e.g. Zen 4)")
    tuned = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False)
    assert not any(m.gemv for m in tuned.modules() if isinstance(m, cpu_tuning.CPULinear))
    assert "our few-row kernel cannot run here: the CPU has no AVX512-BF16" in cpu_tuning.describe(tuned)
    off = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False, gemv=False)
    assert "few-row kernel" not in cpu_tuning.describe(off)
    with pytest.raises(TypeError, match="gemv must be True or False, got str 'yes'"):
        cpu_tuning.tune_for_cpu(_model(), gemv="yes")
