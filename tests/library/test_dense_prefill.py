"""An int4 layer's dense (prefill) route multiplies by its kernel's own matrix, and the opt-in compiled
dequantization (`compile_dense_prefill`) changes where that route starts, not what it computes.

Reference: the layer's packed kernel itself (torch's int4pack, or ours where the CPU has AVX512-BF16),
applied to the identity matrix (row k of I @ W^T is column k of W as the kernel sees it, rounded once
to bf16 like its output), and the packed matmul on few rows. The tests of where the route starts run
torch's kernel (`cpu_int4.torch_kernel_only`), whose bar `compile_dense_prefill` lowers; ours keeps its own.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from adapters import (make_config, make_model, run_compile_dense_prefill, run_int4pack_dense, run_packed_matmul,
                      run_quantize_model)

from cs336_inference.quantization import QuantizedLinear, SlowKernelWarning, quantize_tensor
from cs336_inference.workshop.kernels import cpu_int4
from cs336_inference.workshop.kernels import dense_prefill
from cs336_inference.quantization.kernels import PACKED_MAX_ROWS, int4pack_dense

CFG = dict(vocab_size=257, context_length=48, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128)


def _layer(kind: str, out_features=48, in_features=192, group_size=32, seed=0) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    if kind == "min-offset":   # GGUF's Q4_1: w = q * scale + minimum
        qt = quantize_tensor(w, 4, False, "group", group_size)
        minimum = -torch.rand(qt.scale.shape, generator=g)
        return QuantizedLinear(qt, minimum=minimum, out_dtype=torch.float32)
    granularity = "channel" if group_size is None else "group"
    return QuantizedLinear(quantize_tensor(w, 4, kind == "symmetric", granularity, group_size), out_dtype=torch.float32)


LAYERS = [("symmetric", 32), ("affine", 64), ("min-offset", 32), ("symmetric", None), ("affine", 192)]


@pytest.mark.parametrize("kind,group_size", LAYERS)
def test_int4pack_dense_is_the_kernels_own_matrix(kind, group_size):
    layer = _layer(kind, group_size=group_size)
    assert layer.packed_weight().layout == "int4pack"
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    kernel_matrix = run_packed_matmul(eye, layer).T                                # (O, I)
    dense = run_int4pack_dense(layer)
    assert dense.dtype == torch.bfloat16 and dense.shape == (layer.out_features, layer.in_features)
    assert torch.equal(dense, kernel_matrix)
    # and both are the layer's exact dequantization up to bf16 rounding: of the scale and the zero
    # (w = (u - 8) * scale + zero, |u - 8| <= 8) and of the result, each relative 2^-8 (bf16)
    exact = layer.dequantized_weight(torch.float32)
    _, scale, offset = layer.unsigned_form()
    per_input = lambda t: t.repeat_interleave(layer.in_features // t.shape[1], dim=1)   # noqa: E731
    bound = 2 ** -8 * (8 * per_input(scale).abs() + per_input(offset + 8 * scale).abs() + exact.abs())
    assert bool(((dense.float() - exact).abs() <= bound).all())


@pytest.mark.parametrize("kind,group_size", LAYERS[:3])
def test_rows_above_the_bar_take_the_dense_route_below_it_the_kernel(kind, group_size):
    layer = _layer(kind, group_size=group_size)
    dense = run_int4pack_dense(layer)
    g = torch.Generator().manual_seed(1)
    bar = layer.dense_above()
    assert layer.dense_rows is None and bar == layer.packed_weight().max_rows   # the kernel's own bar
    for rows in (1, bar, bar + 1):
        x = torch.randn(rows, layer.in_features, generator=g).to(torch.bfloat16)
        expected = F.linear(x, dense) if rows > bar else run_packed_matmul(x, layer)
        assert torch.equal(layer(x), expected), rows
    layer.dense_rows = 4                                      # what compile_dense_prefill lowers
    x = torch.randn(2, 5, layer.in_features, generator=g).to(torch.bfloat16)    # 10 rows
    assert torch.equal(layer(x), F.linear(x, dense))
    # fp32 activations above the bar: the exact dequantization, not the kernel's bf16 matrix; or, on our CPU
    # kernel, which takes fp32 activations at every row count (batch invariance), that kernel
    x = torch.randn(max(PACKED_MAX_ROWS, bar) + 1, layer.in_features, generator=g)
    if layer.packed_weight().kernel == cpu_int4.NAME:
        assert torch.equal(layer(x), run_packed_matmul(x, layer))
    else:
        assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(torch.float32)))


class _Compiles:
    """Stands in for torch.compile: counts the functions compiled; `fail` makes each one raise."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    def __call__(self, fn, **options):
        self.calls += 1
        assert options["fullgraph"] is True and options["dynamic"] is False   # one graph per weight shape

        def run(*args):
            if self.fail:
                raise RuntimeError("no C++ compiler")
            return fn(*args)
        return run


def _int4_model(torch_kernel: bool = True):
    model = make_model(make_config(**CFG), seed=0)
    with cpu_int4.torch_kernel_only() if torch_kernel else contextlib.nullcontext():
        return run_quantize_model(model, "rtn", 4, 32, symmetric=True).to(torch.bfloat16)


def test_compile_dense_prefill_moves_the_bar_and_undo_restores_it(monkeypatch):
    compiles = _Compiles()
    monkeypatch.setattr(torch, "compile", compiles)
    model, plain = _int4_model(), _int4_model()
    layers = dense_prefill.int4pack_layers(model)
    assert len(layers) == 2 * 7 and not dense_prefill.int4pack_layers(nn.Linear(4, 4))   # q k v o w1 w2 w3
    assert run_compile_dense_prefill(model, rows=8) is model
    shapes = {tuple(layer.qweight.shape) for layer in layers}
    assert compiles.calls == len(shapes)                                        # warmed: one per weight shape
    assert all(layer.dense_rows == 8 and isinstance(layer.dense_fn, dense_prefill.CompiledDense) for layer in layers)
    assert "above 8 rows: compiled dequantize + dense matmul" in model.describe()
    ids = torch.randint(0, CFG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    for layer in dense_prefill.int4pack_layers(plain):
        layer.dense_rows = 8                                                    # same route, eager dequantization
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))
    assert compiles.calls == len(shapes)                                        # nothing compiled twice
    dense_prefill.undo_dense_prefill(model)
    assert all(layer.dense_above() == PACKED_MAX_ROWS and layer.dense_fn is int4pack_dense for layer in layers)
    assert "compiled" not in model.describe()


def test_compile_dense_prefill_refuses_bad_options_and_leaves_the_model_alone():
    model = _int4_model()
    for bad, error in (({"rows": 0}, ValueError), ({"rows": "64"}, TypeError), ({"rows": True}, TypeError),
                       ({"warm": "yes"}, TypeError)):
        with pytest.raises(error, match=next(iter(bad))):
            run_compile_dense_prefill(model, **bad)
    assert all(layer.dense_fn is int4pack_dense and layer.dense_rows is None
               for layer in dense_prefill.int4pack_layers(model))


def test_a_shape_that_fails_to_compile_is_announced_once_and_dequantized_eagerly(monkeypatch):
    compiles = _Compiles(fail=True)
    monkeypatch.setattr(torch, "compile", compiles)
    layer = _layer("symmetric").to(torch.bfloat16)
    packed, dense = layer.packed_weight(), dense_prefill.CompiledDense()
    args = (layer.qweight, packed.scales, packed.group_size, True)
    with pytest.warns(SlowKernelWarning, match="dequantizing eagerly.*RuntimeError: no C\\+\\+ compiler"):
        out = dense(*args)
    assert torch.equal(out, int4pack_dense(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(dense(*args), out)                                   # no second try, no second warning
    assert compiles.calls == 1


@pytest.mark.slow
def test_the_compiled_dequantization_equals_the_eager_one_bit_for_bit():
    dense = dense_prefill.CompiledDense()
    for kind, group_size in LAYERS[:3]:
        layer = _layer(kind, group_size=group_size)
        packed = layer.packed_weight()
        args = (layer.qweight, packed.scales, packed.group_size, layer.symmetric)
        assert torch.equal(dense(*args), int4pack_dense(*args)), kind
    assert all(fn is not int4pack_dense for fn in dense.compiled.values())     # each shape compiled for real


def test_the_fast_path_applies_it_to_an_int4_model_and_compiles_it_in_the_warm_up(monkeypatch, capsys):
    from cs336_inference import cli
    from cs336_inference.workshop import fast_path

    compiles = _Compiles()
    monkeypatch.setattr(torch, "compile", compiles)
    model = _int4_model()
    how = fast_path._dense_prefill(model)
    assert how == f", prefill above {dense_prefill.DENSE_ROWS} rows: compiled int4 dequantization + dense matmul"
    assert compiles.calls == 0                                                  # compiled in the warm-up, not here
    assert all(layer.dense_rows == dense_prefill.DENSE_ROWS for layer in dense_prefill.int4pack_layers(model))
    cli._compile_first("compiled decode" + how, decode=object(), warm_up=lambda: None, model=model)
    assert compiles.calls == len({tuple(layer.qweight.shape) for layer in dense_prefill.int4pack_layers(model)})
    assert "prefill above" in capsys.readouterr().err
    assert fast_path._dense_prefill(make_model(make_config(**CFG), seed=0)) == ""   # no int4 layers: nothing


@pytest.mark.skipif(cpu_int4.why_unavailable() is not None, reason=f"our int4 kernel cannot run here: "
                                                                   f"{cpu_int4.why_unavailable()}")
def test_layers_on_our_kernel_keep_their_own_bar_and_get_the_compiled_dequantization(monkeypatch):
    monkeypatch.setattr(torch, "compile", _Compiles())
    model = _int4_model(torch_kernel=False)
    layers = dense_prefill.int4pack_layers(model)
    assert layers and all(layer.packed_weight().kernel == cpu_int4.NAME for layer in layers)
    how = __import__("cs336_inference.workshop.fast_path", fromlist=["_"])._dense_prefill(model)
    assert how == f", prefill above {cpu_int4.dense_rows()} rows: compiled int4 dequantization + dense matmul"
    assert all(layer.dense_above() == cpu_int4.dense_rows() and isinstance(layer.dense_fn, dense_prefill.CompiledDense)
               for layer in layers)


@pytest.mark.slow
def test_a_warmed_model_prefills_without_compiling_again():
    """The warm-up compiles under inference_mode, as `prefill`, `chat` and the engine run: their first
    long prompt then reuses every graph (a graph compiled under no_grad alone would not match)."""
    from torch._dynamo.utils import counters

    from cs336_inference.generation import prefill

    model = run_compile_dense_prefill(_int4_model(), rows=8)
    compiled = counters["stats"]["unique_graphs"]
    ids = torch.randint(0, CFG["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = prefill(model, ids, model.new_cache(1, 32))
    assert counters["stats"]["unique_graphs"] == compiled
    eager = dense_prefill.undo_dense_prefill(_int4_model())
    for layer in dense_prefill.int4pack_layers(eager):
        layer.dense_rows = 8
    with torch.inference_mode():
        assert torch.equal(logits, prefill(eager, ids, eager.new_cache(1, 32)))   # the same numbers, compiled or not
