"""Opt in: int4 layers run a prefill's many-row matmuls as one compiled dequantization + a dense matmul.

torch's int4pack CPU kernel is built for decode's few rows: its cost grows with every row, so a
128-token prompt pays for 128 matrix-vector products. A prefill is compute-bound, and a dense bf16
matmul (AMX or AVX-512 through oneDNN) is many times faster per row, once the weight is dense. The
catch is the dequantization: eagerly it is several passes over the full matrix, so it only paid off
for long prompts (`PACKED_MAX_ROWS`). Compiled for each weight shape, it is one fused loop (read the
nibbles, write the bf16 matrix), cheap enough that the dense route wins from a few dozen rows on
(`DENSE_ROWS`; `bench llamacpp` measures the prefill this gives).

`compile_dense_prefill(model)` applies it in place, as `fuse_projections` or `tune_for_cpu` do: every
int4pack `QuantizedLinear` gets the compiled `int4pack_dense`, and those on torch's kernel the lower
bar (our CPU kernel, `cpu_int4`, decodes codes cheaply enough to keep its own, higher one). What it
multiplies by is unchanged (the kernel's own weights, to the bit); `undo_dense_prefill` puts the eager
one back.
The CLI's fast path applies it on a CPU with its compiled decode step (`fast_path`), and compiles it
during the step's warm-up.
"""

from __future__ import annotations

import torch

from ... import _checks
from ...generation.compiled import _own_code, compile_settings
from ...quantization.kernels import announce_fallback, int4pack_dense
from ...quantization.linear import QuantizedLinear

# Rows (tokens x batch) above which the compiled dequantization + dense matmul beats the int4pack
# kernel: where the two crossed on SmolLM2's layers here, at one and at two threads.
DENSE_ROWS = 64


class CompiledDense:
    """`int4pack_dense`, compiled once per weight shape: a static shape vectorizes into one loop, where
    one dynamic graph for all shapes does not. A shape that cannot be compiled (no C++ compiler, say)
    is announced once and dequantized eagerly."""

    def __init__(self):
        self.compiled: dict[tuple, object] = {}

    def __call__(self, nibbles: torch.Tensor, scales: torch.Tensor, group_size: int, signed: bool) -> torch.Tensor:
        key = (tuple(nibbles.shape), nibbles.device, scales.dtype, group_size, signed)
        fn = self.compiled.get(key)
        if fn is not None:
            return fn(nibbles, scales, group_size, signed)
        # A code object of its own per shape: dynamo's recompile limit counts graphs per code object. No
        # guard on the global state: a prefill under inference_mode, or on one thread, reuses the graph.
        fn = torch.compile(_own_code(int4pack_dense), **compile_settings(dynamic=False))
        try:
            out = fn(nibbles, scales, group_size, signed)
        except Exception as error:   # compiling failed: the same arithmetic, eagerly
            announce_fallback(f"compile_dense_prefill: dequantizing eagerly, the compiled kernel for weight "
                              f"{key[0]} failed to build ({type(error).__name__}: {error})")
            fn, out = int4pack_dense, int4pack_dense(nibbles, scales, group_size, signed)
        self.compiled[key] = fn
        return out


def int4pack_layers(model: torch.nn.Module) -> list[QuantizedLinear]:
    """The `QuantizedLinear`s of `model` that run the int4pack kernel (what this module speeds up)."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)
            and m._packed is not None and m._packed.layout == "int4pack"]


def compile_dense_prefill(model: torch.nn.Module, rows: int = DENSE_ROWS, warm: bool = True) -> torch.nn.Module:
    """In place: every int4pack layer of `model` dequantizes through one `CompiledDense` and takes the
    dense route above `rows` rows (a positive int). warm: compile every weight shape now
    (`warm_dense_prefill`), not in the middle of the first long prompt. Returns the model."""
    rows, warm = _checks.positive_int("rows", rows), _checks.boolean("warm", warm)
    dense = CompiledDense()
    for layer in int4pack_layers(model):   # our CPU kernel keeps its own bar (`cpu_int4.dense_rows()`)
        layer.dense_fn, layer.dense_rows = dense, rows if layer._packed.kernel == "torch" else None
    return warm_dense_prefill(model) if warm else model


def warm_dense_prefill(model: torch.nn.Module) -> torch.nn.Module:
    """Compile now what `compile_dense_prefill` compiles at each weight shape's first long prompt: each
    layer it was applied to runs its dense route once. Returns the model."""
    with torch.inference_mode():   # as generate, chat and the engine run: dynamo's graphs depend on it
        for layer in int4pack_layers(model):
            if isinstance(layer.dense_fn, CompiledDense):   # the dense route once: the dense matmul warms up too
                layer(torch.zeros(layer.dense_above() + 1, layer.in_features, dtype=layer._packed.scales.dtype,
                                  device=layer.qweight.device))
    return model


def undo_dense_prefill(model: torch.nn.Module) -> torch.nn.Module:
    """Put every int4pack layer back on the eager dequantization and its kernel's own bar."""
    for layer in int4pack_layers(model):
        layer.dense_fn, layer.dense_rows = int4pack_dense, None
    return model


__all__ = ["DENSE_ROWS", "CompiledDense", "compile_dense_prefill", "int4pack_layers", "undo_dense_prefill",
           "warm_dense_prefill"]
