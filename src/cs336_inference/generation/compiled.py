"""A `torch.compile`d decode step: one graph for every position and batch size, no graph breaks.

Per decode step the model runs ~20 small ops per layer besides its matmuls (norms, RoPE, cache
writes, attention, residuals), each a Python call and a kernel launch; at batch 1 on a CPU that is
a sizeable slice of the step. `torch.compile` traces the whole forward once into one graph and fuses
those element-wise ops. What keeps the graph whole and reused: the model skips reading token ids back to
Python and checking the cache's identity while compiling (this step checks both eagerly instead),
`Linear` skips its thread-count dependent path, `dynamic=True` makes the position a symbol
rather than a new graph per step, and the graph does not guard on torch's global state flags
(`GLOBAL_STATE`: the thread count, autocast, TF32 switches): the step runs on one thread while another
process holds a core (`timing.decode_threads`), and a guard on the thread count would recompile the
graph, tens of seconds, the first time that happens. The compiled kernels read the thread count when
they run, so the same graph serves both. Grad mode, dtypes and shapes still guard.
The first call compiles (tens of seconds on a CPU); later calls reuse the graph.
"""

from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..timing import decode_threads


def _without_global_state(entries) -> list[bool]:
    """Keep every guard but the one on torch's global flags (it includes the thread count)."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in entries]


def compile_decode(model, **compile_options):
    """Return `step(token_ids (B,), cache) -> logits (B, V)`, a compiled `decode_one_token` for `model`.

    compile_options go to `torch.compile` (default: fullgraph=True, dynamic=True, and
    options={"guard_filter_fn": ...} dropping the global-state guard; see the module docstring).
    """
    options = dict(fullgraph=True, dynamic=True)
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):   # torch >= 2.7 takes guard_filter_fn
        options["options"] = {"guard_filter_fn": _without_global_state}   # (older: a thread switch recompiles)
    options |= compile_options
    compiled = torch.compile(model, **options)
    vocab = model.config.vocab_size

    def step(token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError("token_ids must be a 1-D tensor (B,) holding one token per sequence")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, vocab_size={vocab}), got {token_ids.tolist()}")
        model._check_cache(cache, token_ids.shape[0])   # eagerly: the graph must not guard on the cache object
        ids = token_ids[:, None].clone(memory_format=torch.contiguous_format)   # fresh strides: no guard on them
        with decode_threads():   # the graph's kernels run on torch's threads, read at each call
            return compiled(ids, cache=cache)[:, -1]

    return step
