"""Our AVX512-BF16 int4 matmul (`workshop.kernels.cpu_int4`): against a float64 matmul written here, inside
`QuantizedLinear` against torch's int4pack kernel, and compiled. Skipped where the CPU cannot run it.

Not graded: this checks the library's own kernel.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

from cs336_inference.quantization import QuantizedLinear
from cs336_inference.quantization.kernels import LINEAR
from cs336_inference.workshop.kernels import cpu_int4   # registers our kernel with the int4 layers

why_not = cpu_int4.why_unavailable()   # builds it here once, where the CPU can run it
needs_kernel = pytest.mark.skipif(why_not is not None, reason=f"our int4 kernel cannot run here: {why_not}")


def random_grid(N: int, K: int, group: int, seed: int = 0):
    """Codes u (N, K) in [0, 15] and int4pack (scale, zero) pairs (K / group, N, 2) in bf16."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (N, K), generator=g)
    scale = torch.rand(K // group, N, generator=g) * 0.02 + 1e-3
    zero = torch.randn(K // group, N, generator=g) * 0.01
    return u, torch.stack([scale, zero], dim=-1).bfloat16()


def reference(x: torch.Tensor, u: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """x @ W^T in float64, W = (u - 8) * scale + zero with each group's (scale, zero) from `pairs`."""
    group = u.shape[1] // pairs.shape[0]
    scale, zero = (pairs[..., i].double().t().repeat_interleave(group, dim=1) for i in (0, 1))   # (N, K)
    return x.double() @ ((u.double() - 8) * scale + zero).t()


@needs_kernel
@pytest.mark.parametrize("N,K,group,M", [(16, 32, 32, 1), (48, 576, 32, 1), (48, 576, 32, 3), (48, 576, 32, 4),
                                         (48, 576, 32, 9), (32, 1536, 64, 4), (16, 256, 256, 2), (64, 384, 128, 7)])
def test_matches_a_float64_matmul(N, K, group, M):
    u, pairs = random_grid(N, K, group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = cpu_int4.matmul(x, *cpu_int4.pack(u, pairs))
    want = reference(x, u, pairs)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    # fp32 sums rounded once to bf16: within bf16's half-ulp (2^-9 relative) and a little summation error
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-4 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("N,K,group,M", [(16, 32, 32, 1), (48, 576, 32, 1), (48, 576, 32, 5), (32, 1536, 64, 4),
                                         (64, 384, 128, 7)])
def test_fp32_activations_match_a_float64_matmul_to_about_16_bits(N, K, group, M):
    """fp32 x: split into two bf16 halves, near-fp32 sums in fp32 out; rounded once (split=False): bf16's error."""
    u, pairs = random_grid(N, K, group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)) * 3
    want = reference(x, u, pairs)
    top = float(want.abs().max())
    split = cpu_int4.matmul(x, *cpu_int4.pack(u, pairs))
    assert split.shape == (M, N) and split.dtype == torch.float32
    # x = hi + lo to ~2^-16 relative; the fp32 sums lose a few more bits to the 128 + u offset
    torch.testing.assert_close(split.double(), want, rtol=0, atol=2 ** -12 * top)
    once = cpu_int4.matmul(x, *cpu_int4.pack(u, pairs), split=False)
    assert once.dtype == torch.float32
    torch.testing.assert_close(once.double(), x.bfloat16().double() @ reference(torch.eye(K), u, pairs),
                               rtol=0, atol=2 ** -14 * top)   # exactly bf16(x) times W, up to fp32 sums
    if M * K >= 1000:   # the split is worth its second instruction: bf16(x) alone is off by far more
        assert float((once.double() - want).abs().max()) > 8 * float((split.double() - want).abs().max())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_out_the_same_alone_and_among_other_rows(dtype):
    """Batch invariance: row m of x gives the same bits whether multiplied alone, in a tile of four, or in
    the tile of one to three rows left over (each row's sums run in one order whatever the row count)."""
    u, pairs = random_grid(64, 576, 32)
    packed = cpu_int4.pack(u, pairs)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = cpu_int4.matmul(x, *packed)
    for start, stop in [(0, 1), (3, 4), (0, 2), (1, 4), (0, 4), (2, 9), (5, 11), (10, 11), (0, 7)]:
        assert torch.equal(cpu_int4.matmul(x[start:stop].contiguous(), *packed), together[start:stop]), (start, stop)


def _count_our_matmuls(monkeypatch, calls: list) -> None:
    """Our kernel's registry entry, with a matmul that appends to `calls` on each call."""
    counting = lambda *a, f=cpu_int4.matmul: calls.append(1) or f(*a)   # noqa: E731
    monkeypatch.setitem(LINEAR.kernels, cpu_int4.NAME, dataclasses.replace(cpu_int4.KERNEL, matmul=counting))


@needs_kernel
def test_an_fp32_layer_runs_our_kernel_at_every_row_count(monkeypatch):
    """With fp32 activations a layer on our kernel never takes the dense route (whose matmul would change
    a row's sums with the row count): fp32 out, close to a float64 matmul, above `dense_rows()` too."""
    layer = QuantizedLinear.from_linear(nn.Linear(192, 48, bias=False), bits=4, group_size=32)
    calls = []
    _count_our_matmuls(monkeypatch, calls)
    for rows in (1, layer.dense_above() + 1):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
        calls.clear()
        y = layer(x)
        assert calls and y.dtype == torch.float32, rows
        want = reference(x, layer.unsigned_form()[0], layer.packed_weight().scales)   # the kernel's (bf16) grid
        torch.testing.assert_close(y.double(), want, rtol=0, atol=2 ** -12 * float(want.abs().max()))
        assert torch.equal(layer(x[:1]), y[:1])


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_every_block_once_when_threads_take_blocks_from_each_other(threads):
    """More threads than cores and shares of unequal length: a thread done early takes blocks from the
    back of another's share, and every output row must still come out once, equal to a float64 matmul."""
    u, pairs = random_grid(16 * 997, 64, 32, seed=threads)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    want, packed = reference(x, u, pairs), cpu_int4.pack(u, pairs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(6):
            torch.testing.assert_close(cpu_int4.matmul(x, *packed).double(), want, rtol=2 ** -8,
                                       atol=1e-4 * float(want.abs().max()))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_pack_puts_each_code_where_the_layout_says():
    N, K = 32, 64
    u, pairs = random_grid(N, K, 32)
    codes, sz = cpu_int4.pack(u, pairs)
    assert codes.shape == (N // 16, K // 8, 32) and codes.dtype == torch.int16
    words = codes.to(torch.int32) & 0xFFFF
    for b, q, i, e, j in [(0, 0, 0, 0, 0), (1, 7, 15, 1, 3), (0, 3, 9, 0, 2), (1, 5, 4, 1, 1)]:
        assert (int(words[b, q, 2 * i + e]) >> (4 * j)) & 15 == int(u[16 * b + i, 8 * q + 2 * j + e])
    assert torch.equal(sz[1, 1, 0], pairs[1, 16:32, 0]) and torch.equal(sz[1, 1, 1], pairs[1, 16:32, 1])


@needs_kernel
@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (4, 64, True), (4, None, True), (8, 32, False)])
def test_a_layer_on_our_kernel_matches_torchs_kernel(bits, group, symmetric):
    torch.manual_seed(0)
    linear = nn.Linear(192, 48, bias=False)
    ours = QuantizedLinear.from_linear(linear, bits=bits, group_size=group, symmetric=symmetric)
    with cpu_int4.torch_kernel_only():
        theirs = QuantizedLinear.from_linear(linear, bits=bits, group_size=group, symmetric=symmetric)
    assert cpu_int4.NAME in ours.kernel_summary() and cpu_int4.NAME not in theirs.kernel_summary()
    for rows in (1, 5):
        x = torch.randn(rows, 192).bfloat16()
        a, b = ours(x).double(), theirs(x).double()
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-3 * float(b.abs().max()))


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_prefill_rows_go_dense_sooner_where_the_cpu_has_amx(monkeypatch, amx):
    """Above `cpu_int4.dense_rows()` rows (512; 64 where AMX runs the dense route's bf16 matmul) a layer
    on our kernel dequantizes and runs a dense matmul: both routes give the float64 product to rounding."""
    monkeypatch.setattr(cpu_int4, "cpu_has_amx", lambda: amx)
    u, pairs = random_grid(48, 192, 32)
    layer = QuantizedLinear.from_linear(nn.Linear(192, 48, bias=False), bits=4, group_size=32)
    bar = 64 if amx else 512
    assert cpu_int4.dense_rows() == bar and layer.dense_above() == bar
    calls = []
    _count_our_matmuls(monkeypatch, calls)
    for rows, ours in ((bar, True), (bar + 1, False)):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls.clear()
        y = layer(x).double()
        assert bool(calls) == ours, (rows, calls)
        want = x.double() @ layer.dense_weight(torch.float64).t()
        torch.testing.assert_close(y, want, rtol=2 ** -7, atol=1e-2 * float(want.abs().max()))   # bf16 rounding


@needs_kernel
def test_compiles_in_one_graph():
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(128, 32, bias=False), bits=4, group_size=32)
    x = torch.randn(1, 128).bfloat16()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_torch_kernel_only_is_scoped_and_shapes_it_cannot_run_use_torchs_kernel():
    torch.manual_seed(0)
    with cpu_int4.torch_kernel_only():
        inside = QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), bits=4, group_size=32)
    assert cpu_int4.NAME not in inside.kernel_summary()
    odd_rows = QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), bits=4, group_size=32,
                                           compute_dtype=torch.float32)   # fp32 activations: torch's kernel
    assert cpu_int4.NAME not in odd_rows.kernel_summary()
    after = QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), bits=4, group_size=32)
    assert (cpu_int4.NAME in after.kernel_summary()) == (why_not is None)


def test_a_failed_build_is_announced_once_and_layers_run_torchs_kernel(monkeypatch):
    monkeypatch.setattr(cpu_int4, "cpu_supports", lambda: None)                  # the CPU could run it...
    monkeypatch.setattr(cpu_int4, "build", lambda: "building int4_gemv.cpp failed (no compiler)")   # ...but
    cpu_int4._announce.cache_clear()
    with pytest.warns(RuntimeWarning, match="int4 layers use torch's kernel: building int4_gemv.cpp failed"):
        layer = QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), bits=4, group_size=32)
    assert cpu_int4.NAME not in layer.kernel_summary() and layer.packed_weight().kernel == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                           # said once, not per layer
        QuantizedLinear.from_linear(nn.Linear(64, 32, bias=False), bits=4, group_size=32)
    cpu_int4._announce.cache_clear()
