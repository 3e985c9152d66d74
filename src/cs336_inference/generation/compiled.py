"""A `torch.compile`d decode step: one graph for every position and batch size, no graph breaks.

Per decode step the model runs ~20 small ops per layer besides its matmuls (norms, RoPE, cache
writes, attention, residuals), each a Python call and a kernel launch; at batch 1 that is a sizeable
slice of the step. `torch.compile` traces the whole forward once into one graph and fuses those
element-wise ops. The model needs no special-casing for it: a decode step reads no tensor value back
to Python (its checks run at the edges: the prefill checks the ids and the cache), `dynamic=True`
makes the position a symbol rather than a new graph per step, and the graph does not guard on
torch's global state flags (`GLOBAL_STATE`: the thread count, autocast, TF32 switches), so a caller
that runs some steps on one thread (`cpu_tuning.decode_threads`) does not recompile the graph, tens
of seconds on a CPU. The compiled kernels read the thread count when they run. Grad mode, dtypes
and shapes still guard. The first call compiles (tens of seconds on a CPU); later calls reuse the graph.
Before each call dynamo checks the graph's guards, hundreds of them on a real model's modules; a
caller whose model stays as it is once compiled (the CLI's fast path) passes `frozen=True`: only the
step's inputs (the ids and the cache) are checked, and the model's weights are the graph's own
parameters instead of inputs that dynamo fetches one by one before each call.

`mode="reduce-overhead"` adds CUDA graphs: the GPU replays the step's recorded kernels in one launch.
A recording replays fixed kernels on fixed addresses, so that step must not change shape or read a
host number: it runs as a `StaticDecodeStep` (the position is a device tensor, each layer writes at it
with `index_copy_` and attends over its whole preallocated buffer under a mask, and the buffers are
marked as static addresses); the host-side length advances after the graph has run.
"""

from __future__ import annotations

import types
import weakref

import torch

from .. import _checks
from ..model.attention import grouped_attention
from ..model.kv_cache import ContiguousKVCache, ForwardStep, KVCache, unique_layers


def _without_global_state(entries) -> list[bool]:
    """Keep every guard but the one on torch's global flags (it includes the thread count)."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in entries]


def without_model_guards(entries) -> list[bool]:
    """Keep only the guards on the step's inputs (the ids and the cache): drop the global-state guard
    and every guard on the model's modules, for a model that nobody changes once it is compiled. A
    guard is a check that dynamo runs before every call to see whether the graph still applies; on a
    real model there are hundreds on its modules (each weight's shape, dtype and identity, each
    attribute the forward read), checked at every decode step. Weights changed in place are read at
    each call, but a model changed otherwise after compiling (weights of another shape or dtype,
    another attention kernel) would silently run the old graph: compile it again."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    # also: whether someone marked a cache tensor's dims dynamic by hand (five checks per tensor; nobody does)
    dropped = ("GLOBAL_STATE", "DIMENSION_DYNAMIC_MARKING_GUARD")
    return [kept and entry.guard_type not in dropped for entry, kept in zip(entries, keep)]


class _StaticLayer:
    """A contiguous layer cache as a static step sees it: written at the position tensor, attended whole."""

    def __init__(self, layer: ContiguousKVCache):
        self.layer = layer

    def update(self, k: torch.Tensor, v: torch.Tensor, step: StaticDecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        self.layer.k.index_copy_(2, step.positions, k)   # (B, K, 1, H) into slot `position`
        self.layer.v.index_copy_(2, step.positions, v)
        return self.layer.k, self.layer.v                # (B, K, S_max, H): the same shape at every position

    def attend(self, q, kv, step: StaticDecodeStep, scale: float | None = None, kernel: str = "reference"):
        return grouped_attention(q, *kv, step.mask, scale, kernel=kernel)


class StaticDecodeStep(ForwardStep):
    """One decode token per sequence at `position` (a (1,) device tensor: every sequence of the cache is
    at the same length), with shapes that do not depend on it: what a CUDA graph can replay."""

    def __init__(self, cache: KVCache, position: torch.Tensor):
        views = [_StaticLayer(layer) for layer in unique_layers(cache.layers)]   # CLA groups share one
        self.layers = []
        for layer in cache.layers:
            for view in views:
                if view.layer is layer:
                    self.layers.append(view)
        self.positions = position                                                      # (1,)
        keys = torch.arange(cache.max_seq_len, device=position.device)                 # (S_max,)
        self.mask = (keys <= position)[None, None, None, :]                            # (1, 1, 1, S_max)

    def select_last(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1:]

    def commit(self) -> None:
        """Nothing inside the graph: the writes went to their slots, and `compile_decode`'s step advances
        the cache's host-side length after the graph ran (a graph must not read or write a host int)."""


def static_decode(model, token_ids: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """token_ids (B, 1) at `position` ((1,) device tensor = cache.length) -> logits (B, 1, V), as a
    `StaticDecodeStep`: what `compile_decode(mode="reduce-overhead")` records. The caller advances
    cache.length afterwards."""
    return model(token_ids, step=StaticDecodeStep(cache, position))


def compile_settings(frozen: bool = False, **compile_options) -> dict:
    """`torch.compile`'s keyword arguments for a decode step: fullgraph=True, dynamic=True (False for
    mode="reduce-overhead": a CUDA graph replays fixed shapes) and, where torch can filter guards, no
    guard on the global state (`frozen`: none on the model either, `without_model_guards`); `options`
    given here add to inductor's options, the rest override."""
    static = compile_options.get("mode") == "reduce-overhead"
    options = dict(fullgraph=True, dynamic=not static)
    inductor = compile_options.pop("options", {})
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe") and not static:   # torch >= 2.7
        keep = without_model_guards if frozen else _without_global_state   # (older: a thread switch recompiles)
        inductor = {"guard_filter_fn": keep} | inductor
    return options | compile_options | ({"options": inductor} if inductor else {})


def _own_code(fn):
    """`fn` with a copy of its code object. Dynamo keeps compiled graphs per code object and picks one
    by its guards; without guards on the model, two models compiled from the same code would share
    (and run) each other's graphs. A copy per model keeps them apart."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _frozen_tracing(compiled):
    """`compiled` tracing a frozen model's attributes as part of the graph, not as its inputs:
    - its floats (each RMSNorm's eps, ...) as constants: under dynamic=True dynamo makes each a graph
      input and turns it into a tensor before every step (61 of them on SmolLM2);
    - its weights as the graph's own parameters (`install_free_tensors`): otherwise dynamo's code before
      the graph fetches each one through the module tree at every step (~300 on SmolLM2), while the
      graph's parameters are handed over as one list. Still the same tensors, not copies: a weight
      changed in place is read at the next step.
    `frozen` promises the model does not change. The settings must hold while dynamo traces, that is
    inside each call (a new batch size traces again); torch's global config is left as it was."""
    settings = {name: True for name in ("specialize_float", "install_free_tensors")
                if hasattr(torch._dynamo.config, name)}   # older torch: floats were constants anyway
    if not settings:
        return compiled
    tracing = torch._dynamo.config.patch(settings)   # made once, reused by every call

    def call(*args, **kwargs):
        with tracing:
            return compiled(*args, **kwargs)
    return call


def compile_decode(model, frozen: bool = False, **compile_options):
    """Return `step(token_ids (B,), cache) -> logits (B, V)`, a compiled `decode_one_token` for `model`.

    compile_options go to `torch.compile` (default: fullgraph=True, dynamic=True, and
    options={"guard_filter_fn": ...} dropping the global-state guard; see the module docstring); an
    `options` dict given here adds to that one (the CLI's fast path adds `fast_path.CPU_INDUCTOR`).
    frozen=True promises that `model` does not change once compiled: the step then checks guards on
    its inputs only (`without_model_guards`), which saves checking hundreds of guards on the model
    before every step, and traces the model's floats as constants and its weights as the graph's own
    parameters, which saves fetching each one before every step (`_frozen_tracing`; the CLI's fast
    path does this).
    mode="reduce-overhead" (CUDA graphs) runs each step as a `StaticDecodeStep` (dynamic=False: one
    recording per batch size). A cache's first forward (its prefill) runs eagerly, where the model
    checks the cache.
    """
    static = compile_options.get("mode") == "reduce-overhead"
    options = compile_settings(_checks.boolean("frozen", frozen), **compile_options)
    if static:
        compiled = torch.compile(lambda ids, position, cache: static_decode(model, ids, position, cache), **options)
    elif frozen:
        traced = _own_code(lambda ids, cache: model(ids, cache=cache))
        compiled = _frozen_tracing(torch.compile(traced, **options))
    else:
        compiled = torch.compile(model, **options)
    marked = weakref.WeakSet()   # caches whose buffers are marked as static addresses

    def step(token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError("token_ids must be a 1-D integer tensor (B,) holding one token per sequence")
        if not isinstance(cache, KVCache) or cache.length == 0:   # the edge: eager, with the model's checks
            return model(token_ids[:, None], cache=cache)[:, -1]
        if cache.length >= cache.max_seq_len or token_ids.shape[0] != cache.batch_size:
            # refused here, eagerly: traced, the cache's error message (an f-string of a symbolic size)
            # would surface as a dynamo tracing error instead of the ValueError
            cache.begin(1, batch_size=token_ids.shape[0])   # raises, naming the overflow or the batch size
        ids = token_ids[:, None].clone(memory_format=torch.contiguous_format)   # fresh strides: no guard on them
        if not static:
            return compiled(ids, cache=cache)[:, -1]
        if cache not in marked:
            for layer in cache.unique_layers():
                if not isinstance(layer, ContiguousKVCache):
                    raise TypeError(f"a static (CUDA-graph) decode step needs contiguous layer caches, got "
                                    f"{type(layer).__name__}; compile without mode='reduce-overhead'")
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
            marked.add(cache)
        position = torch.full((1,), cache.length, dtype=torch.long, device=cache.device)   # host -> device
        logits = compiled(ids, position, cache)[:, -1].clone()   # the graph's output memory is reused next replay
        cache.length += 1   # the host side of the step's commit
        return logits

    if frozen:
        _forget_graphs_when_gone(step, traced.__code__)
    return step


def compile_verify(model, frozen: bool = False, **compile_options):
    """Return `verify(token_ids (B, T), cache, return_hidden=False)`, a compiled forward of T tokens
    appended to a cache, with the model's own signature and results (logits (B, T, V), and hidden
    (B, T, D) with return_hidden): the pass that checks a speculative step's drafts
    (`speculative_generate(..., verify_step=verify)`).

    Eager, that pass pays the same per-op overhead a decode step does (see the module docstring), and
    it runs once per speculative step. The graph is the decode step's, traced for a token count T that
    is a symbol (a T of 1 is specialised: one more graph), so one graph serves every draft length.
    compile_options and `frozen` as in `compile_decode`; CUDA graphs (mode="reduce-overhead") need
    fixed shapes and are refused. A cache's first forward (its prefill) runs eagerly, checked.
    """
    if compile_options.get("mode") == "reduce-overhead":
        raise ValueError("compile_verify: mode='reduce-overhead' (CUDA graphs) needs fixed shapes, and a verify "
                         "pass has as many tokens as its drafts; compile without it")
    options = compile_settings(_checks.boolean("frozen", frozen), **compile_options)
    graphs = {}   # return_hidden -> the compiled forward, each traced at its first use

    def compiled(hidden: bool):
        if hidden not in graphs:
            forward = _own_code(lambda ids, cache, hidden=hidden: model(ids, cache=cache, return_hidden=hidden))
            graph = torch.compile(forward, **options)
            graphs[hidden] = _frozen_tracing(graph) if frozen else graph
            if frozen:
                _forget_graphs_when_gone(verify, forward.__code__)
        return graphs[hidden]

    def verify(token_ids: torch.Tensor, cache: KVCache, return_hidden: bool = False):
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype.is_floating_point:
            raise ValueError("token_ids must be a 2-D integer tensor (B, T): T tokens per sequence")
        B, T = token_ids.shape
        if not isinstance(cache, KVCache) or cache.length == 0 or T == 0:   # the edges: eager, the model's checks
            return model(token_ids, cache=cache, return_hidden=return_hidden)
        if cache.length + T > cache.max_seq_len or B != cache.batch_size:
            cache.begin(T, batch_size=B)   # raises eagerly, naming the overflow or the batch size
        ids = token_ids.clone(memory_format=torch.contiguous_format)   # fresh strides: no guard on them
        return compiled(_checks.boolean("return_hidden", return_hidden))(ids, cache)

    return verify


def _forget_graphs_when_gone(step, code) -> None:
    """Once `step` is garbage, drop the graphs dynamo keeps on `code` (the step's own copy, `_own_code`).
    A frozen graph holds the model's weights as its own parameters, and dynamo keeps a code object's
    graphs through references the garbage collector cannot follow: without this, a model compiled
    frozen and then dropped would stay in memory for the life of the process."""
    reset_code = getattr(torch._dynamo.eval_frame, "reset_code", None)
    if reset_code is not None:
        weakref.finalize(step, reset_code, code)
