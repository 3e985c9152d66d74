"""A `torch.compile`d decode step: one graph for every position and batch size, no graph breaks.

Per decode step the model runs ~20 small ops per layer besides its matmuls (norms, RoPE, cache
writes, attention, residuals), each a Python call and a kernel launch; at batch 1 on a CPU that is
a sizeable slice of the step. `torch.compile` traces the whole forward once into one graph and fuses
those element-wise ops. The model needs no special-casing for it: a decode step reads no tensor value
back to Python (its checks run at the edges: the prefill checks the ids and the cache), `dynamic=True`
makes the position a symbol rather than a new graph per step, and the graph does not guard on
torch's global state flags (`GLOBAL_STATE`: the thread count, autocast, TF32 switches), so a caller
that runs some steps on one thread (`cpu_tuning.decode_threads`) does not recompile the graph, tens
of seconds on a CPU. The compiled kernels read the thread count when they run, so the same graph
serves both. Grad mode, dtypes and shapes still guard.
The first call compiles (tens of seconds on a CPU); later calls reuse the graph.
"""

from __future__ import annotations

import torch

from ..model.kv_cache import KVCache


def _without_global_state(entries) -> list[bool]:
    """Keep every guard but the one on torch's global flags (it includes the thread count)."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in entries]


def compile_decode(model, **compile_options):
    """Return `step(token_ids (B,), cache) -> logits (B, V)`, a compiled `decode_one_token` for `model`.

    compile_options go to `torch.compile` (default: fullgraph=True, dynamic=True, and
    options={"guard_filter_fn": ...} dropping the global-state guard; see the module docstring).
    A cache's first forward (its prefill) runs eagerly, where the model checks the cache.
    """
    options = dict(fullgraph=True, dynamic=True)
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):   # torch >= 2.7 takes guard_filter_fn
        options["options"] = {"guard_filter_fn": _without_global_state}   # (older: a thread switch recompiles)
    options |= compile_options
    compiled = torch.compile(model, **options)

    def step(token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError("token_ids must be a 1-D integer tensor (B,) holding one token per sequence")
        if not isinstance(cache, KVCache) or cache.length == 0:   # the edge: eager, with the model's checks
            return model(token_ids[:, None], cache=cache)[:, -1]
        ids = token_ids[:, None].clone(memory_format=torch.contiguous_format)   # fresh strides: no guard on them
        return compiled(ids, cache=cache)[:, -1]

    return step
